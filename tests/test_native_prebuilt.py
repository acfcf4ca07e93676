"""The C stat kernel is built when the package is installed (setup.py), so an installed
traintape uses it where no C compiler exists at run time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _probe(env_extra: dict[str, str], pythonpath: str, cache: Path) -> list[str]:
    code = (
        "from traintape.core import native, stats\n"
        "print(native.fused_available())\n"
        "print(stats.backend())\n"
        "print(native.origin() or native.unavailable_reason())\n"
        "import traintape; print(traintape.__file__)\n"
    )
    env = {"PATH": "/nonexistent", "CC": "/nonexistent", "PYTHONPATH": pythonpath,
           "TRAINTAPE_CACHE_DIR": str(cache), "HOME": str(cache), **env_extra}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=str(cache), timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_installed_package_uses_its_prebuilt_kernel_without_a_compiler(tmp_path):
    target = tmp_path / "site"
    # `pip install .` (no deps: they come from this environment), then no compiler at all
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert list((target / "traintape" / "core").glob("_fused_prebuilt*.so"))
    cache = tmp_path / "cache"
    cache.mkdir()
    site = [p for p in sys.path if p.endswith("site-packages")]
    ok, backend, where, module = _probe({}, os.pathsep.join([str(target), *site]), cache)
    assert module.startswith(str(target))  # the installed copy, not the checkout
    assert ok == "True" and backend.startswith("c"), (ok, backend)
    assert "prebuilt" in where
    assert not list(cache.rglob("*.so"))  # nothing was compiled at run time
    # without the prebuilt kernel and without a compiler: the numpy fallback, and why
    ok, backend, where, _ = _probe({"TRAINTAPE_NO_PREBUILT": "1"},
                                   os.pathsep.join([str(target), *site]), cache)  # fmt: skip
    assert backend == "numpy" and "compiler" in where.lower(), (ok, backend, where)
