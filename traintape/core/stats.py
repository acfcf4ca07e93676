"""Reference (numpy) implementation of the schema's stat vector.

Adapters compute the same vector on their device; this is what the Recorder uses for
host arrays and what tests compare adapters against. See :mod:`traintape.schema.stats`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from traintape.schema.stats import N_STATS

_SMALL = 1 << 16  # tensors below this many elements are reduced together in one pass


def _to_float(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f" and a.dtype.itemsize >= 4:
        return a
    return a.astype(np.float32) if a.dtype.kind in "fiub" or a.dtype.name == "bfloat16" else a


def stat_vector(x: np.ndarray) -> np.ndarray:
    """The stat vector of one array (any shape), as float64 ``[N_STATS]``."""
    x = _to_float(np.asarray(x)).ravel()
    out = np.empty(N_STATS, dtype=np.float64)
    n = x.size
    finite = np.isfinite(x)
    nf = int(np.count_nonzero(finite))
    nan = int(np.count_nonzero(np.isnan(x)))
    inf = n - nf - nan
    xf = x if nf == n else x[finite]
    xd = xf.astype(np.float64, copy=False)
    if nf:
        mean = float(xd.mean())
        out[0] = mean
        out[1] = float(np.sqrt(np.mean((xd - mean) ** 2)))
        out[2] = float(xd.min())
        out[3] = float(xd.max())
        out[4] = float(np.sqrt(np.dot(xd, xd)))
        out[5] = float(np.abs(xd).mean())
    else:
        out[[0, 1, 2, 3, 5]] = np.nan
        out[4] = 0.0
    out[6] = float(np.count_nonzero(x == 0)) / n if n else np.nan
    out[7] = nan
    out[8] = inf
    return out


def stat_vectors(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Stat vectors of many arrays, ``[len(arrays), N_STATS]`` float64.

    Uses the fused single-pass C kernel (:mod:`traintape.core.fused`, one memory pass
    per array) when it could be compiled, else :func:`stat_vectors_numpy`. Both agree to
    ~1e-12 relative for well-conditioned data.
    """
    from traintape.core import fused

    if fused.available():
        return fused.fused_stat_vectors(arrays)
    return stat_vectors_numpy(arrays)


def stat_vectors_numpy(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Numpy reference: stat vectors of many arrays, ``[len(arrays), N_STATS]`` float64.

    Small arrays are concatenated and reduced with ``ufunc.reduceat`` in a handful of
    passes (not one Python call per statistic per tensor); large ones one at a time.
    """
    out = np.empty((len(arrays), N_STATS), dtype=np.float64)
    small = [i for i, a in enumerate(arrays) if 0 < np.size(a) <= _SMALL]
    for i, a in enumerate(arrays):
        if not 0 < np.size(a) <= _SMALL:
            out[i] = stat_vector(a)
    if not small:
        return out
    parts = [_to_float(np.asarray(arrays[i])).ravel().astype(np.float64) for i in small]
    sizes = np.array([p.size for p in parts])
    x = np.concatenate(parts)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    finite = np.isfinite(x)
    isnan = np.isnan(x)
    nf = np.add.reduceat(finite.astype(np.float64), starts)
    nan = np.add.reduceat(isnan.astype(np.float64), starts)
    inf = sizes - nf - nan
    xz = np.where(finite, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.add.reduceat(xz, starts) / nf
        dev = np.where(finite, x - np.repeat(mean, sizes), 0.0)
        std = np.sqrt(np.add.reduceat(dev * dev, starts) / nf)
        mn = np.minimum.reduceat(np.where(finite, x, np.inf), starts)
        mx = np.maximum.reduceat(np.where(finite, x, -np.inf), starts)
        l2 = np.sqrt(np.add.reduceat(xz * xz, starts))
        absmean = np.add.reduceat(np.abs(xz), starts) / nf
    zero = np.add.reduceat((x == 0).astype(np.float64), starts) / sizes
    none = nf == 0
    for col in (mean, std, mn, mx, absmean):
        col[none] = np.nan
    out[small] = np.stack([mean, std, mn, mx, l2, absmean, zero, nan, inf], axis=1)
    return out
