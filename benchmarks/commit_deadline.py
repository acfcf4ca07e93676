"""Commits under sustained capture (issue 25 item 1): a full capture every step of small
tensors, ``flush_every_steps=2``, ``flush_every_seconds=0.1``, a training loop that keeps
the writer's queue busy. Samples, while it runs, the rows recorded and the rows the
store has committed (read from the store, as a reader or a restarted job sees it).

    python benchmarks/commit_deadline.py [--seconds 15] [--step-ms 0] [--s3]

``--s3``: the same on a local moto_server (tests/_procs.py; started and stopped by PID),
``--step-ms 10`` a training step of 10 ms. Before the fix the writer never committed
while its queue was non-empty (0 rows committed after 15 s and 8,000 recorded steps).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import traintape as tt


def run(url: str, seconds: float, step_ms: float) -> None:
    pol = tt.CapturePolicy(full_every=1, kinds=("param",), snapshot_kinds=("param",))
    tensors = {f"l{i}/w": np.full((16, 16), float(i), np.float32) for i in range(4)}
    rec = tt.Recorder(url, pol, flush_every_steps=2, flush_every_seconds=0.1,
                      system_metrics=False)  # fmt: skip
    t0 = time.monotonic()
    step, worst, marks = 0, 0, []
    next_mark = 1.0
    while time.monotonic() - t0 < seconds:
        if step_ms:
            time.sleep(step_ms / 1000)
        rec.record(step, "param", tensors)
        step += 1
        if time.monotonic() - t0 >= next_mark:
            committed = tt.open_run(url).rows
            worst = max(worst, step - committed)
            marks.append((round(time.monotonic() - t0, 1), step, committed))
            next_mark += 1.0
    committed = tt.open_run(url).rows
    commits = rec._writer.writer_stats().commits
    rec.close()
    print(f"{url}: {step} steps recorded in {seconds:.0f} s, {committed} committed before "
          f"close, {commits} commits, worst rows recorded-but-uncommitted at a sample: {worst}")  # fmt: skip
    for t, s, c in marks[:3] + marks[-2:]:
        print(f"  t={t:5.1f} s  recorded {s:6d}  committed {c:6d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--s3", action="store_true")
    a = ap.parse_args()
    if not a.s3:
        run(str(Path(tempfile.mkdtemp(prefix="tt-deadline-")) / "run"), a.seconds, a.step_ms)
        return
    from _procs import moto_server

    with moto_server("traintape-bench") as endpoint, contextlib.ExitStack():
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="x",
                          AWS_SECRET_ACCESS_KEY="y", AWS_REGION="us-east-1")  # fmt: skip
        run("s3://traintape-bench/run", a.seconds, a.step_ms)


if __name__ == "__main__":
    main()
