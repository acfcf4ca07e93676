"""Lazy (dask) reads of a run's stat vectors: equal to the eager ones, and nothing is read
until computed, then only the blocks a computation needs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import traintape as tt

pytest.importorskip("dask.dataframe")

ROWS, TENSORS = 300, 12


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tt.Run:
    url = tmp_path_factory.mktemp("lazy") / "r"
    rng = np.random.default_rng(0)
    with tt.Recorder(url, flush_every_steps=32, system_metrics=False) as rec:
        for t in range(ROWS):
            if t % 7 == 3:
                rec.log(t, loss=1.0)  # a row without grads: dropped from the long table
                continue
            rec.record(
                t, "grad", {f"l{i:02d}/kernel": rng.normal(size=(4, 3)) for i in range(TENSORS)}
            )
    return tt.open_run(url)


def _count_reads(run: tt.Run, monkeypatch: pytest.MonkeyPatch) -> list[slice]:
    seen: list[slice] = []
    real = type(run).stats_array

    def spy(self, kind, tensors=None, rows=None):  # type: ignore[no-untyped-def]
        seen.append(rows)
        return real(self, kind, tensors, rows=rows)

    monkeypatch.setattr(type(run), "stats_array", spy)
    return seen


def test_lazy_stats_equal_eager_and_read_on_compute(run: tt.Run, monkeypatch) -> None:
    eager = run.stats("grad")
    reads = _count_reads(run, monkeypatch)
    lazy = run.stats("grad", lazy=True, block_rows=50)
    assert lazy.npartitions == 5  # 300 rows in blocks of 64 (whole chunks of 32)
    assert all(r.stop - r.start == 0 for r in reads)  # building it read no data
    got = lazy.compute().reset_index(drop=True)
    got["tensor"] = got["tensor"].astype(eager["tensor"].dtype)  # dask: arrow strings
    pd.testing.assert_frame_equal(got, eager)
    # a computation on one partition reads one block
    reads.clear()
    part = lazy.partitions[2].compute()
    assert [(r.start, r.stop) for r in reads if r.stop > r.start] == [(128, 192)]
    assert set(part["step"]) <= set(range(128, 192))


def test_lazy_dataset_equals_eager(run: tt.Run) -> None:
    eager, lazy = run.dataset(), run.dataset(lazy=True, block_rows=100)
    assert lazy["stats_grad"].chunks[0] == (128, 128, 44)
    np.testing.assert_array_equal(lazy["stats_grad"].values, eager["stats_grad"].values)
    l2 = lazy["stats_grad"].sel(stat="l2").max("tensor_grad").compute()
    np.testing.assert_array_equal(
        l2.values, eager["stats_grad"].sel(stat="l2").max("tensor_grad").values
    )


def test_lazy_errors_name_the_problem(run: tt.Run) -> None:
    with pytest.raises(KeyError, match="param"):
        run.stats("param", lazy=True)
    with pytest.raises(ValueError, match="block_rows"):
        run.stats("grad", lazy=True, block_rows=0)


def test_lazy_stats_compute_on_a_dask_distributed_cluster(run: tt.Run) -> None:
    """The lazy graph runs on dask.distributed worker processes (the tasks carry the run,
    which pickles to its location and is reopened there), equal to the eager read."""
    distributed = pytest.importorskip("dask.distributed")
    eager = run.stats("grad")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        lazy = run.stats("grad", lazy=True, block_rows=64)
        assert lazy.npartitions > 1
        got = client.compute(lazy).result()
        workers = client.run(lambda: __import__("os").getpid())
    assert len(set(workers.values())) == 2  # two worker processes did the reads
    pd.testing.assert_frame_equal(
        got.reset_index(drop=True), eager.reset_index(drop=True), check_dtype=False
    )
