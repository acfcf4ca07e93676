"""The on-device stat vector against the numpy reference (traintape.core.stats)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import traintape.jax as tj
from traintape.core.stats import stat_vectors
from traintape.schema.stats import N_RAW, STAT_INDEX, finalize

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
        got = tj.stat_matrix([jnp.asarray(a) for a in arrays])
    else:
        got = np.stack([tj.stat_vector(jnp.asarray(a)) for a in arrays])
    want = stat_vectors([np.asarray(a) for a in arrays])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_fast_path_offset_std_is_accurate() -> None:
    x = CASES["offset"]
    got = tj.stat_vector(jnp.asarray(x))
    np.testing.assert_allclose(got[STAT_INDEX["std"]], np.std(x.astype(np.float64)), rtol=1e-3)


def test_ffi_kernel_matches_numpy_reference_inside_jit() -> None:
    """The fused C kernel as an XLA custom call: same vectors as the numpy reference,
    for NaN/Inf, empty, scalar, bfloat16 and a multi-block (> 32768 elements) leaf."""
    from traintape.adapters.jax import ffi_kernel

    if not ffi_kernel.available():
        pytest.skip("no C compiler / FFI header: the XLA path is used instead")
    big = np.random.default_rng(2).normal(3.0, 0.5, size=(300, 257)).astype(np.float32)
    big[7, 9] = np.nan
    arrays = [*CASES.values(), big, np.arange(10, dtype=np.int32), np.ones(5, np.float64)]
    rows = jax.jit(ffi_kernel.raw_rows)([jnp.asarray(a) for a in arrays])
    assert rows.dtype == jnp.uint32 and rows.shape == (len(arrays), 2 * N_RAW)
    got = finalize(ffi_kernel.decode(np.asarray(rows)))
    want = stat_vectors([np.asarray(a) for a in arrays])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)


def test_stats_mode_env(monkeypatch) -> None:
    from traintape.adapters.jax.stats import stats_mode

    monkeypatch.setenv("TRAINTAPE_JAX_STATS", "xla")
    assert stats_mode() == "xla"
    monkeypatch.setenv("TRAINTAPE_JAX_STATS", "gpu-please")
    with pytest.raises(ValueError, match="TRAINTAPE_JAX_STATS"):
        stats_mode()


def test_ffi_kernel_async_on_xla_pool_keeps_operands_until_done() -> None:
    """Large operand sets run asynchronously on XLA's thread pool (an FFI future): the
    rows must describe the operands as they were, even when the computation overwrites
    a donated operand in place right after, repeatedly and inside ``lax.scan``."""
    from traintape.adapters.jax import ffi_kernel

    if not ffi_kernel.available():
        pytest.skip("no C compiler / FFI header: the XLA path is used instead")
    rng = np.random.default_rng(3)
    p0 = rng.normal(size=(1024, 1024)).astype(np.float32)  # 32 blocks of 32768
    q = rng.normal(size=(700, 999)).astype(np.float32)
    q[123, 456] = np.inf

    @functools.partial(jax.jit, donate_argnums=0)
    def step(p, q):
        rows = ffi_kernel.raw_rows([p, q, p * 2.0])
        return p + 1.0, rows

    p = jnp.asarray(p0)
    qd = jnp.asarray(q)
    for i in range(6):
        p, rows = step(p, qd)
        ref = p0 + np.float32(i)
        want = stat_vectors([ref, q, ref * np.float32(2.0)])
        np.testing.assert_allclose(
            finalize(ffi_kernel.decode(np.asarray(rows))),
            want,
            rtol=1e-6,
            atol=1e-6,
            equal_nan=True,
        )

    def body(p, _):
        rows = ffi_kernel.raw_rows([p])
        return p * 0.5, rows

    _, rows = jax.jit(lambda p: jax.lax.scan(body, p, length=4))(jnp.asarray(p0))
    got = finalize(ffi_kernel.decode(np.asarray(rows).reshape(4, -1)))
    want = stat_vectors([p0 * np.float32(0.5**i) for i in range(4)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
