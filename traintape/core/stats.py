"""Raw rows and stat vectors of host (numpy) arrays.

:func:`raw_rows` is the host backend of the stat algebra (:mod:`traintape.schema.stats`):
C-contiguous float32/float64 arrays go through traintape's fused C kernel
(:mod:`traintape.core.native`; one memory pass per array, blocked and vectorised,
OpenMP across blocks, shifted per-block sums in double merged with Chan's formula, so the
result does not depend on the thread count); strided float views are copied contiguous
and float16/bfloat16/integer/bool arrays converted to float32 first (as the reference
does); everything else, or everything when the kernel is unavailable, goes through
:func:`traintape.schema.stats.reference_raw_rows`. Both agree to ~1e-12 relative for
well-conditioned data (the kernel accumulates float32 data in float32 lanes over
512-element chunks: ~1e-6 relative at worst, the data's own precision).

Threads: the ``nthreads`` argument, else ``$TRAINTAPE_FUSED_THREADS``, else the OpenMP
default (number of CPUs).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from traintape.core import native
from traintape.schema.stats import (
    N_RAW,
    Array,
    IndexMap,
    as_float,
    finalize,
    reference_raw_rows,
)

_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}


def backend() -> str:
    """Which host backend :func:`raw_rows` uses: ``'c-openmp'``, ``'c'`` or ``'numpy'``."""
    if not native.fused_available():
        return "numpy"
    return "c-openmp" if native.fused_has_openmp() else "c"


def supported(a: np.ndarray) -> bool:
    """Whether ``a`` can go through the kernel as is (C-contiguous native float32/64)."""
    return a.dtype in _DTYPES and a.flags.c_contiguous and a.dtype.isnative


def _prepare(a: np.ndarray) -> np.ndarray:
    """Make ``a`` kernel-ready: strided float32/float64 → contiguous copy; float16,
    bfloat16, integer and bool → float32 (:func:`~traintape.schema.stats.as_float`)."""
    if a.dtype in _DTYPES:
        if a.flags.c_contiguous and a.dtype.isnative:
            return a
        return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
    if (
        (a.dtype.kind == "f" and a.dtype.itemsize < 4)
        or a.dtype.kind in "iub"
        or (a.dtype.name == "bfloat16")
    ):
        return np.ascontiguousarray(as_float(a))
    return a


def _default_threads() -> int:
    env = os.environ.get("TRAINTAPE_FUSED_THREADS")
    try:
        return int(env) if env else 0
    except ValueError:
        return 0


_MAXD = 8  # TT_MAXD in _fused_stats.c
_WORDS = 2 + 2 * _MAXD  # TT_MAP_WORDS


def map_words(imap: IndexMap | None, shape: Sequence[int]) -> list[int] | None:
    """The kernel's encoding of ``imap`` for an array of ``shape`` (``TT_MAP_WORDS``
    integers: nd, offset, dims, strides; all zeros for the identity), or None when it
    has more than ``TT_MAXD`` axes after merging contiguous ones."""
    w = [0] * _WORDS
    if imap is None:
        return w
    dims, strides, off = imap.collapsed(shape)
    if len(dims) > _MAXD:
        return None
    w[0], w[1] = len(dims), off
    w[2 : 2 + len(dims)] = dims
    w[2 + _MAXD : 2 + _MAXD + len(dims)] = strides
    return w


def _mapped(lib: Any) -> Any:
    fn = lib.tt_raw_stats_mapped
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int]
    return fn


def raw_rows(
    arrays: Sequence[np.ndarray],
    nthreads: int | None = None,
    maps: Sequence[IndexMap | None] | None = None,
) -> Array:
    """Raw rows ``[len(arrays), N_RAW]`` float64 (:data:`~traintape.schema.stats.RAW_NAMES`).

    ``maps``: each array's :class:`~traintape.schema.stats.IndexMap` (where its elements
    sit in the canonical tensor, for the ``sig`` field; None: the identity).
    The arrays are only read; they must not be written concurrently.
    """
    n = len(arrays)
    maps = [None] * n if maps is None else list(maps)
    if len(maps) != n:
        raise ValueError(f"{len(maps)} index maps for {n} arrays")
    out = np.empty((n, N_RAW), dtype=np.float64)
    lib = native.fused_lib()
    fast: list[int] = []
    keep: list[np.ndarray] = []  # holds the buffers alive during the call
    words: list[list[int]] = []
    slow: list[int] = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if lib is not None and a.size:
            a = _prepare(a)
        w = map_words(maps[i], a.shape) if lib is not None and a.size else None
        if w is not None and supported(a):
            fast.append(i)
            keep.append(a)
            words.append(w)
        else:
            slow.append(i)
    if slow:
        out[slow] = reference_raw_rows(
            [np.asarray(arrays[i]) for i in slow], [maps[i] for i in slow]
        )
    if fast:
        assert lib is not None
        ptrs = np.array([a.ctypes.data for a in keep], dtype=np.uintp)
        lens = np.array([a.size for a in keep], dtype=np.int64)
        codes = np.array([_DTYPES[a.dtype] for a in keep], dtype=np.int32)
        table = np.array(words, dtype=np.int64)
        res = np.empty((len(fast), N_RAW), dtype=np.float64)
        th = _default_threads() if nthreads is None else int(nthreads)
        rc = _mapped(lib)(
            len(fast),
            ptrs.ctypes.data,
            lens.ctypes.data,
            codes.ctypes.data,
            table.ctypes.data,
            res.ctypes.data,
            th,
        )
        if rc != 0:
            raise MemoryError("traintape fused stat kernel: out of memory (or a bad index map)")
        out[fast] = res
    return out


def stat_vectors(
    arrays: Sequence[np.ndarray],
    nthreads: int | None = None,
    maps: Sequence[IndexMap | None] | None = None,
) -> Array:
    """Stat vectors ``[len(arrays), N_STATS]`` float64 of host arrays."""
    return finalize(raw_rows(arrays, nthreads, maps))


def stat_vector(x: np.ndarray) -> Array:
    """The stat vector ``[N_STATS]`` of one array (any shape)."""
    return stat_vectors([x])[0]
