"""The documented loss bound holds: a process that dies (os._exit, no close) loses at
most flush_every_steps + 2 * max_pending sealed rows plus the open step."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import traintape as tt

CHILD = textwrap.dedent(
    """
    import os, sys, numpy as np, traintape as tt
    n, flush, pending = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rec = tt.Recorder(sys.argv[1], flush_every_steps=flush, flush_every_seconds=3600,
                      max_pending=pending)
    big = {f"layers/{i}/kernel": np.full((64, 64), 1.0, np.float32) for i in range(8)}
    for t in range(n):
        rec.record(t, "param", big)
        rec.log(t, loss=float(t))
    os._exit(0)  # dies: no flush, no close
    """
)


@pytest.mark.parametrize(("flush", "pending"), [(1, 2), (4, 3), (64, 8)])
def test_rows_lost_by_a_dead_process_are_bounded(tmp_path, flush: int, pending: int) -> None:
    url = str(tmp_path / "run")
    n = 200
    subprocess.run([sys.executable, "-c", CHILD, url, str(n), str(flush), str(pending)],
                   check=True, timeout=300)  # fmt: skip
    run = tt.open_run(url)
    committed = run.rows
    assert run.steps.tolist() == list(range(committed))  # a prefix, in order
    lost = n - committed
    assert lost <= flush + 2 * pending + 1, (lost, committed)
    assert tt.validate(url).ok
