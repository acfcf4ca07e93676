"""The fused single-pass C stat kernel against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from traintape.core import native
from traintape.core.stats import raw_rows, stat_vectors
from traintape.schema.stats import N_STATS, STAT_INDEX, finalize, index_map, merge
from traintape.schema.stats import reference_stats as stat_vectors_numpy

pytestmark = pytest.mark.skipif(not native.fused_available(), reason="no C compiler for the kernel")
COUNTS = [STAT_INDEX[n] for n in ("zero_frac", "nan_count", "inf_count")]

BLOCK = 32768  # must match _fused_stats.c


def arrays(dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    bad = (rng.standard_normal(3 * BLOCK + 11) * 2 - 1).astype(dtype)
    bad[[5, BLOCK + 3]] = np.nan
    bad[[7, 2 * BLOCK + 1]] = [np.inf, -np.inf]
    bad[[9, 10]] = 0
    tail_bad = rng.standard_normal(13).astype(dtype)
    tail_bad[12], tail_bad[11] = np.nan, np.inf  # non-finite in the scalar tail
    return [
        rng.standard_normal((301, 407)).astype(dtype) * 3 + 1,  # several blocks
        rng.standard_normal(1).astype(dtype),
        rng.standard_normal(7).astype(dtype) + 5,
        np.zeros(5, dtype),
        np.zeros(0, dtype),
        (1000 + 1e-3 * rng.standard_normal(BLOCK * 2 + 5)).astype(dtype),  # near-constant
        np.full(BLOCK + 1, 3.25, dtype),  # constant: std exactly 0
        bad,
        tail_bad,
        np.full(6, np.nan, dtype),
        np.array([np.inf, -np.inf, np.nan], dtype),
        rng.standard_normal((4, 5, 6)).astype(dtype)[:, ::2].copy(),
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_matches_numpy_reference(dtype):
    xs = arrays(dtype)
    got = stat_vectors(xs)
    want = stat_vectors_numpy(xs)
    assert got.shape == want.shape == (len(xs), N_STATS)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    # counts are exact
    np.testing.assert_array_equal(got[:, COUNTS], want[:, COUNTS])
    assert got[7, STAT_INDEX["nan_count"]] == 2 and got[7, STAT_INDEX["inf_count"]] == 2
    assert got[6, STAT_INDEX["std"]] == 0.0  # constant data: std exactly zero


def test_near_constant_std_is_accurate():
    rng = np.random.default_rng(1)
    x = 1e4 + 1e-2 * rng.standard_normal(500_000)
    got = stat_vectors([x])[0]
    np.testing.assert_allclose(got[STAT_INDEX["std"]], np.std(x), rtol=1e-7)
    np.testing.assert_allclose(got[STAT_INDEX["mean"]], np.mean(x), rtol=1e-14)


def test_large_and_many_arrays_any_thread_count_same_result():
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(n).astype(np.float32) for n in (3_000_001, 1, 50, BLOCK)]
    xs += [rng.standard_normal(100).astype(np.float32) for _ in range(200)]
    one = raw_rows(xs, nthreads=1)
    two = raw_rows(xs, nthreads=2)
    np.testing.assert_array_equal(one, two)  # fixed block order: deterministic
    # float32 data: agreement to the data's precision (means near 0 compared absolutely)
    np.testing.assert_allclose(finalize(one), stat_vectors_numpy(xs), rtol=1e-6, atol=1e-7)


def test_other_dtypes_and_strided_views_are_converted():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((64, 64))
    xs = [
        base.astype(np.float16),
        (base * 10).astype(np.int32),
        base > 0,
        base[:, ::3],  # strided float64
        base.astype(">f4"),  # non-native byte order
    ]
    got = stat_vectors(xs)
    want = stat_vectors_numpy(xs)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_merge_equals_stats_of_concatenation():
    rng = np.random.default_rng(4)
    a = rng.standard_normal(BLOCK + 9).astype(np.float32) + 2
    b = rng.standard_normal(100).astype(np.float32) * 5
    b[0] = np.nan
    c = np.full(4, np.inf, np.float32)
    n = a.size + b.size + c.size  # each part at its offset in the whole (sig)
    ra, rb, rc = (
        raw_rows([v], maps=[index_map((n,), start=(k,))])
        for v, k in ((a, 0), (b, a.size), (c, a.size + b.size))
    )
    got = finalize(merge(merge(ra, rb), rc))
    want = stat_vectors_numpy([np.concatenate([a, b, c])])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_stat_vectors_hook_uses_kernel_and_falls_back(monkeypatch, tmp_path):
    xs = arrays(np.float32)
    with_kernel = stat_vectors(xs)
    np.testing.assert_allclose(with_kernel, stat_vectors_numpy(xs), rtol=1e-6, atol=1e-12)
    # no compiler: silently the numpy path, same numbers
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TRAINTAPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRAINTAPE_NO_PREBUILT", "1")  # the run-time path: no install build
    native.reset_for_tests()
    try:
        assert not native.fused_available()
        np.testing.assert_allclose(stat_vectors(xs), stat_vectors_numpy(xs), rtol=0, atol=0)
        raw = raw_rows(xs)  # reference raw rows when the kernel is missing
        np.testing.assert_allclose(finalize(raw), stat_vectors_numpy(xs), rtol=1e-12)
    finally:
        monkeypatch.undo()
        native.reset_for_tests()
    assert native.fused_available()


def test_compiles_into_fresh_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINTAPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRAINTAPE_NO_PREBUILT", "1")  # the run-time build
    native.reset_for_tests()
    try:
        assert native.fused_available()
        built = list(tmp_path.glob("fused-*.so"))
        assert len(built) == 1 and not list(tmp_path.glob(".fused-*"))
    finally:
        monkeypatch.undo()
        native.reset_for_tests()
