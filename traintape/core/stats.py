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

import os
from collections.abc import Sequence

import numpy as np

from traintape.core import native
from traintape.schema.stats import N_RAW, Array, as_float, finalize, reference_raw_rows

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


def raw_rows(arrays: Sequence[np.ndarray], nthreads: int | None = None) -> Array:
    """Raw rows ``[len(arrays), N_RAW]`` float64 (:data:`~traintape.schema.stats.RAW_NAMES`).

    The arrays are only read; they must not be written concurrently.
    """
    n = len(arrays)
    out = np.empty((n, N_RAW), dtype=np.float64)
    lib = native.fused_lib()
    fast: list[int] = []
    keep: list[np.ndarray] = []  # holds the buffers alive during the call
    slow: list[int] = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if lib is not None and a.size:
            a = _prepare(a)
        if lib is not None and a.size and supported(a):
            fast.append(i)
            keep.append(a)
        else:
            slow.append(i)
    if slow:
        out[slow] = reference_raw_rows([np.asarray(arrays[i]) for i in slow])
    if fast:
        assert lib is not None
        ptrs = np.array([a.ctypes.data for a in keep], dtype=np.uintp)
        lens = np.array([a.size for a in keep], dtype=np.int64)
        codes = np.array([_DTYPES[a.dtype] for a in keep], dtype=np.int32)
        res = np.empty((len(fast), N_RAW), dtype=np.float64)
        th = _default_threads() if nthreads is None else int(nthreads)
        rc = lib.tt_raw_stats(
            len(fast), ptrs.ctypes.data, lens.ctypes.data, codes.ctypes.data, res.ctypes.data, th
        )
        if rc != 0:
            raise MemoryError("traintape fused stat kernel: out of memory")
        out[fast] = res
    return out


def stat_vectors(arrays: Sequence[np.ndarray], nthreads: int | None = None) -> Array:
    """Stat vectors ``[len(arrays), N_STATS]`` float64 of host arrays."""
    return finalize(raw_rows(arrays, nthreads))


def stat_vector(x: np.ndarray) -> Array:
    """The stat vector ``[N_STATS]`` of one array (any shape)."""
    return stat_vectors([x])[0]
