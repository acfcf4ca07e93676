"""Raw rows of the stat algebra computed inside the caller's compiled computation.

Two implementations, chosen per trace by :func:`stats_mode`; both give the mergeable raw
rows of :mod:`traintape.schema.stats`, which the recorder finalizes on the host:

- ``kernel`` (CPU backend, the default there): :mod:`.ffi_kernel` — traintape's fused
  single-pass C kernel as an XLA custom call; one read of each leaf.
- ``xla`` (GPU/TPU, or no C compiler): :func:`raw_matrix` — XLA reductions per leaf
  (sum, shifted sum of squares, sum |x|, min, max, nonzero count; see
  :func:`raw_matrix` for the NaN/Inf path), stacked into one ``[n, N_RAW]`` float32
  array whose count columns carry int32 bit patterns.

Either way, one small matrix per step crosses to the host (:func:`device_stats` returns
it with its host-side decoder). Costs are measured in ``benchmarks/jax_overhead.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from traintape.schema.stats import (
    COUNT_FIELDS,
    N_RAW,
    RAW_FIELDS,
    RAW_INDEX,
    RAW_NAMES,
    IndexMap,
    finalize,
)

_BIG = 3.4e38  # |x| * _BIG >= 1 for every normal float32 x != 0: min(|x| * _BIG, 1) counts nonzeros


def _min(x: jax.Array) -> jax.Array:
    return jax.lax.reduce(x, jnp.float32(jnp.inf), jax.lax.min, (0,))


def _max(x: jax.Array) -> jax.Array:
    return jax.lax.reduce(x, jnp.float32(-jnp.inf), jax.lax.max, (0,))


def sign_bits(shape: Sequence[int], imap: IndexMap | None) -> jax.Array:
    """Flat uint32 sign masks (bit 31) of the ``sig`` pattern of an array of ``shape``
    held as ``imap`` says (:func:`traintape.schema.stats.pattern_sign`, the same hash in
    uint32 arithmetic; XLA fuses it into the reduction that uses it)."""
    u = jnp.uint32
    n = int(np.prod(shape, dtype=np.int64))
    if imap is None:
        c = jax.lax.iota(u, n)
    else:
        c = jnp.full(tuple(shape), u(imap.offset % 2**32), u)
        for a, st in enumerate(imap.strides):
            c = c + jax.lax.broadcasted_iota(u, tuple(shape), a) * u(st % 2**32)
        c = c.reshape(-1)
    h = c ^ (c >> u(16))
    h = h * u(0x85EBCA6B)
    h = h ^ (h >> u(13))
    h = h * u(0xC2B2AE35)
    return h & u(0x80000000)


def _signed(x: jax.Array, bits: jax.Array) -> jax.Array:
    """``s * x`` for float32 ``x``: its sign bit flipped where ``bits`` has bit 31."""
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) ^ bits, x.dtype)


def _fast_sums(x: jax.Array, bits: jax.Array) -> list[jax.Array]:
    """[sum (x - x0), sum (x - x0)^2, sum |x|, min, max, nonzero count, sum s x] of finite
    flat ``x`` (``bits``: the sign masks of the ``sig`` pattern).

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
        lambda v: jnp.sum(_signed(v, bits)),
    ]
    out = []
    v = x
    for f in fns:
        r = f(v)
        out.append(r)
        v, _ = jax.lax.optimization_barrier((v, r))
    return out


