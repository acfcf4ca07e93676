"""Sharded parameters over 8 simulated CPU devices record the same store as one device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

import traintape
from traintape import Kind, open_run

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import traintape, traintape.jax as tj

    jax.config.update("jax_default_matmul_precision", "highest")
    url, sharded = sys.argv[1], sys.argv[2] == "1"
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"l0": {"kernel": jax.random.normal(k1, (16, 32)) * 0.3, "bias": jnp.zeros(32)},
              "l1": {"kernel": jax.random.normal(k2, (32, 8)) * 0.3, "bias": jnp.zeros(8)}}
    if sharded:
        assert len(jax.devices()) == 8
        mesh = jax.sharding.Mesh(jax.devices(), ("d",))
        spec = {"l0": {"kernel": P(None, "d"), "bias": P("d")},
                "l1": {"kernel": P("d", None), "bias": P()}}
        params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, spec)
        assert len(params["l0"]["kernel"].sharding.device_set) == 8
    def loss(p, x, y):
        h = jnp.tanh(x @ p["l0"]["kernel"] + p["l0"]["bias"])
        return jnp.mean((h @ p["l1"]["kernel"] + p["l1"]["bias"] - y) ** 2)
    rec = traintape.Recorder(url, traintape.CapturePolicy(full_every=2))
    vg = tj.value_and_grad(loss, recorder=rec)
    tx = tj.watch(optax.adam(1e-2), rec)
    opt = tx.init(params)
    @jax.jit
    def step(p, o, x, y):
        l, g = vg(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o
    for t in range(4):
        x = jax.random.normal(jax.random.key(t + 1), (24, 16))
        params, opt = step(params, opt, x, jnp.sin(x[:, :8]))
    rec.close()
    """
)


def _run(url: str, sharded: bool) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8" if sharded else ""
    env["JAX_PLATFORMS"] = "cpu"
    subprocess.run(
        [sys.executable, "-c", SCRIPT, url, "1" if sharded else "0"],
        env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip


def test_sharded_run_equals_single_device_run(tmp_path) -> None:
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    _run(one, sharded=False)
    _run(many, sharded=True)
    a, b = open_run(one), open_run(many)
    assert traintape.validate(many).ok
    assert list(a.steps) == list(b.steps) == [0, 1, 2, 3]
    for kind in (Kind.PARAM, Kind.GRAD, Kind.UPDATE):
        assert a.tensor_names(kind) == b.tensor_names(kind)
        np.testing.assert_allclose(a.stats_array(kind), b.stats_array(kind), rtol=1e-4, atol=1e-6)
        for step in (0, 2):
            for name in a.tensor_names(kind):
                np.testing.assert_allclose(
                    a.snapshot(name, kind, step), b.snapshot(name, kind, step), rtol=1e-4, atol=1e-6
                )
