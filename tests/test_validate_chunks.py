"""validate misses nothing: a chunk missing inside the committed range is a problem
naming the array and chunk (also when its rows were all NaN), and crafted metadata is
reported without enumerating its chunks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

import traintape as tt
from traintape.cli import app


def _store(run_dir: str) -> None:
    pol = tt.CapturePolicy(full_every=2)
    with tt.Recorder(run_dir, pol, flush_every_steps=4) as rec:
        for t in range(10):
            rec.record(t, "param", {"a/kernel": np.full((3, 3), t, np.float32)})
            rec.log(t, loss=1.0 if t == 0 else float("nan"))  # chunks 1, 2 all NaN


def test_intact_store_is_valid(run_dir: str) -> None:
    _store(run_dir)
    assert tt.validate(run_dir).ok


def test_missing_chunks_are_problems(run_dir: str) -> None:
    _store(run_dir)
    for key in ("stats/param/c/1/0/0", "metrics/loss/c/2", "snapshots/param/a/kernel/c/3/0/0"):
        os.remove(Path(run_dir, key))
    rep = tt.validate(run_dir)
    assert not rep.ok
    text = "\n".join(rep.problems)
    assert "array stats/param: chunk at [4, 0, 0] is missing" in text
    assert "array metrics/loss: chunk at [8] is missing" in text  # an all-NaN chunk, too
    assert "array snapshots/param/a/kernel: chunk at [3, 0, 0] is missing" in text
    r = CliRunner().invoke(app, ["validate", run_dir])
    assert r.exit_code == 1 and "metrics/loss" in r.output


def test_crafted_shape_is_reported_without_enumerating(run_dir: str) -> None:
    _store(run_dir)
    meta = Path(run_dir, "stats/param/zarr.json")
    doc = json.loads(meta.read_text())
    doc["shape"] = [7, 100_000_000, 100_000_000]
    meta.write_text(json.dumps(doc))
    rep = tt.validate(run_dir)  # returns at once: no 1e16-chunk grid is walked
    assert any("array stats/param: shape [7, 100000000, 100000000]" in p for p in rep.problems)


def test_close_leaves_no_empty_chunk_directories(run_dir: str) -> None:
    _store(run_dir)
    empty = [d for d, dirs, files in os.walk(run_dir) if not dirs and not files]
    assert empty == []
    assert tt.validate(run_dir).ok
