"""Which jaxlibs accept a JAX FFI handler shipped in a wheel (docs/install.md).

For every pair (installed wheel, Python environment with some jaxlib) this runs one
recorded JAX step with no C compiler on PATH and prints which statistics backend the run
used and where the handler came from: ``jax-ffi-c`` with ``prebuilt at install`` means
that jaxlib registered the shipped handler; ``xla`` means it was not used (the reason:
the load-time check of its XLA FFI API version against the running jaxlib's) and nothing
could be compiled.

    # wheels with a handler built against two jaxlibs' headers (no isolation: the
    # header is found through TRAINTAPE_XLA_FFI_INCLUDE or the installed jaxlib)
    rm -rf build && TRAINTAPE_XLA_FFI_INCLUDE=$J081/jaxlib/include \\
        python -m build --wheel --no-isolation --outdir /tmp/w081 .
    pip install --no-deps --target /tmp/w081/t /tmp/w081/*.whl
    # environments with other jaxlibs: python -m venv, then pip install jax==V jaxlib==V
    python benchmarks/ffi_wheel_compat.py --wheel 0.8.1=/tmp/w081/t \\
        --python 0.10.2=/path/venv-0.10.2/bin/python --python 0.7.2=/path/venv-0.7.2/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_native_prebuilt import JAX_PROBE  # the probe the tests use


def _pairs(items: list[str]) -> list[tuple[str, str]]:
    return [tuple(s.split("=", 1)) for s in items]  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", action="append", required=True,
                    help="LABEL=DIR: a wheel installed with pip --target DIR")  # fmt: skip
    ap.add_argument("--python", action="append", required=True,
                    help="LABEL=PYTHON: an interpreter whose environment has jax/jaxlib")  # fmt: skip
    args = ap.parse_args()
    print("| handler built with | running jaxlib | stats backend | handler |")
    print("|---|---|---|---|")
    for built, target in _pairs(args.wheel):
        for ver, py in _pairs(args.python):
            cache = tempfile.mkdtemp()
            env = {"PATH": "/nonexistent", "CC": "/nonexistent", "TRAINTAPE_CACHE_DIR": cache,
                   "HOME": cache, "PYTHONPATH": target, "JAX_PLATFORMS": "cpu"}  # fmt: skip
            r = subprocess.run([os.path.abspath(py), "-c", JAX_PROBE, os.path.join(cache, "r")],
                               env=env, capture_output=True, text=True, cwd=cache,
                               timeout=600)  # fmt: skip
            if r.returncode:
                last = (r.stderr.strip().splitlines() or ["?"])[-1]
                print(f"| {built} | {ver} | error | {last[:120]} |")
                continue
            got = json.loads(r.stdout.splitlines()[-1])
            where = got["where"]
            if "prebuilt not used: " in where:  # why the shipped handler was not taken
                why = where.split("prebuilt not used: ", 1)[1].split(": ", 1)[-1]
                where = "not used: " + why.removesuffix(")")
            print(f"| {built} | {ver} | {got['backend']} | {where} |")


if __name__ == "__main__":
    main()
