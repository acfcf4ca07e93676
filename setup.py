"""Build hook: compile traintape's C stat kernel into the package at install time.

``traintape/core/_fused_stats.c`` becomes ``traintape/core/_fused_prebuilt*.so`` (a plain
shared library loaded with ctypes, not a Python module), so an installed traintape has its
native kernel even where no C compiler exists at run time (slim containers, locked-down
nodes). The build is optional: if it fails (no compiler at install time), installation
goes on and :mod:`traintape.core.native` compiles the kernel on first use, or falls back
to numpy (``traintape doctor`` says which). The JAX FFI handler needs jaxlib's headers and
is still compiled at run time. Everything else is in ``pyproject.toml``.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build the kernel with OpenMP, else without it, else not at all (with a warning)."""

    def build_extension(self, ext: Extension) -> None:
        for omp in (True, False):
            ext.extra_compile_args = ["-O3", "-std=c11", "-fopenmp" if omp else "-fopenmp-simd"]
            ext.extra_link_args = ["-fopenmp"] if omp else []
            try:
                super().build_extension(ext)
                return
            except Exception as e:  # compiler missing or failing: run-time build instead
                err = e
        print(f"traintape: the C stat kernel was not prebuilt ({err}); it will be compiled "
              f"on first use or fall back to numpy", file=sys.stderr)  # fmt: skip

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # not a Python module: no PyInit_ symbol to export


setup(
    ext_modules=[
        Extension("traintape.core._fused_prebuilt", sources=["traintape/core/_fused_stats.c"])
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