def _pow2(k: jax.Array) -> jax.Array:
    """``2.0**k`` as float32, exact, for int32 ``-126 <= k <= 127`` (built from its bits:
    ``jnp.ldexp``/``exp2`` are not exact everywhere)."""
    return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _scale_down(x: jax.Array, big: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x * 2**-e, e)``, ``e`` the ``frexp`` exponent of ``big`` (the largest finite
    ``|x|``; 0 if it is 0), so the scaled values are below 1 in magnitude and their float32
    sums cannot overflow (:data:`traintape.schema.stats.SCALED`). Two exact power-of-two
    factors, each a normal float32."""
    _, e = jnp.frexp(big)
    e = jnp.where(big > 0, e, 0).astype(jnp.int32)
    half = e // 2
    return x * _pow2(-half) * _pow2(half - e), e


def _raw(x: jax.Array, fin: jax.Array | None, bits: jax.Array) -> dict[str, jax.Array]:
    """Raw fields of flat float32 ``x`` by name (float32 values, int32 counts); ``fin``
    masks finite elements (None: all are, and the sums do not overflow — the caller
    checks and comes back with ``fin``). With ``fin`` the sums are taken scaled
    (``exp``: see :func:`_scale_down`). ``bits``: :func:`sign_bits` of ``x``."""
    n = x.size
    if fin is None:
        s, s2, sabs, mn, mx, nonzero, sig = _fast_sums(x, bits)
        nf = jnp.int32(n)
        nnan = jnp.int32(0)
        zeros = (n - jnp.round(nonzero)).astype(jnp.int32)
        shift = x[0]
        e = jnp.int32(0)
    else:
        nf = jnp.sum(fin, dtype=jnp.int32)
        nnan = jnp.sum(jnp.isnan(x), dtype=jnp.int32)
        zeros = jnp.sum(x == 0, dtype=jnp.int32)
        mn = _min(jnp.where(fin, x, jnp.inf))
        mx = _max(jnp.where(fin, x, -jnp.inf))
        big = jnp.where(nf > 0, jnp.maximum(jnp.abs(mn), jnp.abs(mx)), 0.0)
        xs, e = _scale_down(jnp.where(fin, x, 0.0), big)
        shift = xs[0]
        d = jnp.where(fin, xs - shift, 0.0)
        s = jnp.sum(d)
        s2 = jnp.sum(d * d)
        sabs = jnp.sum(jnp.abs(xs))
        sig = jnp.sum(_signed(jnp.where(fin, xs, 0.0), bits))
    # s, s2: sums of d = x - c, c = the first (finite) element: no float32 cancellation
    # when |mean| >> std.  m2 = s2 - s (s/n) (<= s2: finite when s2 is);  sum x = s + n c;
    # sum x^2 = s2 + 2 c s + n c^2
    nff = nf.astype(jnp.float32)
    safe = jnp.maximum(nff, 1.0)
    return {
        "exp": e.astype(jnp.float32),
        "numel": jnp.int32(n),
        "nfinite": nf,
        "sum": s + nff * shift,
        "m2": jnp.maximum(s2 - s * (s / safe), 0.0),
        "min": mn,
        "max": mx,
        "sumsq": jnp.maximum(s2 + shift * (2.0 * s + nff * shift), 0.0),
        "abs_sum": sabs,
        "zeros": zeros,
        "nan": nnan,
        "sig": sig,
    }


def _row(fields: dict[str, jax.Array]) -> jax.Array:
    """Raw fields → one float32 row in RAW_NAMES order; counts travel as int32 bit
    patterns (exact for any tensor below 2**31 elements; see :func:`decode_raw`)."""
    missing = [n for n in RAW_NAMES if n not in fields]
    if missing:
        raise NotImplementedError(f"traintape.jax XLA stats: raw fields {missing} not computed")
    cols = []
    for name in RAW_NAMES:
        v = fields[name]
        if name in COUNT_FIELDS:
            v = jax.lax.bitcast_convert_type(jnp.asarray(v, jnp.int32), jnp.float32)
        cols.append(jnp.asarray(v, jnp.float32))
    return jnp.stack(cols)


def _flat32(x: jax.Array) -> jax.Array:
    x = jnp.ravel(jax.lax.stop_gradient(x))
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


def _empty_row() -> jax.Array:
    fields = {f.name: jnp.float32(f.empty) for f in RAW_FIELDS}  # exp: 0
    fields.update({n: jnp.int32(0) for n in COUNT_FIELDS})
    return _row(fields)


def raw_matrix(
    arrays: Sequence[jax.Array], maps: Sequence[IndexMap | None] | None = None
) -> jax.Array:
    """Raw rows of many arrays, ``[len(arrays), N_RAW]`` float32 (counts as int32 bits:
    decode with :func:`decode_raw`), one device array. ``maps``: each array's
    :class:`~traintape.schema.stats.IndexMap` for the ``sig`` field (None: identity).

    Fast path (every element of every array finite, detected from the results
    themselves): per array, sum and sum of squares shifted by the first element (avoids
    float32 cancellation when |mean| >> std), sum |x|, min, max and a nonzero count —
    about six memory passes, no ``isfinite`` mask. If any result is non-finite, one
    ``lax.cond`` for the whole matrix recomputes with explicit masks (counts NaN/Inf,
    moments over the finite elements).
    """
    if not arrays:
        return jnp.zeros((0, N_RAW), jnp.float32)
    maps = [None] * len(arrays) if maps is None else list(maps)
    flat = [_flat32(a) for a in arrays]
    bits = [sign_bits(jnp.shape(a), m) for a, m in zip(arrays, maps, strict=True)]

    def compute(masked: bool) -> jax.Array:
        rows = [
            _empty_row() if x.size == 0 else _row(_raw(x, jnp.isfinite(x) if masked else None, b))
            for x, b in zip(flat, bits, strict=True)
        ]
        return jnp.stack(rows)

    fast = compute(False)
    nonempty = [i for i, x in enumerate(flat) if x.size]
    moments = jnp.array(
        [RAW_INDEX[n] for n in ("sum", "m2", "min", "max", "sumsq", "abs_sum", "sig")]
    )
    ok = (
        jnp.all(jnp.isfinite(fast[jnp.array(nonempty, jnp.int32)][:, moments]))
        if nonempty
        else True
    )
    return jax.lax.cond(ok, lambda: fast, lambda: compute(True))


def decode_raw(m: np.ndarray) -> np.ndarray:
    """Host side of :func:`raw_matrix`: ``[n, N_RAW]`` float32 → raw rows float64."""
    m32 = np.ascontiguousarray(m, dtype=np.float32).reshape(-1, N_RAW)
    out = m32.astype(np.float64)
    for name in COUNT_FIELDS:
        i = RAW_INDEX[name]
        out[:, i] = m32[:, i].view(np.int32)
    return out


def stat_matrix(
    arrays: Sequence[jax.Array], maps: Sequence[IndexMap | None] | None = None
) -> np.ndarray:
    """Stat vectors ``[len(arrays), N_STATS]`` float64 of concrete arrays via the XLA
    path (raw rows by a jitted :func:`raw_matrix`, finalized on the host)."""
    maps = None if maps is None else tuple(maps)
    return finalize(decode_raw(np.asarray(_jit_raw_matrix(list(arrays), maps))))


_jit_raw_matrix = jax.jit(raw_matrix, static_argnums=1)


def stat_vector(x: jax.Array) -> np.ndarray:
    """Stat vector ``[N_STATS]`` of one concrete array (see :func:`stat_matrix`)."""
    return stat_matrix([x])[0]


STATS_MODES = ("auto", "xla", "kernel")


def stats_mode() -> str:
    """Where the raw rows of a computation being traced are computed: ``xla`` or
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


