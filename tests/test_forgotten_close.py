"""Issue 25 item 9: a program that records and exits without ``close()`` loses nothing.

Before, the writer thread died with the interpreter: 0 rows committed, status ``open``,
the claim left in place, no warning. Now the Recorder is closed at interpreter exit
(bounded in time) with a warning naming it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import traintape as tt
from traintape.core.claim import CLAIM_KEY

CHILD = textwrap.dedent(
    """
    import sys, numpy as np, traintape as tt
    rec = tt.Recorder(sys.argv[1], tt.CapturePolicy(full_every=3), flush_every_steps=64,
                      flush_every_seconds=3600)
    for t in range(10):
        rec.record(t, "param", {"w": np.full((4, 4), float(t), np.float32)})
        rec.log(t, loss=float(t))
    if sys.argv[2] == "lost":
        del rec  # a notebook's lost reference: the writer thread keeps it alive
    # exits without close()
    """
)


def _run(url: str, how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, url, how], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_a_recorder_never_closed_is_closed_at_exit(tmp_path: Path) -> None:
    for how in ("kept", "lost"):
        url = str(tmp_path / how)
        out = _run(url, how)
        assert out.returncode == 0, out.stderr[-1000:]
        assert "never closed" in out.stderr and url in out.stderr
        run = tt.open_run(url)
        assert run.steps.tolist() == list(range(10))  # the open step too
        assert run.manifest.status == "closed"
        assert run.snapshot_steps("w", "param").tolist() == [0, 3, 6, 9]
        assert not (Path(url) / CLAIM_KEY).exists()
        assert tt.validate(url).ok
