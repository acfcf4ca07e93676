"""Issue 26 items 1-2 as a user meets them, in subprocesses (tests/_resume_child.py):

1. resume as the README shows it — ``Recorder(url, resume_step=15)`` after a SIGKILL at
   step 22, adapters without any start step — records steps 15.. without a warning and
   ``close()`` succeeds (JAX: Flax Linen + an optax chain; torch ``watch``);
2. ``watch(..., kinds=("update", "opt_state"))`` under the default policy (which leaves
   ``opt_state`` out) records ``opt_state``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import traintape

CHILD = str(Path(__file__).with_name("_resume_child.py"))


def _run(framework: str, phase: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, CHILD, framework, phase, url],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_resume_as_the_readme_shows_it(tmp_path, framework: str) -> None:
    url = str(tmp_path / "run")
    first = _run(framework, "first", url)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    committed = traintape.open_run(url).steps.tolist()  # the open row 21 may be lost
    assert committed[:21] == list(range(21))
    second = _run(framework, "resume", url)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    warned = [ln for ln in second.stdout.splitlines() if ln.startswith("WARNING:")]
    assert not [w for w in warned if "traintape" in w or "RuntimeWarning" in w], warned
    assert "steps: " + str(list(range(22))) in second.stdout
    run = traintape.open_run(url)
    assert run.manifest.status == "closed"
    assert run.steps.tolist() == list(range(22))
    grad = run.stats_array("grad")
    assert np.isfinite(grad[15:]).all()  # the resumed steps carry tensor stats, not just metrics
    assert traintape.validate(url).ok


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_kinds_named_are_recorded_under_the_default_policy(tmp_path, framework: str) -> None:
    url = str(tmp_path / "run")
    res = _run(framework, "kinds", url)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    run = traintape.open_run(url)
    assert not traintape.CapturePolicy().records_kind("opt_state")
    assert "opt_state" in run.kinds()
    names = run.tensor_names("opt_state")
    assert any(n.endswith("/mu") for n in names) and any(n.endswith("/nu") for n in names)
    assert np.isfinite(run.stats_array("opt_state")).all()
