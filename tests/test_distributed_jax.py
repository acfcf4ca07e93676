"""Multi-process JAX (``jax.distributed`` on 127.0.0.1, gloo CPU collectives, 2 devices
per process, parameters sharded over a ("data", "model") mesh): every process runs the
same code with the same store URL; the one store equals the single-process store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _procs import free_port, run_all

import traintape
from traintape import Kind, open_run
from traintape.analysis import compare

SCRIPT = str(Path(__file__).with_name("_dist_jax.py"))
STEPS = 4


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return env


def _job(n: int, url: str, *extra: str) -> list[subprocess.CompletedProcess]:
    """Run ``n`` processes (one coordinator port) to the end; leftovers are killed."""
    port = str(free_port())
    cmds = [[sys.executable, SCRIPT, str(i), str(n), port, url, str(STEPS), *extra]
            for i in range(n)]  # fmt: skip
    return run_all(cmds, env=_env(2))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("ref") / "one")
    subprocess.run(
        [sys.executable, SCRIPT, "0", "1", "0", url, str(STEPS)],
        env=_env(4), check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    return url


def _single_process_grad_norms() -> dict[str, float]:
    """``jax.grad`` of the same loss at step 0, on one device, no traintape."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    p = {
        "l0": {"kernel": rng.normal(size=(16, 32)).astype(np.float32) * 0.3,
               "bias": np.zeros(32, np.float32)},
        "l1": {"kernel": rng.normal(size=(32, 8)).astype(np.float32) * 0.3,
               "bias": np.zeros(8, np.float32)},
        "gain": np.ones(3, np.float32),
    }  # fmt: skip
    x = np.random.default_rng(1).normal(size=(24, 16)).astype(np.float32)
    y = np.sin(x[:, :8])

    def loss(p):
        h = jnp.tanh(x @ p["l0"]["kernel"] + p["l0"]["bias"])
        return jnp.mean((h @ p["l1"]["kernel"] + p["l1"]["bias"] - y) ** 2) * jnp.mean(p["gain"])

    with jax.default_matmul_precision("highest"):
        g = jax.grad(loss)(p)
    flat = jax.tree_util.tree_flatten_with_path(g)[0]
    return {"/".join(k.key for k in path): float(np.linalg.norm(np.asarray(v))) for path, v in flat}


@pytest.mark.parametrize("n", [2, 4])
def test_every_process_same_url_one_store_equal_to_single_process(tmp_path, reference, n):
    url = str(tmp_path / "multi")
    results = _job(n, url)
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}"
    # process 0 wrote every row; the others wrote nothing of their own
    assert "process 0: done, wrote 4 rows" in results[0].stdout
    assert all(f"process {i}: done, wrote 0 rows" in results[i].stdout for i in range(1, n))
    assert traintape.validate(url).ok
    run, ref = open_run(url), open_run(reference)
    assert list(run.steps) == list(range(STEPS))
    for kind in (Kind.PARAM, Kind.GRAD, Kind.UPDATE):
        assert run.tensor_names(kind) == ref.tensor_names(kind)
        np.testing.assert_allclose(
            run.stats_array(kind), ref.stats_array(kind), rtol=1e-5, atol=1e-7
        )
        for name in run.tensor_names(kind):  # snapshots: the global arrays, every shard
            for step in (0, 2):
                np.testing.assert_allclose(
                    run.snapshot(name, kind, step), ref.snapshot(name, kind, step),
                    rtol=1e-5, atol=1e-7,
                )  # fmt: skip
    assert compare(url, reference, strict=True).identical
    # snapshots were written by the processes holding the data: each tensor with an axis
    # the 2n devices divide is spread over them and every process wrote its own block
    # (the array is sharded by it, process i's shard at block index i) and confirmed it
    for kind in (Kind.PARAM, Kind.GRAD, Kind.UPDATE):
        for i in range(n):
            done = json.loads((Path(url) / ".traintape/progress" / f"{i}.json").read_text())
            assert done["snapshots"][kind.value] == 2, (i, done)
        meta = json.loads((Path(url) / f"snapshots/{kind.value}/l0/kernel/zarr.json").read_text())
        shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
        assert shard == [1, 16 // n, 32], shard  # 16 rows over n processes
        for i in range(n):
            assert (Path(url) / f"snapshots/{kind.value}/l0/kernel/c/0/{i}/0").is_file()
        gain = json.loads((Path(url) / f"snapshots/{kind.value}/gain/zarr.json").read_text())
        assert gain["chunk_grid"]["configuration"]["chunk_shape"] == [1, 3]  # process 0's
    # the global gradient norm is jax.grad's on one device, not a shard's
    l2 = run.stats_array(Kind.GRAD)[0, :, run.manifest.stat_names.index("l2")]
    want = _single_process_grad_norms()
    for name, v in zip(run.tensor_names(Kind.GRAD), l2, strict=True):
        assert v == pytest.approx(want[name], rel=1e-5), name


def test_a_process_killed_mid_run_leaves_a_valid_store(tmp_path):
    url = str(tmp_path / "killed")
    results = _job(2, url, "2")  # the last process dies at step 2, after a flush
    assert results[1].returncode == 9
    rep = traintape.validate(url)
    assert rep.ok, rep
    run = open_run(url)
    # flush() commits the sealed steps 0 and 1 (step 2 was still open): both are there
    assert list(run.steps) == [0, 1]
    assert np.isfinite(run.stats_array(Kind.GRAD)).all()
    assert run.manifest.status == "open"  # not closed: the job never finished


def test_processes_without_a_job_cannot_share_a_store(tmp_path):
    """Two independent processes (no jax.distributed) on one URL: the claim refuses the
    second loudly; the first is untouched."""
    url = str(tmp_path / "s")
    first = traintape.Recorder(url)
    try:
        code = f"import traintape; traintape.Recorder({url!r})"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode != 0 and "writer" in r.stderr.lower(), r.stderr[-2000:]
    finally:
        first.close()
    assert traintape.validate(url).ok
