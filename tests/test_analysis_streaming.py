"""The streaming stats cache (row blocks, per-layer reductions) against the reader's
whole stats array reduced by hand with numpy."""

from __future__ import annotations

import numpy as np
import pytest
from _stores import stores  # noqa: F401

import traintape
from traintape.analysis._common import (
    FirstPositive,
    LayerGroups,
    StatsCache,
    layer_of,
    rolling_median_mad,
    stat_index,
)


@pytest.mark.parametrize("how", ["norm", "sum", "mean", "max", "min"])
def test_layer_series_streamed_in_small_blocks_equals_whole_array(stores, how):  # noqa: F811
    run = traintape.open_run(stores["healthy"])
    full = run.stats_array("grad")  # [rows, tensor, stat]
    col = stat_index(run, "l2")
    names = run.tensor_names("grad")
    groups = LayerGroups(run, "grad")
    want = np.empty((run.rows, len(groups.layers)))
    for j, layer in enumerate(groups.layers):
        x = full[:, [i for i, n in enumerate(names) if layer_of(n) == layer], col]
        want[:, j] = {
            "norm": lambda v: np.sqrt(np.nansum(v * v, axis=1)),
            "sum": lambda v: np.nansum(v, axis=1),
            "mean": lambda v: np.nanmean(v, axis=1),
            "max": lambda v: np.nanmax(v, axis=1),
            "min": lambda v: np.nanmin(v, axis=1),
        }[how](x)
    # one row chunk per block (block_bytes tiny): many blocks, read ahead between them
    cache = StatsCache(run, block_rows=1, block_bytes=1)
    assert cache.rows_per_block("grad") == run.manifest.layout.row_chunk
    got = cache.series("grad", "l2", how)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_first_positive_finds_first_nan_row(stores):  # noqa: F811
    run = traintape.open_run(stores["nan"])
    full = run.stats_array("param")
    cnt = full[:, :, stat_index(run, "nan_count")]
    first, _at, count = StatsCache(run, block_rows=1, block_bytes=1).result(
        ("first", "param"), FirstPositive(traintape.Kind("param"), "nan_count")
    )
    for i in range(cnt.shape[1]):
        bad = np.flatnonzero(np.nan_to_num(cnt[:, i]) > 0)
        assert first[i] == (bad[0] if len(bad) else -1)
        assert count[i] == len(bad)


def test_rolling_median_mad_matches_naive_window():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(50)
    x[[3, 17]] = np.nan
    w = 7
    med, mad, cnt = rolling_median_mad(x, w)
    for t in range(w, 50):
        win = x[t - w : t]
        win = win[np.isfinite(win)]
        assert cnt[t] == len(win)
        assert med[t] == pytest.approx(np.median(win))
        assert mad[t] == pytest.approx(np.median(np.abs(win - np.median(win))))


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_export_in_row_blocks_equals_the_whole_table(stores, tmp_path, monkeypatch, fmt):  # noqa: F811
    import importlib

    import pandas as pd

    export_mod = importlib.import_module("traintape.analysis.export")

    run = traintape.open_run(stores["healthy"])
    monkeypatch.setattr(export_mod, "BLOCK_VALUES", 7)  # a block of one row or two
    export_mod.export(run, tmp_path / fmt, fmt)
    for kind in run.kinds():
        path = tmp_path / fmt / f"stats_{kind.value}.{fmt}"
        got = pd.read_parquet(path) if fmt == "parquet" else pd.read_csv(path)
        want = run.stats(kind)
        assert len(got) == len(want) > 0
        np.testing.assert_array_equal(got["step"].to_numpy(), want["step"].to_numpy())
        assert list(got["tensor"]) == list(want["tensor"])
        np.testing.assert_allclose(got["l2"].to_numpy(), want["l2"].to_numpy(), rtol=1e-12)
