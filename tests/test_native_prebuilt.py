"""The native kernels are built when the package is installed (setup.py): the host C stat
kernel and, where jaxlib's headers are there at install time, the JAX FFI handler. An
installed traintape uses them where no C compiler exists at run time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = [p for p in sys.path if p.endswith("site-packages")]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install .`` into a fresh target (no deps: they come from this environment)."""
    target = tmp_path_factory.mktemp("install") / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return target


def _run(code: str, target: Path, cache: Path, env_extra: dict[str, str] | None = None,
         *args: str) -> list[str]:  # fmt: skip
    """Run ``code`` with the installed copy first on the path and no C compiler at all."""
    env = {"PATH": "/nonexistent", "CC": "/nonexistent", "TRAINTAPE_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(target), *SITE]), "HOME": str(cache),
           "JAX_PLATFORMS": "cpu", **(env_extra or {})}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env=env, cwd=str(cache), timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


HOST_PROBE = (
    "from traintape.core import native, stats\n"
    "print(native.fused_available())\n"
    "print(stats.backend())\n"
    "print(native.origin() or native.unavailable_reason())\n"
    "import traintape; print(traintape.__file__)\n"
)


def test_installed_package_uses_its_prebuilt_kernel_without_a_compiler(installed, tmp_path):
    assert list((installed / "traintape" / "core").glob("_fused_prebuilt*.so"))
    cache = tmp_path / "cache"
    cache.mkdir()
    ok, backend, where, module = _run(HOST_PROBE, installed, cache)
    assert module.startswith(str(installed))  # the installed copy, not the checkout
    assert ok == "True" and backend.startswith("c"), (ok, backend)
    assert "prebuilt" in where
    assert not list(cache.rglob("*.so"))  # nothing was compiled at run time
    # without the prebuilt kernel and without a compiler: the numpy fallback, and why
    ok, backend, where, _ = _run(HOST_PROBE, installed, cache, {"TRAINTAPE_NO_PREBUILT": "1"})
    assert backend == "numpy" and "compiler" in where.lower(), (ok, backend, where)
    # a prebuilt kernel built from other sources (an editable install keeps the old build
    # after an edit) is not used: without a compiler, numpy, and the reason names it
    src = installed / "traintape" / "core" / "_fused_stats.c"
    text = src.read_text()
    src.write_text(text + "\n/* edited after the build */\n")
    try:
        ok, backend, where, _ = _run(HOST_PROBE, installed, cache)
    finally:
        src.write_text(text)
    assert backend == "numpy" and "other C sources" in where, (ok, backend, where)


JAX_PROBE = (
    "import json, sys\n"
    "import jax.numpy as jnp\n"
    "import traintape, traintape.jax as tj\n"
    "from traintape.adapters.jax import ffi_kernel\n"
    "from traintape.doctor import Diagnosis, _jax_ffi_kernel\n"
    "url = sys.argv[1]\n"
    "with traintape.Recorder(url) as rec:\n"
    "    vg = tj.value_and_grad(lambda p: jnp.sum(p['w'] ** 2), recorder=rec)\n"
    "    for _ in range(2):\n"
    "        vg({'w': jnp.arange(70000.0)})\n"
    "d = Diagnosis(); _jax_ffi_kernel(d)\n"
    "print(json.dumps(dict(backend=traintape.open_run(url).manifest.producer.stats_backend,\n"
    "    where=ffi_kernel.origin() or ffi_kernel.unavailable_reason(),\n"
    "    module=ffi_kernel.__file__, doctor=vars(d.checks[0]))))\n"
)


def _jax(target: Path, cache: Path, run: Path, env_extra: dict[str, str] | None = None) -> dict:
    return json.loads(_run(JAX_PROBE, target, cache, env_extra, str(run))[-1])


def test_installed_package_uses_its_prebuilt_jax_ffi_kernel(installed, tmp_path):
    jax = pytest.importorskip("jax")
    if not (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").exists():
        pytest.skip("this jaxlib ships no XLA FFI header: nothing to prebuild against")
    assert list((installed / "traintape" / "adapters" / "jax").glob("_ffi_prebuilt*.so"))
    cache = tmp_path / "cache"
    cache.mkdir()
    got = _jax(installed, cache, tmp_path / "run")
    assert got["module"].startswith(str(installed))
    # recorded in the store: the stats were computed by the FFI kernel, the prebuilt one
    assert got["backend"] == "jax-ffi-c", got
    assert got["where"].startswith("prebuilt at install") and "XLA FFI API" in got["where"], got
    assert got["doctor"]["ok"] and got["doctor"]["value"] == got["where"]  # doctor says so
    assert not list(cache.rglob("*.so"))  # nothing was compiled at run time
    # a stale prebuilt (built from other sources, as an editable install keeps after an
    # edit) is not used: without a compiler JAX falls back to XLA reductions, and says why
    src = installed / "traintape" / "adapters" / "jax" / "_ffi_kernel.c"
    text = src.read_text()
    src.write_text(text + "\n/* edited after the build */\n")
    try:
        got = _jax(installed, cache, tmp_path / "stale")
    finally:
        src.write_text(text)
    assert got["backend"] == "xla" and "stale" in got["where"], got
    assert "compiler" in got["where"] and not got["doctor"]["ok"], got
    assert got["doctor"]["detail"] == got["where"] and "unavailable" in got["doctor"]["value"]
    # and with the prebuilt kernel skipped, the same fallback
    got = _jax(installed, cache, tmp_path / "none", {"TRAINTAPE_NO_PREBUILT": "1"})
    assert got["backend"] == "xla" and "compiler" in got["where"], got
    assert not list(cache.rglob("*.so"))
