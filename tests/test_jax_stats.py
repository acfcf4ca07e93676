"""The on-device stat vector against the numpy reference (traintape.core.stats)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import traintape.jax as tj
from traintape.core.stats import stat_vectors

CASES = {
    "normal": np.random.default_rng(0).normal(size=(37, 5)).astype(np.float32),
    "offset": (1000.0 + 0.01 * np.random.default_rng(1).normal(size=4000)).astype(np.float32),
    "zeros": np.zeros((3, 3), np.float32),
    "mixed": np.array([1.0, np.nan, 0.0, np.inf, -2.0, 0.0, -np.inf], np.float32),
    "first_nan": np.array([np.nan, 3.0, 5.0], np.float32),
    "all_nan": np.full(4, np.nan, np.float32),
    "empty": np.zeros((0, 3), np.float32),
    "scalar": np.float32(-2.5),
    "bf16": np.array([0.5, -1.25, 3.0], dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("fused", [True, False], ids=["one-matrix", "per-array"])
def test_stat_vectors_match_numpy_reference(fused: bool) -> None:
    arrays = list(CASES.values())
    if fused:  # one NaN anywhere sends the whole matrix down the masked path
        got = np.asarray(jax.jit(tj.stat_matrix)([jnp.asarray(a) for a in arrays]))
    else:
        got = np.stack([np.asarray(jax.jit(tj.stat_vector)(jnp.asarray(a))) for a in arrays])
    want = stat_vectors([np.asarray(a) for a in arrays])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_fast_path_offset_std_is_accurate() -> None:
    x = CASES["offset"]
    got = np.asarray(jax.jit(tj.stat_vector)(jnp.asarray(x)))
    np.testing.assert_allclose(got[1], np.std(x.astype(np.float64)), rtol=1e-3)
