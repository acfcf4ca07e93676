"""The schema's stat vector computed by TensorFlow ops (eagerly or inside tf.function).

Same definition as :func:`traintape.core.stats.stat_vectors`: moments over finite
elements only (two-pass std, population), ``zero_frac`` over all elements, NaN/Inf
counted. Reductions run in float32 (float64 inputs stay float64); the host gets one
``[n, 9]`` float64 array per kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from traintape.schema.stats import N_STATS

_SMALL = 4096  # tensors with a static size up to this are reduced together (segment ops)
_FAST_MIN = 1 << 16  # from this size on, try the cheap all-finite path first
_CANCEL = 100.0  # one-pass variance only when mean**2 <= _CANCEL * var


def _flat(x: Any) -> tf.Tensor:
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    x = tf.convert_to_tensor(x)
    dt = tf.float64 if x.dtype == tf.float64 else tf.float32
    return tf.reshape(tf.cast(x, dt), [-1])


def stat_vector(x: Any) -> tf.Tensor:
    """Stat vector ``[9]`` of one tensor (any shape; IndexedSlices are densified).

    Exact masked two-pass computation (handles NaN/Inf); see :func:`stat_matrix` for
    the faster paths used on many/large tensors.
    """
    x = _flat(x)
    dt = x.dtype
    n = tf.cast(tf.size(x), dt)
    finite = tf.math.is_finite(x)
    nf = tf.reduce_sum(tf.cast(finite, dt))
    nan = tf.reduce_sum(tf.cast(tf.math.is_nan(x), dt))
    zero = tf.zeros_like(x)
    xz = tf.where(finite, x, zero)
    mean = tf.math.divide(tf.reduce_sum(xz), nf)
    dev = tf.where(finite, x - mean, zero)
    std = tf.sqrt(tf.math.divide(tf.reduce_sum(dev * dev), nf))
    inf = tf.constant(float("inf"), dt)
    nan_c = tf.constant(float("nan"), dt)
    has = nf > 0
    mn = tf.where(has, tf.reduce_min(tf.where(finite, x, tf.fill(tf.shape(x), inf))), nan_c)
    mx = tf.where(has, tf.reduce_max(tf.where(finite, x, tf.fill(tf.shape(x), -inf))), nan_c)
    l2 = tf.sqrt(tf.reduce_sum(xz * xz))
    absmean = tf.math.divide(tf.reduce_sum(tf.abs(xz)), nf)
    zf = tf.math.divide(tf.reduce_sum(tf.cast(tf.equal(x, 0), dt)), n)
    vec = tf.stack([mean, std, mn, mx, l2, absmean, zf, nan, n - nf - nan])
    return tf.cast(vec, tf.float64)


def _fast_vector(x: tf.Tensor) -> tf.Tensor:
    """All-finite fast path (7 cheap reductions); falls back to :func:`stat_vector`
    through ``tf.cond`` when the tensor has NaN/Inf or the one-pass variance could
    cancel (mean**2 > 100 * var)."""
    n = tf.cast(tf.size(x), tf.float64)
    # independent single-input reductions: TF fuses each elementwise op into its reduce
    s = tf.cast(tf.reduce_sum(x), tf.float64)
    ss = tf.cast(tf.reduce_sum(tf.square(x)), tf.float64)
    asum = tf.cast(tf.reduce_sum(tf.abs(x)), tf.float64)
    nonzero = tf.cast(tf.reduce_sum(tf.square(tf.sign(x))), tf.float64)
    mean = s / n
    var = ss / n - mean * mean
    ok = tf.math.is_finite(s + ss + asum) & (mean * mean <= _CANCEL * var)

    def fast() -> tf.Tensor:
        mn = tf.cast(tf.reduce_min(x), tf.float64)
        mx = tf.cast(tf.reduce_max(x), tf.float64)
        z = tf.constant(0.0, tf.float64)
        return tf.stack([mean, tf.sqrt(tf.maximum(var, 0.0)), mn, mx, tf.sqrt(ss), asum / n,
                         (n - nonzero) / n, z, z])  # fmt: skip

    return tf.cond(ok, fast, lambda: stat_vector(x))


def _segment_matrix(xs: Sequence[tf.Tensor], sizes: Sequence[int]) -> tf.Tensor:
    """Exact stat vectors of many small flat tensors with a fixed number of ops."""
    dt = tf.float64 if any(x.dtype == tf.float64 for x in xs) else tf.float32
    x = tf.concat([tf.cast(t, dt) for t in xs], 0)
    ids = tf.constant(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))
    k = len(sizes)
    sz = tf.constant(np.asarray(sizes, np.float64), tf.float64)

    def seg(v: tf.Tensor) -> tf.Tensor:
        return tf.cast(tf.math.segment_sum(v, ids), tf.float64)

    finite = tf.math.is_finite(x)
    nf = seg(tf.cast(finite, dt))
    nan = seg(tf.cast(tf.math.is_nan(x), dt))
    zero = tf.zeros_like(x)
    xz = tf.where(finite, x, zero)
    mean = seg(xz) / nf
    dev = tf.where(finite, x - tf.gather(tf.cast(mean, dt), ids), zero)
    std = tf.sqrt(seg(dev * dev) / nf)
    inf = tf.fill(tf.shape(x), tf.constant(float("inf"), dt))
    mn = tf.cast(tf.math.segment_min(tf.where(finite, x, inf), ids), tf.float64)
    mx = tf.cast(tf.math.segment_max(tf.where(finite, x, -inf), ids), tf.float64)
    has = nf > 0
    nanv = tf.fill([k], tf.constant(float("nan"), tf.float64))
    mn, mx = tf.where(has, mn, nanv), tf.where(has, mx, nanv)
    l2 = tf.sqrt(seg(xz * xz))
    absmean = seg(tf.abs(xz)) / nf
    zf = seg(tf.cast(tf.equal(x, 0), dt)) / sz
    return tf.stack([mean, std, mn, mx, l2, absmean, zf, nan, sz - nf - nan], axis=1)


def stat_matrix(tensors: Sequence[Any]) -> tf.Tensor:
    """Stat vectors of many tensors, ``[len(tensors), 9]`` float64.

    Tensors with a static size <= 4096 are reduced together with segment ops (a fixed
    number of ops however many there are); large ones take a cheap all-finite path
    (sum, sum of squares, sum of |x|, count of sign(x)**2, min, max) and fall back to the exact
    masked computation only when they hold NaN/Inf or their mean dwarfs their spread.
    """
    if not tensors:
        return tf.zeros([0, N_STATS], tf.float64)
    flats = [_flat(t) for t in tensors]
    rows: list[Any] = [None] * len(flats)
    small = [i for i, f in enumerate(flats)
             if f.shape.num_elements() is not None and 0 < f.shape.num_elements() <= _SMALL]  # fmt: skip
    if len(small) > 1:
        m = _segment_matrix(
            [flats[i] for i in small], [flats[i].shape.num_elements() for i in small]
        )
        for j, i in enumerate(small):
            rows[i] = m[j]
    for i, f in enumerate(flats):
        if rows[i] is None:
            n = f.shape.num_elements()
            rows[i] = _fast_vector(f) if n is not None and n >= _FAST_MIN else stat_vector(f)
    return tf.stack(rows)


def host_stats_enabled() -> bool:
    """Compute stats on the host with the fused C kernel (:mod:`traintape.core.fused`)
    instead of the TF op graph: only when the kernel compiled and TF sees no GPU (on
    CPU the tensors reach numpy without a device copy; one fused pass per tensor is
    several times cheaper than the graph of reductions below). Measured in
    ``benchmarks/tf_overhead.py``. ``TRAINTAPE_TF_GRAPH_STATS=1`` forces the graph path."""
    global _HOST
    if _HOST is None:
        import os

        from traintape.core import fused

        _HOST = (
            not os.environ.get("TRAINTAPE_TF_GRAPH_STATS")
            and fused.available()
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


def host_stat_matrices(groups: Sequence[Sequence[Any]]) -> list[np.ndarray]:
    """Stat vectors of several groups of tensors via the host fused kernel, in **one**
    kernel call (one OpenMP region over every tensor of the step): one ``[len(g), 9]``
    float64 matrix per group. Tensors are CPU eager tensors or numpy arrays (as
    ``tf.numpy_function`` passes them, already zero-copy views); IndexedSlices are
    densified, float16/bfloat16 converted to float32 by the kernel's preparation."""
    from traintape.core.fused import finalize_raw, fused_raw

    arrays = [_host_array(t) for g in groups for t in g]
    stats = finalize_raw(fused_raw(arrays)) if arrays else np.zeros((0, N_STATS))
    out, k = [], 0
    for g in groups:
        out.append(stats[k : k + len(g)])
        k += len(g)
    return out


def host_stat_matrix(tensors: Sequence[Any]) -> np.ndarray:
    """Stat vectors ``[n, 9]`` float64 of eager tensors via the host fused kernel
    (see :func:`host_stat_matrices`)."""
    return host_stat_matrices([tensors])[0]
