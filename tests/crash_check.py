"""Shared by the crash test and benchmarks/crash_consistency.py: kill, then verify."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import traintape as tt
from traintape.core.stats import stat_vectors

CHILD = Path(__file__).with_name("_crash_child.py")
sys.path.insert(0, str(CHILD.parent))
from _crash_child import tensors  # noqa: E402

SCENARIOS = ("train", "close", "create", "race")
EXTRA_SCENARIOS = ("sustained", "slow", "pidns")
"""Run by benchmarks/crash_harness.py: ``sustained`` — a full capture every step and a
writer busy all the time; ``slow`` — the same with storage slower than capture (every
snapshot write delayed 20 ms); ``pidns`` — each child is PID 1 of a new PID namespace
(``unshare --pid``), as a restarted container is, and must take over its dead
predecessor's claim."""
"""``train``: killed while recording (fresh or resumed: trials chain on one store);
``close``: killed during ``close()``; ``create``: killed at a random moment from its start
(often while the store is being created or reopened); ``race``: two writers start on the
store at once — at most one may write, the other is refused — then the writer is killed."""


def _spawn(run_dir: str, flush: int, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, str(CHILD), run_dir, str(flush), mode]
    if mode == "pidns":  # PID 1 of a new PID namespace; killing unshare kills it
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)


def loss_bound(scenario: str, flush: int) -> int:
    """Rows a kill may lose (the open step included): ``flush_every_steps +
    2 * max_pending + 2`` (docs/store-format.md)."""
    from _crash_child import SUSTAINED_PENDING

    pending = SUSTAINED_PENDING if scenario in ("sustained", "slow") else 1024
    return flush + 2 * pending + 2


LAST: dict[str, int] = {}
"""What the last :func:`kill_once` saw: ``recorded`` (steps recorded when it was killed,
from the child's "step <n>" lines; absent if unknown) and ``flush``."""


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    p.wait()


def kill_once(run_dir: str, rng: random.Random, scenario: str = "train") -> None:
    """Run one trial of ``scenario`` (see :data:`SCENARIOS`) on ``run_dir``."""
    flush = rng.choice([1, 2, 3, 8])
    LAST.clear()
    LAST["flush"] = flush
    if scenario == "create":
        p = _spawn(run_dir, flush, "train")
        time.sleep(rng.uniform(0.0, 2.5))  # imports take ~1-2 s: kills land all along
        _kill(p)
        return
    if scenario == "race":
        ps = [_spawn(run_dir, flush, "train") for _ in range(2)]
        lines = []
        for p in ps:
            assert p.stdout is not None
            lines.append(p.stdout.readline())
        ready = [p for p, line in zip(ps, lines, strict=True) if line.startswith("ready")]
        refused = [line for line in lines if line.startswith("refused")]
        assert len(ready) == 1 and len(refused) == 1, f"race: {lines!r}"
        time.sleep(rng.uniform(0.0, 0.4))
        for p in ps:
            _kill(p)
        return
    mode = scenario if scenario in ("close", *EXTRA_SCENARIOS) else "train"
    p = _spawn(run_dir, flush, mode)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("ready"), f"child failed to start: {line!r}"
    if mode == "close":
        line = p.stdout.readline()
        assert line.startswith("closing"), f"child failed before close: {line!r}"
        time.sleep(rng.uniform(0.0, 0.05))
    else:
        # kill at a random moment once this child has committed something of its own: a
        # loaded machine can take longer than any fixed delay to reach the first commit
        # (then no trial would test a store with data); kills before the first commit
        # are the ``create`` scenario's
        drain = _Drain(p)  # read its "step <n>" lines as they come (a full pipe blocks it)
        _wait_for_commit(run_dir, int(line.split()[1]), p)
        time.sleep(rng.uniform(0.0, 0.3))
        _kill(p)
        drain.join()
        if drain.last is not None:  # the step after the last reported one may be open
            LAST["recorded"] = drain.last + 2
        return
    _kill(p)


class _Drain(threading.Thread):
    """Reads a child's stdout to the end, keeping the last "step <n>" it reported."""

    def __init__(self, p: subprocess.Popen[str]) -> None:
        super().__init__(daemon=True)
        self.p = p
        self.last: int | None = None
        self.start()

    def run(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("step "):
                self.last = int(line.split()[1])


def _wait_for_commit(run_dir: str, first_step: int, p: subprocess.Popen[str]) -> None:
    """Poll the commit mark until it covers ``first_step``, the child's first own row.

    No load-dependent deadline: the writer commits at least every ``flush_every_seconds``
    whatever its queue holds (issue 25), so a child that runs commits, however slow the
    machine. A child that ends, or one silent for 10 minutes, fails the trial."""
    deadline = time.monotonic() + 600.0
    while True:
        try:
            last = tt.open_run(run_dir).manifest.commit.last_step
        except Exception:  # mid-write manifest or arrays being created: look again
            last = None
        if last is not None and last >= first_step:
            return
        assert p.poll() is None, f"the child ended before its first commit (rc {p.returncode})"
        assert time.monotonic() < deadline, "the child committed nothing in 600 s"
        time.sleep(0.02)


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
    policy = run.manifest.policy  # the child's (every 5th step, or every step)
    assert snap_steps == [s for s in steps.tolist() if policy.snapshots(s, "param")]
    for s in snap_steps:
        for n in names:
            np.testing.assert_array_equal(run.snapshot(n, "param", s), tensors(s)[n])
    return len(steps)
