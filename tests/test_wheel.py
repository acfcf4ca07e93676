"""``python -m build`` makes an sdist and a wheel that carries the host C stat kernel; the
wheel, installed into a fresh virtual environment, computes statistics with that kernel
where no C compiler exists (issue 26 item 10). See docs/install.md, "A wheel".

The build is the ordinary isolated one (setuptools fetched into a throwaway environment,
as ``python -m build`` does for a user); the fresh environment takes traintape's
dependencies (numpy, tensorstore, ...) from this one through a ``.pth`` line, so nothing
is downloaded for them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("build")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return out


def test_build_makes_an_sdist_with_the_sources_and_a_platform_wheel_with_the_kernel(dist):
    (sdist,) = dist.glob("traintape-*.tar.gz")
    (wheel,) = dist.glob("traintape-*.whl")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "README.md", "traintape/core/_fused_stats.c",
            "traintape/adapters/jax/_ffi_kernel.c", "traintape/schema/manifest.schema.json"} <= names  # fmt: skip
    # a compiled library in it: the wheel is for this platform, not "none-any"
    assert not wheel.name.endswith("-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
    assert [
        f for f in files if f.startswith("traintape/core/_fused_prebuilt") and f.endswith(".so")
    ]
    assert "traintape/core/_fused_stats.c" in files  # the source its hash is checked against
    assert "traintape/schema/manifest.schema.json" in files


@pytest.fixture(scope="module")
def wheel_venv(dist, tmp_path_factory) -> tuple[Path, Path]:
    """A fresh venv with the wheel installed (no compiler on PATH while installing):
    its python and its site-packages."""
    (wheel,) = dist.glob("traintape-*.whl")
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)  # fmt: skip
    py = venv / "bin" / "python"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
         "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
             "PATH": "/nonexistent", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Successfully installed traintape" in r.stdout, r.stdout[-2000:]
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(py), "-c", where], capture_output=True, text=True,
                               check=True, env={}).stdout.strip())  # fmt: skip
    # the dependencies from this environment (after the venv's own site-packages)
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py, site


def test_the_wheel_in_a_fresh_venv_uses_its_kernel_without_a_compiler(wheel_venv, tmp_path):
    py, site = wheel_venv
    cache = tmp_path / "cache"
    cache.mkdir()
    probe = (
        "import json, numpy as np, traintape\n"
        "from traintape.core import native, stats\n"
        "with traintape.Recorder('run') as rec:\n"
        "    rec.record(0, 'grad', {'w': np.arange(70000, dtype=np.float32)})\n"
        "run = traintape.open_run('run')\n"
        "print(json.dumps(dict(module=traintape.__file__, ok=native.fused_available(),\n"
        "    backend=stats.backend(), where=native.origin() or native.unavailable_reason(),\n"
        "    recorded=run.manifest.producer.stats_backend,\n"
        "    l2=float(run.stats('grad')['l2'].iloc[0]))))\n"
    )
    env = {"PATH": "/nonexistent", "CC": "/nonexistent", "HOME": str(cache),
           "TRAINTAPE_CACHE_DIR": str(cache)}  # fmt: skip
    out = subprocess.run([str(py), "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["module"].startswith(str(site)), got  # the wheel's copy, not this checkout
    assert got["ok"] and got["backend"].startswith("c"), got
    assert "prebuilt" in got["where"], got
    assert got["recorded"].startswith("c"), got  # the run says which backend computed it
    want = float(sum(float(i) ** 2 for i in range(70000)) ** 0.5)
    assert got["l2"] == pytest.approx(want, rel=1e-6)
    assert not list(cache.rglob("*.so"))  # nothing was compiled at run time


def test_the_wheel_builds_its_jax_ffi_handler_at_first_use(wheel_venv, tmp_path):
    """A wheel made by ``python -m build`` (isolated: no jaxlib) carries no FFI handler;
    with a compiler, the first recorded JAX step compiles it against the installed
    jaxlib into the cache, and the run's statistics come from it (docs/install.md)."""
    jax = pytest.importorskip("jax")
    if not (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").exists():
        pytest.skip("this jaxlib ships no XLA FFI header")
    from test_native_prebuilt import JAX_PROBE

    py, site = wheel_venv
    assert not list((site / "traintape" / "adapters" / "jax").glob("_ffi_prebuilt*.so"))
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cache),
           "TRAINTAPE_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu"}  # fmt: skip
    out = subprocess.run([str(py), "-c", JAX_PROBE, str(tmp_path / "run")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["module"].startswith(str(site)), got
    if got["backend"] != "jax-ffi-c" and "compiler" in got["where"]:
        pytest.skip(f"no working C compiler here: {got['where']}")
    assert got["backend"] == "jax-ffi-c", got
    assert got["where"].startswith("compiled at run time"), got
    assert list(cache.rglob("*.so"))  # built once, into the cache
