"""``traintape doctor`` and ``Producer.stats_backend``: which backend computed a run's
statistics is visible, in the store and on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

import traintape

CLI = [sys.executable, "-c", "from traintape.cli import main; main()"]


def _doctor(*args: str, env: dict[str, str] | None = None) -> list[dict]:
    out = subprocess.run([*CLI, "doctor", "--json", *args], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_doctor_reports_frameworks_backends_and_drivers():
    checks = {c["name"]: c for c in _doctor()}
    assert {"traintape", "C compiler", "host stats kernel", "jax", "torch", "tensorstore"} <= set(
        checks
    )
    assert "stats backend" in checks["torch"]["value"]
    assert "stats backend" in checks["jax"]["value"]
    assert "s3" in checks["tensorstore"]["value"] and "file" in checks["tensorstore"]["value"]


def test_doctor_says_why_without_the_kernel():
    env = {**os.environ, "TRAINTAPE_NO_FUSED": "1"}
    checks = {c["name"]: c for c in _doctor("--quick", env=env)}
    host = checks["host stats kernel"]
    assert host["value"] == "numpy" and not host["ok"]
    assert "TRAINTAPE_NO_FUSED" in host["detail"]


def test_adapters_record_their_stats_backend(tmp_path):
    import torch

    import traintape.torch as tt

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    url = str(tmp_path / "torch")
    with traintape.Recorder(url) as rec, tt.watch(model, rec, optimizer=opt):
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    assert traintape.open_run(url).manifest.producer.stats_backend in ("c-openmp", "c")

    import jax.numpy as jnp

    import traintape.jax as tj

    url = str(tmp_path / "jax")
    with traintape.Recorder(url) as rec:
        vg = tj.value_and_grad(lambda p: jnp.sum(p["w"] ** 2), recorder=rec)
        vg({"w": jnp.ones(3)})
    assert traintape.open_run(url).manifest.producer.stats_backend in ("jax-ffi-c", "xla")


def test_torch_without_the_kernel_records_torch(tmp_path):
    code = (
        "import torch, traintape, traintape.torch as tt\n"
        "m = torch.nn.Linear(3, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        f"rec = traintape.Recorder({str(tmp_path / 'r')!r})\n"
        "h = tt.watch(m, rec, optimizer=o)\n"
        "m(torch.ones(4, 3)).sum().backward(); o.step(); h.remove(); rec.close()\n"
        f"print(traintape.open_run({str(tmp_path / 'r')!r}).manifest.producer.stats_backend)\n"
    )
    env = {**os.environ, "TRAINTAPE_NO_FUSED": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "torch"


def test_show_prints_the_backend(tmp_path):
    url = str(tmp_path / "plain")
    with traintape.Recorder(url) as rec:
        rec.record(0, "param", {"w": np.ones(3)})
    env = {**os.environ, "COLUMNS": "300"}
    out = subprocess.run([*CLI, "show", url], capture_output=True, text=True, timeout=120,
                         env=env)  # fmt: skip
    from traintape.core.stats import backend

    assert out.returncode == 0 and f"stats backend {backend()}" in out.stdout, out.stdout
