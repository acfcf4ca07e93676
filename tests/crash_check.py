"""Shared by the crash test and benchmarks/crash_consistency.py: kill, then verify."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import traintape as tt
from traintape.core.stats import stat_vectors

CHILD = Path(__file__).with_name("_crash_child.py")
sys.path.insert(0, str(CHILD.parent))
from _crash_child import tensors  # noqa: E402


def kill_once(run_dir: str, rng: random.Random) -> None:
    """Start the child on ``run_dir`` and SIGKILL it at a random moment after it is ready."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    flush = rng.choice([1, 2, 3, 8])
    p = subprocess.Popen(
        [sys.executable, str(CHILD), run_dir, str(flush)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("ready"), f"child failed to start: {line!r}"
    time.sleep(rng.uniform(0.0, 0.6))
    p.send_signal(signal.SIGKILL)
    p.wait()


def verify(run_dir: str) -> int:
    """Assert the store validates and every committed value is bit-exact; return rows."""
    rep = tt.validate(run_dir)
    assert rep.ok, rep.problems
    run = tt.open_run(run_dir)
    steps = run.steps
    assert steps.tolist() == list(range(len(steps))), "committed steps must be 0..n-1"
    if len(steps) == 0:
        return 0
    names = run.tensor_names("param")
    pa = run.stats_array("param")
    ga = run.stats_array("grad")
    for i, s in enumerate(steps.tolist()):
        t = tensors(s)
        np.testing.assert_array_equal(pa[i], stat_vectors([t[n] for n in names]))
        np.testing.assert_array_equal(ga[i], stat_vectors([t[n] * np.float32(0.5) for n in names]))
    assert run.metrics()["loss"].tolist() == [float(s) for s in steps]
    snap_steps = run.snapshot_steps("head/embedding", "param").tolist()
    assert snap_steps == [s for s in steps.tolist() if s % 5 == 0]
    for s in snap_steps:
        for n in names:
            np.testing.assert_array_equal(run.snapshot(n, "param", s), tensors(s)[n])
    return len(steps)
