"""Issue 25 item 4: crafted or bit-rotted metadata never aborts the tools.

``zarr.json`` carries no checksum. A manifest whose ``commit.rows`` (and steps array
shape) is 10^12 made ``validate``, ``show``, ``compare``, ``report`` and ``ls`` of the
parent directory abort with ``std::bad_alloc`` (SIGABRT, no message); a tensor declared
``[10^6, 10^6]`` with 1x1 chunks made ``open_run(...).snapshot`` abort and ``validate``
run without bound. Every command runs in a subprocess here (an abort would take pytest
down), with a timeout of minutes that only an unbounded scan reaches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import traintape as tt

CLI = [sys.executable, "-c", "from traintape.cli import main; main()"]
BIG = 10**12


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    pol = tt.CapturePolicy(full_every=2)
    for name in ("bad", "good", "huge"):
        with tt.Recorder(tmp_path / name, pol, flush_every_steps=4, system_metrics=False) as rec:
            for t in range(5):
                rec.record(t, "param", {"w": np.full((3, 3), float(t), np.float32)})
                rec.log(t, loss=1.0)

    def rows(doc: dict) -> None:
        doc["attributes"]["traintape"]["commit"].update(rows=BIG, last_step=BIG - 1)

    _edit(tmp_path / "bad" / "zarr.json", rows)
    _edit(tmp_path / "bad" / "steps" / "zarr.json", lambda d: d.update(shape=[BIG]))

    def spec(doc: dict) -> None:
        for t in doc["attributes"]["traintape"]["tensors"]:
            t.update(shape=[10**6, 10**6], snapshot_shape=[10**6, 10**6])

    def array(doc: dict) -> None:
        doc["shape"] = [doc["shape"][0], 10**6, 10**6]
        doc["chunk_grid"]["configuration"]["chunk_shape"] = [1, 1, 1]
        doc["codecs"][0]["configuration"]["chunk_shape"] = [1, 1, 1]

    _edit(tmp_path / "huge" / "zarr.json", spec)
    _edit(tmp_path / "huge" / "snapshots" / "param" / "w" / "zarr.json", array)
    return tmp_path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_implausible_commit_rows_are_an_error_not_an_abort(runs: Path) -> None:
    bad = str(runs / "bad")
    for args in (["validate", bad], ["show", bad], ["compare", bad, str(runs / "good")],
                 ["report", bad, "-f", "md"]):  # fmt: skip
        out = _cli(*args)
        assert out.returncode in (1, 2), (args, out.returncode, out.stderr[-500:])
        assert "commit.rows" in out.stdout + out.stderr and "steps" in out.stdout + out.stderr
    out = _cli("ls", str(runs))  # one bad store never hides the others
    assert out.returncode == 0, out.stderr[-500:]
    assert "good" in out.stdout and "bad" in out.stdout and "invalid" in out.stdout
    code = (
        "import sys, traintape as tt\n"
        "try:\n    tt.open_run(sys.argv[1])\n"
        "except tt.StoreError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, bad], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.stdout.startswith("refused:") and "commit.rows" in out.stdout, out.stderr[-500:]


def test_a_huge_declared_tensor_is_refused_and_validate_stays_bounded(runs: Path) -> None:
    huge = str(runs / "huge")
    code = (
        "import sys, traintape as tt\n"
        "try:\n    tt.open_run(sys.argv[1]).snapshot('w', 'param', 0)\n"
        "except tt.StoreError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, huge], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.stdout.startswith("refused:") and "snapshots/param/w" in out.stdout, (
        out.returncode, out.stderr[-500:])  # fmt: skip
    out = _cli("validate", huge)
    assert out.returncode == 1, (out.returncode, out.stderr[-500:])
    assert "snapshots/param/w" in out.stdout and "not scanned" in out.stdout