def stats_backend() -> str:
    """The ``Producer.stats_backend`` of this process's JAX captures: ``jax-ffi-c`` or
    ``xla`` (see :func:`stats_mode`)."""
    return "jax-ffi-c" if stats_mode() == "kernel" else "xla"


def device_stats(
    arrays: Sequence[jax.Array], maps: Sequence[IndexMap | None] | None = None
) -> tuple[Any, Callable[[Any], np.ndarray]]:
    """Stats of ``arrays`` inside the computation being traced, plus the host decoder.

    Returns ``(payload, decode)``: ``payload`` is the small device array to send to the
    host (the raw rows of :func:`raw_matrix`, or the FFI kernel's), and
    ``decode(payload)`` (the payload as the host callback receives it: numpy leaves of
    the same pytree) gives the raw rows ``[n, N_RAW]`` float64 of
    :mod:`traintape.schema.stats` (finalized by the recorder). ``maps``: each array's
    :class:`~traintape.schema.stats.IndexMap` (None: identity).

    With the FFI kernel in a computation over several devices, arrays that spread
    evenly over them are reduced one slab per device
    (:func:`traintape.adapters.jax.ffi_kernel.spread_raw_rows`): a custom call's
    operands would otherwise be gathered whole onto every device. XLA's reductions are
    partitioned by XLA itself.
    """
    if stats_mode() == "kernel":
        from . import ffi_kernel
        from .blocks import split_for

        splits = [split_for(a, holders=False) for a in arrays]
        if any(sp is not None for sp in splits):
            mp = [None] * len(arrays) if maps is None else list(maps)
            return ffi_kernel.spread_raw_rows(arrays, mp, splits)
        return ffi_kernel.raw_rows(arrays, maps), ffi_kernel.decode
    return raw_matrix(arrays, maps), decode_raw
