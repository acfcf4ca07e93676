from __future__ import annotations

import numpy as np
import pytest

from traintape.core.stats import stat_vector, stat_vectors
from traintape.schema import STAT_INDEX


def _sign(c: int) -> int:
    """The sig pattern at canonical index c, in plain Python integers (an independent
    spelling of traintape.schema.stats.pattern_sign)."""
    m = 0xFFFFFFFF
    h = c & m
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return -1 if h >> 31 else 1


def reference(x):
    x = np.asarray(x, dtype=np.float64).ravel()
    fin = np.isfinite(x)
    f = x[fin]
    nan = np.isnan(x).sum()
    inf = np.isinf(x).sum()
    if f.size:
        v = [f.mean(), f.std(), f.min(), f.max(), np.linalg.norm(f), np.abs(f).mean()]
        l2 = np.linalg.norm(f)
        signed = sum(_sign(int(i)) * float(x[i]) for i in np.flatnonzero(fin))
        sig = signed / l2 if l2 > 0 else 0.0
    else:
        v = [np.nan] * 4 + [0.0, np.nan]
        sig = np.nan
    return np.array([*v, (x == 0).mean() if x.size else np.nan, nan, inf, sig])


@pytest.mark.parametrize("seed", range(5))
def test_batched_stats_equal_reference(seed):
    rng = np.random.default_rng(seed)
    arrays = [
        rng.normal(size=rng.integers(1, 50, size=rng.integers(0, 3))).astype(np.float32)
        for _ in range(40)
    ]
    arrays.append(rng.normal(size=(300, 300)).astype(np.float32))  # large path
    arrays[3] = np.array([1.0, np.nan, 0.0, np.inf, -np.inf, 3.0], dtype=np.float32)
    arrays[5] = np.array([np.nan, np.nan], dtype=np.float32)
    arrays[7] = np.zeros(0, dtype=np.float32)
    got = stat_vectors(arrays)
    want = np.stack([reference(a) for a in arrays])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_nan_inf_counted_not_poisoning():
    v = stat_vector(np.array([1.0, 2.0, np.nan, np.inf, 3.0]))
    assert v[STAT_INDEX["nan_count"]] == 1 and v[STAT_INDEX["inf_count"]] == 1
    assert v[STAT_INDEX["mean"]] == 2.0 and v[STAT_INDEX["max"]] == 3.0
    assert v[STAT_INDEX["zero_frac"]] == 0.0


def test_integer_and_bool_inputs():
    v = stat_vector(np.array([0, 1, 2, 3], dtype=np.int32))
    assert v[STAT_INDEX["mean"]] == 1.5 and v[STAT_INDEX["zero_frac"]] == 0.25
