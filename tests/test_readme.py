"""The README's quick-start snippets run as written, each in a fresh process with a clean
environment (no ``USE_TF``, no ``HF_*``, no ``KERAS_BACKEND``: only what a new user's
shell has), and write a valid run.

The Hugging Face snippet is the case of issue 26 item 4: with TensorFlow and Keras 3
installed (the ``[all]`` extra), ``from transformers import Trainer`` must work with no
environment variable — transformers 5.x has no TensorFlow side, and transformers 4.x gets
``tf-keras`` from the ``[all]`` extra.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import traintape
from traintape.core.validate import validate

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _quick_start_snippets() -> dict[str, str]:
    """The Python code block under each ``###`` heading of the README's Quick start."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    out = {}
    for part in section.split("\n### ")[1:]:
        heading = part.splitlines()[0].strip()
        m = re.search(r"```python\n(.*?)```", part, flags=re.S)
        assert m, f"no python snippet under {heading!r}"
        out[heading] = m[1]
    return out


SNIPPETS = _quick_start_snippets()
# heading -> (module the snippet needs, the run directory it writes)
NEEDS = {
    "JAX (Flax, equinox, optax)": ("flax", "runs/jax"),
    "PyTorch": ("torch", "runs/torch"),
    "TensorFlow / Keras": ("tensorflow", "runs/keras"),
    "Hugging Face Trainer": ("transformers", "runs/hf"),
}


def test_every_snippet_is_checked():
    assert set(SNIPPETS) == set(NEEDS)


def _clean_env(home: Path) -> dict[str, str]:
    """A new user's shell: PATH and HOME; this checkout on the path (an installed
    traintape needs no PYTHONPATH); nothing a user must know about."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(REPO),
    }


@pytest.mark.parametrize("heading", list(NEEDS))
def test_readme_snippet_runs_as_written(heading: str, tmp_path: Path):
    module, run_dir = NEEDS[heading]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    home = tmp_path / "home"
    home.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", SNIPPETS[heading]],
        cwd=tmp_path, env=_clean_env(home), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    out = str(tmp_path / run_dir)
    report = validate(out)
    assert report.ok, report.problems
    run = traintape.open_run(out)
    assert run.manifest.status == "closed"
    assert run.rows > 0
    assert {"param", "grad"} <= {k.value for k in run.kinds()}


def test_transformers_trainer_imports_without_an_environment_variable(tmp_path: Path):
    """``from transformers import Trainer`` in a clean environment where TensorFlow and
    Keras 3 are installed too (the ``[all]`` environment)."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    r = subprocess.run(
        [sys.executable, "-c", "from transformers import Trainer; import transformers; "
         "print(transformers.__version__)"],
        cwd=tmp_path, env=_clean_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
