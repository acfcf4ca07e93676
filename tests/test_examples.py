"""The scripts in examples/ run as documented and write valid stores."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

import traintape
from traintape import Kind
from traintape.core.validate import validate

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("jax_quickstart", 60),
        ("torch_mlp", 5),
        ("tf_custom_loop", 5),
        ("tf_keras_fit", 1),
        ("hf_trainer", 3),
        ("lightning", 3),
        ("peft_lora", 3),
    ],
)
def test_example_writes_a_valid_store(tmp_path, name: str, size: int) -> None:
    out = str(tmp_path / name)
    _load(name).main(out, size)  # steps (epochs for tf_keras_fit)
    report = validate(out)
    assert report.ok, report.problems
    run = traintape.open_run(out)
    assert run.manifest.status == "closed"
    assert {Kind.PARAM, Kind.GRAD, Kind.UPDATE} <= set(run.kinds())
    assert run.rows > 0 and len(run.steps) == run.rows
