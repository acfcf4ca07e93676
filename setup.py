"""Build hook: compile traintape's native stat kernels into the package at install time.

Two plain shared libraries (loaded with ctypes, not Python modules), so that an installed
traintape has its native kernels even where no C compiler exists at run time (slim
containers, locked-down nodes):

* ``traintape/core/_fused_stats.c`` → ``traintape/core/_fused_prebuilt*.so``, the host
  stat kernel (:mod:`traintape.core.native`; with OpenMP if the compiler has it).
* ``traintape/adapters/jax/_ffi_kernel.c`` (+ ``_ffi_buildinfo.c`` and the host kernel)
  → ``traintape/adapters/jax/_ffi_prebuilt*.so``, the JAX FFI handler
  (:mod:`traintape.adapters.jax.ffi_kernel`). It needs the XLA FFI C header that jaxlib
  ships (``jaxlib/include/xla/ffi/api/c_api.h``), found, without importing jaxlib, in
  ``$TRAINTAPE_XLA_FFI_INCLUDE``, else the importable jaxlib, else the site-packages of
  the interpreter running the build (pip's isolated build hides them from ``sys.path``,
  but they are the environment being installed into). jaxlib is deliberately not a build
  requirement: it would put jaxlib and its dependencies (~570 MB) into every isolated
  build, torch- and TF-only installs included, and build against the newest jaxlib,
  whose FFI API older installed jaxlibs refuse. So install jax before traintape (one
  ``pip install ".[jax]"`` into a fresh environment builds traintape before jaxlib is
  there: the handler is then compiled on first use).

  The handler is built against one XLA FFI C API version (``XLA_FFI_API_MAJOR.MINOR`` of
  that header, baked into the library with the hash of its C sources). jaxlib ≥ 0.8.1
  (API 0.2; 0.9.1–0.10.x: API 0.3) registers a handler of the same major version and any
  minor version up to its own, so one build serves the jaxlib it was built against and
  every later one until XLA raises its minimum (XLA promises at least 12 months); jaxlib
  ≤ 0.8.0 (API 0.1) accepts only its exact version. At load the handler is checked
  (sources, API version, registration) and otherwise compiled at run time.

Both builds are optional: if one fails (no compiler or no jaxlib at install time),
installation goes on and the kernel is compiled on first use, or the statistics fall
back to numpy / XLA reductions (``traintape doctor`` says which and why). Everything else
is in ``pyproject.toml``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
HOST_SOURCES = ["traintape/core/_fused_stats.c"]
# the order is part of the hash: ffi_kernel.source_hash() reads the same files
FFI_SOURCES = [
    "traintape/adapters/jax/_ffi_kernel.c",
    "traintape/adapters/jax/_ffi_buildinfo.c",
    "traintape/core/_fused_stats.c",
]
FFI_HEADER = Path("xla", "ffi", "api", "c_api.h")


def ffi_source_hash() -> str:
    """The hash of the FFI handler's C sources (as ``ffi_kernel.source_hash``)."""
    h = hashlib.sha256()
    for f in FFI_SOURCES:
        h.update((ROOT / f).read_bytes())
    return h.hexdigest()[:16]


def host_source_hash() -> str:
    """The hash of the host kernel's C source (as ``native.source_hash``)."""
    return hashlib.sha256((ROOT / HOST_SOURCES[0]).read_bytes()).hexdigest()[:16]


def xla_ffi_include() -> Path | None:
    """The include directory holding jaxlib's XLA FFI C header, or None."""
    dirs = []
    if os.environ.get("TRAINTAPE_XLA_FFI_INCLUDE"):
        dirs.append(Path(os.environ["TRAINTAPE_XLA_FFI_INCLUDE"]))
    spec = importlib.util.find_spec("jaxlib")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(p, "include") for p in spec.submodule_search_locations]
    paths = sysconfig.get_paths()
    dirs += [Path(paths[k], "jaxlib", "include") for k in ("purelib", "platlib")]
    return next((d for d in dirs if (d / FFI_HEADER).is_file()), None)


def jaxlib_version(include: Path) -> str:
    """The version of the jaxlib that ``include`` belongs to ('' if unknown)."""
    try:
        text = (include.parent / "version.py").read_text()
    except OSError:
        return ""
    m = re.search(r"^_version\s*=\s*[\"']([^\"']+)[\"']", text, re.M)
    return m.group(1) if m else ""


class OptionalBuildExt(build_ext):
    """Build each kernel with OpenMP, else without it, else not at all (with a warning).

    The FFI handler is built without OpenMP (it runs on XLA's own thread pool)."""

    def build_extension(self, ext: Extension) -> None:
        ffi = ext.name.endswith("_ffi_prebuilt")
        temp, force = self.build_temp, self.force
        # always rebuild the handler: which jaxlib header it is built against is not in
        # the file times setuptools compares (a build/ left by a build against another
        # jaxlib, whose header is older than that build, would otherwise be reused)
        self.force = force or ffi
        # both libraries compile _fused_stats.c, with different flags: separate objects
        self.build_temp = os.path.join(temp, ext.name)
        try:
            for omp in (False,) if ffi else (True, False):
                ext.extra_compile_args = ["-O3", "-std=c11", "-fopenmp" if omp else "-fopenmp-simd"]
                ext.extra_link_args = ["-fopenmp"] if omp else []
                try:
                    super().build_extension(ext)
                    return
                except Exception as e:  # compiler missing or failing: run-time build instead
                    err = e
        finally:
            self.build_temp, self.force = temp, force
        what = "JAX FFI stat kernel" if ffi else "C stat kernel"
        then = "XLA reductions" if ffi else "numpy"
        print(f"traintape: the {what} was not prebuilt ({err}); it will be compiled on "
              f"first use or fall back to {then}", file=sys.stderr)  # fmt: skip

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # not a Python module: no PyInit_ symbol to export


def extensions() -> list[Extension]:
    exts = [
        Extension(
            "traintape.core._fused_prebuilt",
            sources=HOST_SOURCES,
            define_macros=[("TT_SOURCE_HASH", f'"{host_source_hash()}"')],
        )
    ]
    include = xla_ffi_include()
    if include is None:
        print("traintape: jaxlib's XLA FFI header not found at build time; the JAX FFI "
              "stat kernel will be compiled on first use (install jax before traintape "
              "to prebuild it)", file=sys.stderr)  # fmt: skip
        return exts
    macros = [("TT_FFI_SOURCE_HASH", f'"{ffi_source_hash()}"'),
              ("TT_FFI_JAXLIB", f'"{jaxlib_version(include)}"')]  # fmt: skip
    ffi = Extension(
        "traintape.adapters.jax._ffi_prebuilt",
        sources=FFI_SOURCES,
        include_dirs=[str(include)],
        define_macros=macros,
        depends=[str(include / FFI_HEADER)],  # another jaxlib's header: rebuild
    )
    exts.append(ffi)
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
