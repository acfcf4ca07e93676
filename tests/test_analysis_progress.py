"""Progress callbacks of the analyses: real totals, monotonic, finished at the end."""

from __future__ import annotations

import numpy as np
import pytest
from _stores import stores  # noqa: F401

import traintape
from traintape.analysis import (
    anomalies,
    compare,
    export,
    health,
    parameter_change,
    render_report,
    sparse_update_from_run,
)
from traintape.analysis._common import StatsCache, Tracker


class Recorded:
    """A progress callback that keeps every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.calls.append((stage, done, total))

    def check(self) -> tuple[int, set[str]]:
        """Assert the progress was sane; returns (final total, stages seen)."""
        assert self.calls, "no progress reported"
        done = [d for _, d, _ in self.calls]
        assert done == sorted(done), "done went backwards"
        assert all(0 <= d <= t for _, d, t in self.calls)
        _, last_done, last_total = self.calls[-1]
        assert last_done == last_total > 0
        return last_total, {s for s, _, _ in self.calls if s}


def _forward(p, x):
    h = x
    for i in range(3):
        h = h @ p[f"layers/{i}/kernel"] + p[f"layers/{i}/bias"]
        h = np.tanh(h) if i < 2 else h
    return h


def test_health_and_anomalies_count_row_blocks(stores):  # noqa: F811
    run = traintape.open_run(stores["healthy"])  # 40 rows; param, activation, grad, update
    cb = Recorded()
    rep = health(run, progress=cb)
    total, stages = cb.check()
    assert total == 4 + 1  # one row block per kind read, plus the analysis
    assert "reading grad stats" in stages and "analysing layers" in stages
    assert rep == health(run)  # progress changes nothing
    cb = Recorded()
    # small blocks: many units, the same answer
    chunk = run.manifest.layout.row_chunk
    cache = StatsCache(run, Tracker(cb), block_rows=1)
    assert cache.block == chunk  # whole row chunks
    assert anomalies(run, cache=cache) == anomalies(run)
    assert cb.check()[0] == 4 * -(-40 // chunk) + 1


def test_compare_export_change_report_progress(stores, tmp_path):  # noqa: F811
    url = stores["healthy"]
    run = traintape.open_run(url)
    cb = Recorded()
    rep = compare(url, url, block_rows=16, progress=cb)
    assert rep.identical
    total, stages = cb.check()
    # 40 common rows in blocks of 16 = 3 per kind, 4 kinds; one unit per tensor of a kind
    # with snapshots; one for the metrics
    snap = sum(len(run.tensor_names(k)) for k in run.manifest.commit.snapshots)
    assert total == 3 * 4 + snap + 1
    assert {"grad stats", "param snapshots", "metrics"} <= stages

    cb = Recorded()
    export(run, tmp_path / "x.npz", "npz", snapshots=True, progress=cb)
    assert cb.check()[0] == len(run.kinds()) + 1 + snap + 1
    cb = Recorded()
    export(run, tmp_path / "pq", "parquet", progress=cb)
    assert cb.check()[0] == len(run.kinds()) + 1

    cb = Recorded()
    pc = parameter_change(run, progress=cb)
    assert cb.check()[0] == len(pc.pairs) * len(run.tensor_names("param"))

    cb = Recorded()
    html = render_report(run, progress=cb)
    total, stages = cb.check()
    assert "<h2>Health</h2>" in html
    # stats blocks (4 kinds) + 5 figures + health + anomalies + the change pairs' tensors
    assert total == 4 + 5 + 1 + 1 + len(pc.pairs) * 6
    assert "figures" in stages


def test_sparse_update_progress(stores):  # noqa: F811
    run = traintape.open_run(stores["healthy"])
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    cb = Recorded()
    q = sparse_update_from_run(run, _forward, x, thresholds=(1e-4, 1e-3), progress=cb)
    # 6 tensors at two steps, then full + none + 2 x (magnitude, random) forward passes
    assert cb.check()[0] == 12 + 2 + 4
    assert q.step_old == 0 and q.step_new == 30


@pytest.mark.parametrize("total", [0, 3])
def test_tracker_children_add_up(total):
    cb = Recorded()
    tr = Tracker(cb, total=total)
    child = tr.child()
    child("inner", 1, 4)
    tr.advance()
    child("inner", 4, 4)
    tr.finish()
    assert cb.calls[-1][1] == cb.calls[-1][2] == max(total, 1) + 4
