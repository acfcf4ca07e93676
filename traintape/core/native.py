"""Native code: building and loading traintape's C stat kernel.

The fused stat kernel (``core/_fused_stats.c``) computes the raw rows of
:mod:`traintape.schema.stats` reading each buffer once. Installing the package builds it
(``setup.py``: ``core/_fused_prebuilt*.so``), which is loaded first; without that (or if
it is stale) it is compiled at run time with the system C
compiler (``$CC``, else ``gcc``/``cc``; ``-O3 -fopenmp``; ``target_clones`` picks
AVX-512/AVX2/baseline code at load time) into ``$TRAINTAPE_CACHE_DIR`` or
``~/.cache/traintape/<prefix>-<hash>.so`` (hash of sources, flags and compiler; written
to a temp file and renamed atomically), then loaded with ctypes. Without a working
compiler :func:`fused_lib` returns None and callers use the numpy reference.
``TRAINTAPE_NO_FUSED=1`` disables the kernel.

The kernel caches the ``sig`` pattern's signs (a pure function of the canonical index:
one bit per element, shared by all threads and calls of the process; see the sign cache
in ``_fused_stats.c``) so that a step's stats pass reads them instead of hashing every
index: at most 64 MiB per process (the signs of 2**29 elements), or
``$TRAINTAPE_SIG_CACHE_MIB`` MiB (0: no cache, every index is hashed; the results are the
same bit for bit). :func:`sig_cache_bytes` says how much it holds. The JAX FFI handler
(its own shared object) has a cache of its own under the same limit.

This module only builds and loads; calling the kernel is :mod:`traintape.core.stats`.
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

from traintape.schema.stats import RAW_NAMES

_log = logging.getLogger("traintape")

SOURCE: Final[Path] = Path(__file__).with_name("_fused_stats.c")
FLAGS_OMP: Final[list[str]] = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp"]
FLAGS_PLAIN: Final[list[str]] = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp-simd"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why: str = ""
_origin: str = ""


def cache_dir() -> Path:
    """Where compiled kernels are cached (``$TRAINTAPE_CACHE_DIR`` or the XDG cache)."""
    env = os.environ.get("TRAINTAPE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "traintape"


def compiler() -> str | None:
    """The C compiler used for run-time builds, or None."""
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
    :func:`cache_dir` as ``<prefix>-<hash>.so``. Raises ``RuntimeError`` with the
    compiler's message when no compiler is found or compilation fails.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        ver = b""
    h = hashlib.sha256("\0".join([cc, *flags, *map(str, include_dirs)]).encode() + ver)
    for f in (*sources, *depends):
        h.update(Path(f).read_bytes())
    target = cache_dir() / f"{prefix}-{h.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=f".{prefix}-", dir=target.parent)
    os.close(fd)
    try:
        incs = [f"-I{d}" for d in include_dirs]
        cmd = [cc, *flags, *incs, *map(str, sources), "-o", tmp, "-lm"]
        try:
            res = subprocess.run(cmd, capture_output=True, timeout=120)
        except OSError as e:
            raise RuntimeError(f"cannot run the C compiler {cc!r}: {e}") from e
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


def fused_lib() -> ctypes.CDLL | None:
    """The loaded fused stat kernel (compiled on first call), or None if unavailable."""
    global _lib, _tried, _why, _origin
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _load_fused()
        except Exception as e:  # no compiler, compile error, load error: numpy fallback
            _why = f"{type(e).__name__}: {e}"
            _log.debug("traintape: fused stat kernel unavailable (%s); using numpy", e)
            _lib = None
        _tried = True
    return _lib


def _load_fused() -> ctypes.CDLL | None:
    global _why, _origin
    if os.environ.get("TRAINTAPE_NO_FUSED"):
        _why = "disabled by TRAINTAPE_NO_FUSED"
        return None
    lib = None
    rejected = []
    for pre in prebuilt_paths():
        try:
            cand = _checked(ctypes.CDLL(str(pre)), pre)
            cand.tt_source_hash.restype = ctypes.c_char_p
            if cand.tt_source_hash().decode() != source_hash():
                raise RuntimeError("built from other C sources than this traintape's")
            lib = cand
            _origin = f"prebuilt at install ({pre.name})"
            break
        except Exception as e:  # stale or foreign build: compile one for this source
            _log.debug("traintape: prebuilt kernel %s not usable (%s)", pre, e)
            rejected.append(f"prebuilt {pre.name} not used: {e}")
    if lib is None:
        try:
            path = build_with_openmp("fused", [SOURCE])
        except RuntimeError as e:
            raise RuntimeError("; ".join([str(e), *rejected])) from e
        lib = _checked(ctypes.CDLL(str(path)), path)
        _origin = f"compiled at run time ({path})"
    fn = lib.tt_raw_stats
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    lib.tt_has_openmp.restype = ctypes.c_int
    lib.tt_sig_cache_limit.restype = ctypes.c_longlong
    lib.tt_sig_cache_limit.argtypes = [ctypes.c_longlong]
    lib.tt_sig_cache_bytes.restype = ctypes.c_longlong
    lib.tt_sig_cache_bytes.argtypes = []
    _log.debug("traintape: fused stat kernel %s", _origin)
    return lib


def prebuilt_paths() -> list[Path]:
    """Kernels built when the package was installed (``setup.py``), unless
    ``TRAINTAPE_NO_PREBUILT`` is set."""
    if os.environ.get("TRAINTAPE_NO_PREBUILT"):
        return []
    return sorted(SOURCE.parent.glob("_fused_prebuilt*.so"))


def source_hash() -> str:
    """Hash of the kernel's C source; a prebuilt kernel carries the one it was built from
    (``setup.py`` hashes the same file)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


