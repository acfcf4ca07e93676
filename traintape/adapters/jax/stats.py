"""The schema stat vector computed inside the caller's compiled computation.

Two implementations, chosen per trace by :func:`stats_mode`:

- ``kernel`` (CPU backend, the default there): :mod:`.ffi_kernel` — traintape's fused
  single-pass C kernel as an XLA custom call; one read of each leaf; the result is the
  raw-row matrix, finalised on the host.
- ``xla`` (GPU/TPU, or no C compiler): :func:`stat_matrix` — XLA reductions per leaf
  (sum, shifted sum of squares, sum |x|, min, max, nonzero count; see
  :func:`stat_matrix` for the NaN/Inf path), stacked into one ``[n, 9]`` float32 array.

Either way, one small matrix per step crosses to the host (:func:`device_stats` returns
it with its host-side decoder). Costs are measured in ``benchmarks/jax_overhead.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from traintape.schema import N_STATS

_BIG = 3.4e38  # |x| * _BIG >= 1 for every normal float32 x != 0: min(|x| * _BIG, 1) counts nonzeros


def _min(x: jax.Array) -> jax.Array:
    return jax.lax.reduce(x, jnp.float32(jnp.inf), jax.lax.min, (0,))


def _max(x: jax.Array) -> jax.Array:
    return jax.lax.reduce(x, jnp.float32(-jnp.inf), jax.lax.max, (0,))


def _fast_sums(x: jax.Array) -> list[jax.Array]:
    """[sum (x - x0), sum (x - x0)^2, sum |x|, min, max, nonzero count] of finite flat ``x``.

    ``lax.optimization_barrier`` between the reductions stops XLA from multi-output-fusing
    them (XLA:CPU emits a slow scalar loop for such a fusion; each single reduction gets a
    vectorised loop): measured 3x faster than letting them fuse.
    """
    shift = x[0]
    fns = [
        lambda v: jnp.sum(v - shift),
        lambda v: jnp.sum(jnp.square(v - shift)),
        lambda v: jnp.sum(jnp.abs(v)),
        _min,
        _max,
        lambda v: jnp.sum(jnp.minimum(jnp.abs(v) * jnp.float32(_BIG), 1.0)),
    ]
    out = []
    v = x
    for f in fns:
        r = f(v)
        out.append(r)
        v, _ = jax.lax.optimization_barrier((v, r))
    return out


def _vector(x: jax.Array, fin: jax.Array | None) -> jax.Array:
    """Stat vector of flat float32 ``x``; ``fin`` masks finite elements (None: all are)."""
    n = x.size
    if fin is None:
        s, s2, sabs, mn, mx, nonzero = _fast_sums(x)
        nf = jnp.float32(n)
        nnan = jnp.float32(0)
        shift = x[0]
    else:
        xf = jnp.where(fin, x, 0.0)
        shift = xf[0]
        nf = jnp.sum(fin, dtype=jnp.int32).astype(jnp.float32)
        nnan = jnp.sum(jnp.isnan(x), dtype=jnp.int32).astype(jnp.float32)
        nonzero = jnp.sum(jnp.where(x == 0, 0.0, 1.0))
        d = jnp.where(fin, x - shift, 0.0)
        s = jnp.sum(d)
        s2 = jnp.sum(d * d)
        sabs = jnp.sum(jnp.abs(xf))
        mn = _min(jnp.where(fin, x, jnp.inf))
        mx = _max(jnp.where(fin, x, -jnp.inf))
    # s, s2: sums of d = x - c, c = the first (finite) element: no float32 cancellation
    # when |mean| >> std
    safe = jnp.maximum(nf, 1.0)
    dm = s / safe
    mean = shift + dm
    var = jnp.maximum(s2 / safe - dm * dm, 0.0)
    # sum x^2 = sum (d + c)^2 = s2 + 2 c s + n c^2
    l2sq = jnp.maximum(s2 + shift * (2.0 * s + nf * shift), 0.0)
    none = nf == 0
    nan = jnp.float32(jnp.nan)
    return jnp.stack(
        [
            jnp.where(none, nan, mean),
            jnp.where(none, nan, jnp.sqrt(var)),
            jnp.where(none, nan, mn),
            jnp.where(none, nan, mx),
            jnp.sqrt(l2sq),
            jnp.where(none, nan, sabs / safe),
            (n - nonzero) / n,
            nnan,
            n - nf - nnan,
        ]
    )


def _flat32(x: jax.Array) -> jax.Array:
    x = jnp.ravel(jax.lax.stop_gradient(x))
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


_EMPTY = (jnp.nan, jnp.nan, jnp.nan, jnp.nan, 0.0, jnp.nan, jnp.nan, 0.0, 0.0)


def stat_matrix(arrays: Sequence[jax.Array]) -> jax.Array:
    """Stat vectors of many arrays, ``[len(arrays), 9]`` float32, one device array.

    Fast path (every element of every array finite, detected from the results
    themselves): per array, sum, sum of squares shifted by the first element (avoids
    float32 cancellation when |mean| >> std), sum |x|, min, max and a nonzero count —
    about six memory passes, no ``isfinite`` mask. If any result is non-finite, one
    ``lax.cond`` for the whole matrix recomputes with explicit masks (counts NaN/Inf,
    moments over the finite elements).
    """
    if not arrays:
        return jnp.zeros((0, N_STATS), jnp.float32)
    flat = [_flat32(a) for a in arrays]

    def compute(masked: bool) -> jax.Array:
        rows = [
            jnp.array(_EMPTY, jnp.float32)
            if x.size == 0
            else _vector(x, jnp.isfinite(x) if masked else None)
            for x in flat
        ]
        return jnp.stack(rows)

    fast = compute(False)
    nonempty = [i for i, x in enumerate(flat) if x.size]
    ok = jnp.all(jnp.isfinite(fast[jnp.array(nonempty, jnp.int32), :6])) if nonempty else True
    return jax.lax.cond(ok, lambda: fast, lambda: compute(True))


def stat_vector(x: jax.Array) -> jax.Array:
    """Stat vector ``[9]`` float32 of one array (see :func:`stat_matrix`)."""
    return stat_matrix([x])[0]


STATS_MODES = ("auto", "xla", "kernel")


def stats_mode() -> str:
    """Where the stat vectors of a computation being traced are computed: ``xla`` or
    ``kernel``.

    ``TRAINTAPE_JAX_STATS=auto|xla|kernel`` (default ``auto``). ``auto`` picks
    ``kernel`` when the default backend is the CPU and the FFI kernel builds
    (:func:`traintape.adapters.jax.ffi_kernel.available`), else ``xla``. ``kernel``
    without a usable kernel raises.
    """
    from . import ffi_kernel

    mode = os.environ.get("TRAINTAPE_JAX_STATS", "auto")
    if mode not in STATS_MODES:
        raise ValueError(f"TRAINTAPE_JAX_STATS must be one of {STATS_MODES}, not {mode!r}")
    if mode == "auto":
        cpu = jax.default_backend() == "cpu"
        return "kernel" if cpu and ffi_kernel.available() else "xla"
    if mode == "kernel" and not ffi_kernel.available():
        raise RuntimeError(
            "TRAINTAPE_JAX_STATS=kernel, but the JAX FFI stat kernel is unavailable "
            "(no C compiler, or jaxlib's FFI header is missing)"
        )
    return mode


def device_stats(
    arrays: Sequence[jax.Array],
) -> tuple[jax.Array, Callable[[np.ndarray], np.ndarray]]:
    """Stats of ``arrays`` inside the computation being traced, plus the host decoder.

    Returns ``(payload, decode)``: ``payload`` is the small device array to send to the
    host (``[n, 9]`` float32 or the kernel's raw rows), and ``decode(np.asarray(payload))``
    gives the stat vectors ``[n, 9]`` float64 in schema order.
    """
    if stats_mode() == "kernel":
        from . import ffi_kernel

        return ffi_kernel.raw_rows(arrays), ffi_kernel.decode
    return stat_matrix(arrays), _decode_matrix


def _decode_matrix(m: np.ndarray) -> np.ndarray:
    return np.asarray(m, dtype=np.float64).reshape(-1, N_STATS)
