"""Raw rows of the stat algebra computed by TensorFlow ops (eagerly or inside tf.function).

Every function here returns *raw rows* ``[n, N_RAW]`` float64 in the layout of
:mod:`traintape.schema.stats` (numel, finite count, sum, m2, min, max, sum of squares,
sum |x|, zero count, NaN count; moments over finite elements only); the recorder
finalizes them into stat vectors with :func:`traintape.schema.stats.finalize`.
Reductions run in float32 (float64 inputs stay float64). On a CPU-only TF the host
path (:func:`host_raw_matrices`, traintape's fused C kernel over zero-copy views) is
used instead of the op graph (:func:`raw_matrix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from traintape.schema.stats import N_RAW, RAW_NAMES, IndexMap, finalize

_SMALL = 4096  # tensors with a static size up to this are reduced together (segment ops)
_FAST_MIN = 1 << 16  # from this size on, try the cheap all-finite path first
_CANCEL = 100.0  # one-pass m2 only when mean**2 <= _CANCEL * var


def _flat(x: Any) -> tf.Tensor:
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    x = tf.convert_to_tensor(x)
    dt = tf.float64 if x.dtype == tf.float64 else tf.float32
    return tf.reshape(tf.cast(x, dt), [-1])


def _stack(axis: int, **cols: Any) -> tf.Tensor:
    """Raw-row columns given by name, cast to float64 and stacked in RAW_NAMES order (a
    raw field this module does not compute fails here, naming it)."""
    missing = [n for n in RAW_NAMES if n not in cols]
    if missing:
        raise NotImplementedError(f"traintape.tf stats: raw fields {missing} not computed")
    return tf.stack([tf.cast(cols[n], tf.float64) for n in RAW_NAMES], axis=axis)


_BITS = {tf.float32: (tf.int32, 23, 0xFF, 127), tf.float64: (tf.int64, 52, 0x7FF, 1023)}


def _exponent(big: tf.Tensor) -> tf.Tensor:
    """int32 ``e`` with ``big * 2**-e < 1`` (``frexp``'s exponent, read from the bits;
    0 for 0): the scale of :data:`traintape.schema.stats.SCALED`."""
    it, mant, mask, bias = _BITS[big.dtype]
    field = tf.cast(
        tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.bitcast(big, it), mant), mask), tf.int32
    )
    return tf.where(big > 0, field - (bias - 1), 0)


def _pow2(k: tf.Tensor, dt: tf.DType) -> tf.Tensor:
    """Exact ``2.0**k`` in ``dt`` for int32 ``k`` within the normal range (from the bits)."""
    it, mant, _, bias = _BITS[dt]
    return tf.bitcast(tf.bitwise.left_shift(tf.cast(k + bias, it), tf.cast(mant, it)), dt)


def _scaled(xz: tf.Tensor, e: tf.Tensor) -> tf.Tensor:
    """``xz * 2**-e`` (``e`` broadcast to ``xz``) as two exact normal factors: every
    finite value ends below 1 in magnitude, so no sum of them overflows."""
    h = e // 2
    return xz * _pow2(-h, xz.dtype) * _pow2(h - e, xz.dtype)


_M32 = 0xFFFFFFFF


def _mul32(h: tf.Tensor, m: int) -> tf.Tensor:
    """``h * m mod 2**32`` for int64 ``h`` in [0, 2**32) without int64 overflow (the
    product is split at bit 16: each partial product stays below 2**48)."""
    lo = tf.bitwise.bitwise_and(h, 0xFFFF)
    hi = tf.bitwise.right_shift(h, 16)
    hi_part = tf.bitwise.left_shift(tf.bitwise.bitwise_and(hi * m, 0xFFFF), 16)
    return tf.bitwise.bitwise_and(lo * m + hi_part, _M32)


def signs(x: Any, imap: IndexMap | None, dt: tf.DType, batch_free: bool = False) -> tf.Tensor:
    """The ``sig`` pattern (±1 in ``dt``, flattened row-major) of tensor ``x`` (its shape
    may be dynamic) held as ``imap`` says: :func:`traintape.schema.stats.pattern_sign`
    in int64 arithmetic. ``batch_free``: ``x`` is a canonical-layout activation (axis 0
    the free batch axis; ``imap`` is ignored): the pattern of the per-example index,
    ``c = flat index mod per-example size``, from the dynamic shape."""
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    shape = tf.shape(x, out_type=tf.int64)
    if batch_free and x.shape.rank:
        per = tf.reduce_prod(shape[1:])
        c = tf.math.floormod(tf.range(tf.reduce_prod(shape), dtype=tf.int64), tf.maximum(per, 1))
        c = tf.bitwise.bitwise_and(c, _M32)
    elif imap is None:
        c = tf.range(tf.reduce_prod(shape), dtype=tf.int64)
    else:
        c = tf.fill(shape, tf.constant(imap.offset % 2**32, tf.int64))
        rank = len(imap.strides)
        for a, st in enumerate(imap.strides):
            r = tf.range(shape[a], dtype=tf.int64) * (st % 2**32)
            c = c + tf.reshape(r, [-1 if k == a else 1 for k in range(rank)])
        c = tf.bitwise.bitwise_and(tf.reshape(c, [-1]), _M32)
    h = tf.bitwise.bitwise_xor(c, tf.bitwise.right_shift(c, 16))
    h = _mul32(h, 0x85EBCA6B)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 13))
    h = _mul32(h, 0xC2B2AE35)
    return 1.0 - 2.0 * tf.cast(tf.bitwise.right_shift(h, 31), dt)


def raw_row(x: Any, sg: tf.Tensor | None = None) -> tf.Tensor:
    """Raw row ``[N_RAW]`` of one tensor (any shape; IndexedSlices are densified):
    the exact masked two-pass computation (handles NaN/Inf), sums taken scaled by the
    largest finite ``|x|`` (``exp``; exact, never overflows). ``sg``: its :func:`signs`
    (None: those of the identity map)."""
    if sg is None:
        sg = signs(x, None, tf.float64 if _flat(x).dtype == tf.float64 else tf.float32)
    x = _flat(x)
    dt = x.dtype
    finite = tf.math.is_finite(x)
    nf = tf.reduce_sum(tf.cast(finite, dt))
    zero = tf.zeros_like(x)
    xz = tf.where(finite, x, zero)
    e = _exponent(tf.reduce_max(tf.concat([tf.abs(xz), tf.zeros([1], dt)], 0)))
    xz = _scaled(xz, e)
    s = tf.reduce_sum(xz)
    mean = tf.math.divide_no_nan(s, nf)
    dev = tf.where(finite, xz - mean, zero)
    inf = tf.fill(tf.shape(x), tf.constant(float("inf"), dt))
    return _stack(
        0,
        exp=e,
        numel=tf.size(x),
        nfinite=nf,
        sum=s,
        m2=tf.reduce_sum(dev * dev),
        min=tf.reduce_min(tf.concat([tf.where(finite, x, inf), [float("inf")]], 0)),
        max=tf.reduce_max(tf.concat([tf.where(finite, x, -inf), [-float("inf")]], 0)),
        sumsq=tf.reduce_sum(xz * xz),
        abs_sum=tf.reduce_sum(tf.abs(xz)),
        zeros=tf.reduce_sum(tf.cast(tf.equal(x, 0), dt)),
        nan=tf.reduce_sum(tf.cast(tf.math.is_nan(x), dt)),
        sig=tf.reduce_sum(xz * sg),
    )


def _fast_raw(x: tf.Tensor, sg: tf.Tensor) -> tf.Tensor:
    """All-finite fast path (6 cheap reductions); falls back to :func:`raw_row` through
    ``tf.cond`` when the tensor has NaN/Inf or the one-pass m2 could cancel
    (mean**2 > 100 * var)."""
    n = tf.cast(tf.size(x), tf.float64)
    # independent single-input reductions: TF fuses each elementwise op into its reduce
    s = tf.cast(tf.reduce_sum(x), tf.float64)
    ss = tf.cast(tf.reduce_sum(tf.square(x)), tf.float64)
    asum = tf.cast(tf.reduce_sum(tf.abs(x)), tf.float64)
    nonzero = tf.cast(tf.reduce_sum(tf.square(tf.sign(x))), tf.float64)
    sig = tf.cast(tf.reduce_sum(x * sg), tf.float64)
    mean = s / n
    var = ss / n - mean * mean
    ok = tf.math.is_finite(s + ss + asum + sig) & (mean * mean <= _CANCEL * var)

    def fast() -> tf.Tensor:
        return _stack(
            0, numel=n, nfinite=n, sum=s, m2=tf.maximum(var, 0.0) * n,
            min=tf.reduce_min(x), max=tf.reduce_max(x), sumsq=ss, abs_sum=asum,
            zeros=n - nonzero, nan=tf.constant(0.0, tf.float64), exp=tf.constant(0.0, tf.float64),
            sig=sig,
        )  # fmt: skip

    return tf.cond(ok, fast, lambda: raw_row(x, sg))


def _segment_raw(
    xs: Sequence[tf.Tensor], sizes: Sequence[int], sgs: Sequence[tf.Tensor]
) -> tf.Tensor:
    """Exact raw rows of many small flat tensors with a fixed number of ops (``sgs``:
    their :func:`signs`)."""
    dt = tf.float64 if any(x.dtype == tf.float64 for x in xs) else tf.float32
    x = tf.concat([tf.cast(t, dt) for t in xs], 0)
    sg = tf.concat([tf.cast(g, dt) for g in sgs], 0)
    ids = tf.constant(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))

    def seg(v: tf.Tensor) -> tf.Tensor:
        return tf.math.segment_sum(v, ids)

    finite = tf.math.is_finite(x)
    nf = seg(tf.cast(finite, dt))
    zero = tf.zeros_like(x)
    xz = tf.where(finite, x, zero)
    e = _exponent(tf.math.segment_max(tf.abs(xz), ids))  # sums taken scaled (SCALED)
    xz = _scaled(xz, tf.gather(e, ids))
    s = seg(xz)
    mean = tf.math.divide_no_nan(s, nf)
    dev = tf.where(finite, xz - tf.gather(mean, ids), zero)
    inf = tf.fill(tf.shape(x), tf.constant(float("inf"), dt))
    return _stack(
        1,
        exp=e,
        numel=tf.constant(np.asarray(sizes, np.float64)),
        nfinite=nf,
        sum=s,
        m2=seg(dev * dev),
        min=tf.math.segment_min(tf.where(finite, x, inf), ids),
        max=tf.math.segment_max(tf.where(finite, x, -inf), ids),
        sumsq=seg(xz * xz),
        abs_sum=seg(tf.abs(xz)),
        zeros=seg(tf.cast(tf.equal(x, 0), dt)),
        nan=seg(tf.cast(tf.math.is_nan(x), dt)),
        sig=seg(xz * sg),
    )


def raw_matrix(
    tensors: Sequence[Any],
    maps: Sequence[IndexMap | None] | None = None,
    *,
    batch_free: bool = False,
) -> tf.Tensor:
    """Raw rows of many tensors, ``[len(tensors), N_RAW]`` float64 (graph or eager).

    Tensors with a static size <= 4096 are reduced together with segment ops (a fixed
    number of ops however many there are); large ones take a cheap all-finite path
    (sum, sum of squares, sum of |x|, count of sign(x)**2, min, max) and fall back to the
    exact masked computation only when they hold NaN/Inf or their mean dwarfs their
    spread. ``maps``: each tensor's :class:`~traintape.schema.stats.IndexMap` for the
    ``sig`` field (None: identity); ``batch_free``: the tensors are canonical-layout
    activations instead (their batch axis free, shapes possibly dynamic; see
    :func:`signs`).
    """
    if not tensors:
        return tf.zeros([0, N_RAW], tf.float64)
    maps = [None] * len(tensors) if maps is None else list(maps)
    flats = [_flat(t) for t in tensors]
    sgs = [signs(t, m, f.dtype, batch_free) for t, m, f in zip(tensors, maps, flats, strict=True)]
    rows: list[Any] = [None] * len(flats)
    small = [i for i, f in enumerate(flats)
             if f.shape.num_elements() is not None and 0 < f.shape.num_elements() <= _SMALL]  # fmt: skip
    if len(small) > 1:
        m = _segment_raw(
            [flats[i] for i in small],
            [flats[i].shape.num_elements() for i in small],
            [sgs[i] for i in small],
        )
        for j, i in enumerate(small):
            rows[i] = m[j]
    for i, f in enumerate(flats):
        if rows[i] is None:
            n = f.shape.num_elements()
            rows[i] = (
                _fast_raw(f, sgs[i]) if n is not None and n >= _FAST_MIN else raw_row(f, sgs[i])
            )
    return tf.stack(rows)


def stat_matrix(
    tensors: Sequence[Any], maps: Sequence[IndexMap | None] | None = None
) -> np.ndarray:
    """Stat vectors ``[len(tensors), N_STATS]`` float64 of eager tensors (graph raw rows,
    finalized on the host)."""
    return finalize(raw_matrix(tensors, maps).numpy())


def stat_vector(x: Any) -> np.ndarray:
    """Stat vector ``[N_STATS]`` of one eager tensor."""
    return stat_matrix([x])[0]


def stats_backend() -> str:
    """The ``Producer.stats_backend`` of TF captures: the host kernel's
    (``c-openmp``/``c``, :func:`host_stats_enabled`) or ``tf`` (the op graph)."""
    if host_stats_enabled():
        from traintape.core.stats import backend

        return backend()
    return "tf"


def host_stats_enabled() -> bool:
    """Compute raw rows on the host with the fused C kernel (:mod:`traintape.core.stats`)
    instead of the TF op graph: only when the kernel compiled and TF sees no GPU (on
    CPU the tensors reach numpy without a device copy; one fused pass per tensor is
    several times cheaper than the graph of reductions below). Measured in
    ``benchmarks/tf_overhead.py``. ``TRAINTAPE_TF_GRAPH_STATS=1`` forces the graph path."""
    global _HOST
    if _HOST is None:
        import os

        from traintape.core import native

        _HOST = (
            not os.environ.get("TRAINTAPE_TF_GRAPH_STATS")
            and native.fused_available()
            and not tf.config.list_logical_devices("GPU")
        )
    return _HOST


_HOST: bool | None = None


def _host_array(t: Any) -> np.ndarray:
    """A host numpy view of ``t`` (no copy for a CPU eager tensor or a numpy array).

    ``EagerTensor.numpy()`` copies (a whole extra memory pass over every tensor);
    ``np.asarray`` wraps the tensor's buffer, which is immutable while referenced.
    """
    if isinstance(t, tf.IndexedSlices):
        t = tf.convert_to_tensor(t)
    return np.asarray(t)


def host_raw_matrices(
    groups: Sequence[Sequence[Any]], maps: Sequence[Sequence[IndexMap | None]] | None = None
) -> list[np.ndarray]:
    """Raw rows of several groups of tensors via the host fused kernel, in **one**
    kernel call (one OpenMP region over every tensor of the step): one ``[len(g), N_RAW]``
    float64 matrix per group. Tensors are CPU eager tensors or numpy arrays (as
    ``tf.numpy_function`` passes them, already zero-copy views); IndexedSlices are
    densified, float16/bfloat16 converted to float32 by the kernel's preparation.
    ``maps``: per group, each tensor's :class:`~traintape.schema.stats.IndexMap`."""
    from traintape.core.stats import raw_rows

    arrays = [_host_array(t) for g in groups for t in g]
    flat_maps = (
        None
        if maps is None
        else [m for g, ms in zip(groups, maps, strict=True) for m in ms or [None] * len(g)]
    )
    raw = raw_rows(arrays, maps=flat_maps) if arrays else np.zeros((0, N_RAW))
    out, k = [], 0
    for g in groups:
        out.append(raw[k : k + len(g)])
        k += len(g)
    return out