#: Functions this build's kernel exports: a library lacking one was built from older
#: sources (e.g. a prebuilt kernel an editable install left behind) and is not used.
REQUIRED_SYMBOLS: Final[tuple[str, ...]] = (
    "tt_raw_stats",
    "tt_raw_stats_mapped",
    "tt_sig_cache_limit",
    "tt_sig_cache_bytes",
    "tt_source_hash",
)


def _checked(lib: ctypes.CDLL, path: Path) -> ctypes.CDLL:
    """``lib`` if its raw fields and functions are this build's (a kernel from another
    version is not)."""
    lib.tt_raw_names.restype = ctypes.c_char_p
    names = tuple(lib.tt_raw_names().decode().split(","))
    if names != RAW_NAMES:
        raise RuntimeError(
            f"{path}: the kernel's raw fields {names} differ from traintape.schema.stats "
            f"{RAW_NAMES}; rebuild it (delete the file)"
        )
    missing = [f for f in REQUIRED_SYMBOLS if not hasattr(lib, f)]
    if missing:
        raise RuntimeError(f"{path}: built from older sources (no {', '.join(missing)})")
    return lib


def origin() -> str:
    """Where the loaded kernel came from (prebuilt at install / compiled at run time)."""
    fused_lib()
    return _origin


def fused_available() -> bool:
    """Whether the compiled kernel is usable (compiles it on the first call)."""
    return fused_lib() is not None


def fused_has_openmp() -> bool:
    """Whether the loaded kernel was built with OpenMP (False if unavailable)."""
    lib = fused_lib()
    return bool(lib is not None and lib.tt_has_openmp())


def sig_cache_bytes() -> int:
    """Bytes of ``sig`` signs the loaded kernel has cached (0 if unavailable)."""
    lib = fused_lib()
    return int(lib.tt_sig_cache_bytes()) if lib is not None else 0


def sig_cache_limit(nbytes: int | None = None) -> int:
    """The kernel's ``sig`` sign cache limit in bytes; with ``nbytes``, set it (signs
    already cached stay) and return the previous one. 0 if the kernel is unavailable."""
    lib = fused_lib()
    if lib is None:
        return 0
    return int(lib.tt_sig_cache_limit(-1 if nbytes is None else max(0, int(nbytes))))


def unavailable_reason() -> str:
    """Why :func:`fused_lib` returned None ('' if it loaded or was not tried)."""
    return _why


def reset_for_tests() -> None:
    """Forget the loaded kernel so the next call re-resolves it (tests only)."""
    global _lib, _tried, _why, _origin
    with _lock:
        _lib, _tried, _why, _origin = None, False, "", ""
