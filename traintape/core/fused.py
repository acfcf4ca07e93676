"""Fused single-pass stat kernel (C, compiled on first use) for host arrays.

:func:`fused_raw` computes, for many float32/float64 buffers, the mergeable *raw* rows
``[n, RAW]`` float64 — numel, finite count, sum, M2 (sum of squared deviations from the
mean), min, max, sum of squares, sum |x|, zero count, NaN count (moments over finite
elements only) — reading each buffer **once** (``_fused_stats.c``: blocked, vectorised,
OpenMP across blocks, shifted per-block sums in double merged with Chan's formula, so
the result is deterministic whatever the thread count). :func:`finalize_raw` turns raw
rows into the schema's stat vectors (:mod:`traintape.schema.stats`);
:func:`fused_stat_vectors` does both.

The C source is compiled with the system ``gcc`` (``-O3 -fopenmp``; ``target_clones``
picks AVX-512/AVX2/baseline code at load time, no ``-march=native``) into
``$TRAINTAPE_CACHE_DIR`` or ``~/.cache/traintape/fused-<hash>.so`` (hash of source,
flags and compiler; written to a temp file and renamed atomically), then loaded with
ctypes. Without a working compiler everything falls back silently to the numpy
reference (:func:`traintape.core.stats.stat_vectors_numpy`), logged at debug level.
``TRAINTAPE_NO_FUSED=1`` disables the kernel.

Threads: ``nthreads`` argument, else ``$TRAINTAPE_FUSED_THREADS``, else the OpenMP
default (number of CPUs).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from traintape.schema.stats import N_STATS

_log = logging.getLogger("traintape")

RAW_NAMES: Final[tuple[str, ...]] = (
    "numel",
    "nfinite",
    "sum",
    "m2",
    "min",
    "max",
    "sumsq",
    "abs_sum",
    "zeros",
    "nan",
)
RAW: Final[int] = len(RAW_NAMES)
(NUMEL, NFIN, SUM, M2, MIN, MAX, SUMSQ, ABS, ZEROS, NAN) = range(RAW)

SOURCE: Final[Path] = Path(__file__).with_name("_fused_stats.c")
FLAGS_OMP = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp"]
FLAGS_PLAIN = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd"]
_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    env = os.environ.get("TRAINTAPE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "traintape"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build_shared_object(
    prefix: str,
    sources: Sequence[Path],
    flags: Sequence[str],
    *,
    include_dirs: Sequence[Path] = (),
    depends: Sequence[Path] = (),
) -> Path:
    """Compile ``sources`` into a cached shared object and return its path.

    The cache key hashes the sources, ``depends`` (headers), flags and the compiler's
    version, so an edited source or an upgraded header rebuilds. The object is written to
    a temp file and renamed atomically (concurrent builders agree on the content) into
    :func:`_cache_dir` as ``<prefix>-<hash>.so``. Raises ``RuntimeError`` with the
    compiler's message when no compiler is found or compilation fails.
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        ver = b""
    h = hashlib.sha256("\0".join([cc, *flags, *map(str, include_dirs)]).encode() + ver)
    for f in (*sources, *depends):
        h.update(Path(f).read_bytes())
    target = _cache_dir() / f"{prefix}-{h.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=f".{prefix}-", dir=target.parent)
    os.close(fd)
    try:
        incs = [f"-I{d}" for d in include_dirs]
        cmd = [cc, *flags, *incs, *map(str, sources), "-o", tmp, "-lm"]
        res = subprocess.run(cmd, capture_output=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(res.stderr.decode(errors="replace")[-2000:])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_with_openmp(prefix: str, sources: Sequence[Path], **kw: Any) -> Path:
    """:func:`build_shared_object` with OpenMP, retried without it if that fails."""
    try:
        return build_shared_object(prefix, sources, FLAGS_OMP, **kw)
    except RuntimeError as e:
        _log.debug("traintape: building %s with OpenMP failed (%s); retrying", prefix, e)
        return build_shared_object(prefix, sources, FLAGS_PLAIN, **kw)


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _load_uncached()
        except Exception as e:  # no compiler, compile error, load error: numpy fallback
            _log.debug("traintape: fused stat kernel unavailable (%s); using numpy", e)
            _lib = None
        _tried = True
    return _lib


def _load_uncached() -> ctypes.CDLL | None:
    if os.environ.get("TRAINTAPE_NO_FUSED"):
        _log.debug("traintape: fused stat kernel disabled by TRAINTAPE_NO_FUSED")
        return None
    path = build_with_openmp("fused", [SOURCE])
    lib = ctypes.CDLL(str(path))
    fn = lib.tt_raw_stats
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.tt_has_openmp.restype = ctypes.c_int
    _log.debug("traintape: fused stat kernel loaded from %s", path)
    return lib


def available() -> bool:
    """Whether the compiled kernel is usable (compiles it on the first call)."""
    return _load() is not None


def has_openmp() -> bool:
    """Whether the loaded kernel was built with OpenMP (False if unavailable)."""
    lib = _load()
    return bool(lib is not None and lib.tt_has_openmp())


def _reset_for_tests() -> None:
    """Forget the loaded kernel so the next call re-resolves it (tests only)."""
    global _lib, _tried
    with _lock:
        _lib, _tried = None, False


def supported(a: np.ndarray) -> bool:
    """Whether ``a`` can go through the kernel as is (C-contiguous float32/float64)."""
    return a.dtype in _DTYPES and a.flags.c_contiguous and a.dtype.isnative


def _prepare(a: np.ndarray) -> np.ndarray:
    """Make ``a`` kernel-ready when that is cheaper than the numpy path: strided
    float32/float64 → contiguous copy; float16/bfloat16/int/bool → float32 (the same
    promotion as the numpy reference). Other dtypes are returned unchanged."""
    if a.dtype in _DTYPES:
        return (
            a
            if a.flags.c_contiguous and a.dtype.isnative
            else np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
        )
    if (
        (a.dtype.kind == "f" and a.dtype.itemsize < 4)
        or a.dtype.kind in "iub"
        or (a.dtype.name == "bfloat16")
    ):
        return np.ascontiguousarray(a, dtype=np.float32)
    return a


def _default_threads() -> int:
    env = os.environ.get("TRAINTAPE_FUSED_THREADS")
    try:
        return int(env) if env else 0
    except ValueError:
        return 0


def _numpy_raw(a: np.ndarray) -> np.ndarray:
    """Raw row of one array with numpy (fallback; any numeric dtype)."""
    from traintape.core.stats import _to_float

    x = _to_float(np.asarray(a)).ravel()
    row = np.zeros(RAW, dtype=np.float64)
    n = x.size
    fin = np.isfinite(x)
    nf = int(np.count_nonzero(fin))
    xd = (x if nf == n else x[fin]).astype(np.float64, copy=False)
    row[NUMEL], row[NFIN] = n, nf
    row[MIN], row[MAX] = np.inf, -np.inf
    if nf:
        s = float(xd.sum())
        row[SUM] = s
        row[M2] = float(np.sum((xd - s / nf) ** 2))
        row[MIN], row[MAX] = float(xd.min()), float(xd.max())
        row[SUMSQ] = float(np.dot(xd, xd))
        row[ABS] = float(np.abs(xd).sum())
    row[ZEROS] = float(np.count_nonzero(x == 0))
    row[NAN] = float(np.count_nonzero(np.isnan(x)))
    return row


def fused_raw(arrays: Sequence[np.ndarray], nthreads: int | None = None) -> np.ndarray:
    """Mergeable raw rows ``[len(arrays), RAW]`` float64 (columns :data:`RAW_NAMES`).

    C-contiguous native float32/float64 arrays go through the compiled kernel in one
    call (one pass over each); strided float32/float64 views are copied contiguous and
    float16/bfloat16/integer/bool arrays converted to float32 first (as the numpy
    reference does); anything else — or every array when the kernel is unavailable —
    is reduced with numpy. The arrays are only
    read; they must not be written concurrently.
    """
    n = len(arrays)
    out = np.empty((n, RAW), dtype=np.float64)
    lib = _load()
    fast: list[int] = []
    keep: list[np.ndarray] = []  # holds the buffers alive during the call
    for i, a in enumerate(arrays):
        a = _prepare(np.asarray(a)) if lib is not None else np.asarray(a)
        if lib is not None and supported(a):
            fast.append(i)
            keep.append(a)
        else:
            out[i] = _numpy_raw(a)
    if fast:
        assert lib is not None
        ptrs = np.array([a.ctypes.data for a in keep], dtype=np.uintp)
        lens = np.array([a.size for a in keep], dtype=np.int64)
        codes = np.array([_DTYPES[a.dtype] for a in keep], dtype=np.int32)
        res = np.empty((len(fast), RAW), dtype=np.float64)
        th = _default_threads() if nthreads is None else int(nthreads)
        rc = lib.tt_raw_stats(
            len(fast), ptrs.ctypes.data, lens.ctypes.data, codes.ctypes.data, res.ctypes.data, th
        )
        if rc != 0:
            raise MemoryError("traintape fused stat kernel: out of memory")
        out[fast] = res
    return out


def merge_raw(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Combine raw rows ``[n, RAW]`` of the same tensors over disjoint sets of elements."""
    na, nb = a[:, NFIN], b[:, NFIN]
    n = na + nb
    with np.errstate(invalid="ignore", divide="ignore"):
        delta = b[:, SUM] / np.maximum(nb, 1) - a[:, SUM] / np.maximum(na, 1)
        cross = np.where((na > 0) & (nb > 0), delta * delta * na * nb / np.maximum(n, 1), 0.0)
    out = a + b
    out[:, M2] = a[:, M2] + b[:, M2] + cross
    out[:, MIN] = np.minimum(a[:, MIN], b[:, MIN])
    out[:, MAX] = np.maximum(a[:, MAX], b[:, MAX])
    return out


def finalize_raw(raw: np.ndarray) -> np.ndarray:
    """Raw rows → stat vectors ``[n, N_STATS]`` float64 in schema order."""
    raw = np.asarray(raw, dtype=np.float64).reshape(-1, RAW)
    out = np.empty((raw.shape[0], N_STATS), dtype=np.float64)
    numel, nfin, nan = raw[:, NUMEL], raw[:, NFIN], raw[:, NAN]
    with np.errstate(invalid="ignore", divide="ignore"):
        out[:, 0] = raw[:, SUM] / nfin
        out[:, 1] = np.sqrt(np.maximum(raw[:, M2], 0.0) / nfin)
        out[:, 2] = raw[:, MIN]
        out[:, 3] = raw[:, MAX]
        out[:, 4] = np.sqrt(raw[:, SUMSQ])
        out[:, 5] = raw[:, ABS] / nfin
        out[:, 6] = np.where(numel > 0, raw[:, ZEROS] / np.maximum(numel, 1), np.nan)
    out[:, 7] = nan
    out[:, 8] = numel - nfin - nan
    none = nfin == 0
    out[none, 0:4] = np.nan
    out[none, 5] = np.nan
    out[none, 4] = 0.0
    return out


def fused_stat_vectors(arrays: Sequence[np.ndarray], nthreads: int | None = None) -> np.ndarray:
    """Stat vectors ``[len(arrays), N_STATS]`` float64 of host arrays (one pass each).

    Same definition and order as :func:`traintape.core.stats.stat_vectors_numpy`
    (moments over finite elements, population std, ``zero_frac`` over all elements).
    """
    return finalize_raw(fused_raw(arrays, nthreads))
