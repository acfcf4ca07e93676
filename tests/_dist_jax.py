"""One process of a multi-process JAX training (run by tests/test_distributed_jax.py).

argv: process_id num_processes port url steps [kill_at]. Two CPU devices per process;
num_processes 1 runs the same training without jax.distributed on 4 local devices (the
single-process reference).
Parameters sharded over a ("data", "model") mesh of every process's devices; the global
batch split over "data". Same code on every process, same store URL, no rank checks.
"""

import os
import sys

pid, n, port, url, steps = sys.argv[1:6]
pid, n, steps = int(pid), int(n), int(steps)
kill_at = int(sys.argv[6]) if len(sys.argv) > 6 else -1
import jax  # noqa: E402

if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=pid,
        initialization_timeout=120,
    )  # fmt: skip
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import traintape  # noqa: E402
import traintape.jax as tj  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
devices = np.array(jax.devices())
assert len(devices) == 2 * n if n > 1 else len(devices) == 4, devices
mesh = jax.sharding.Mesh(devices.reshape(2, -1), ("data", "model"))
rng = np.random.default_rng(0)
host_params = {
    "l0": {"kernel": rng.normal(size=(16, 32)).astype(np.float32) * 0.3,
           "bias": np.zeros(32, np.float32)},
    "l1": {"kernel": rng.normal(size=(32, 8)).astype(np.float32) * 0.3,
           "bias": np.zeros(8, np.float32)},
    "gain": np.ones(3, np.float32),  # no axis the device count divides: to process 0 whole
}  # fmt: skip
spec = {"l0": {"kernel": P(None, "model"), "bias": P("model")},
        "l1": {"kernel": P("model", None), "bias": P()}, "gain": P()}  # fmt: skip


def put(a, s):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, s), lambda idx: a[idx])


params = jax.tree.map(put, host_params, spec)


def loss(p, x, y):
    h = jnp.tanh(x @ p["l0"]["kernel"] + p["l0"]["bias"])
    return jnp.mean((h @ p["l1"]["kernel"] + p["l1"]["bias"] - y) ** 2) * jnp.mean(p["gain"])


rec = traintape.Recorder(url, traintape.CapturePolicy(full_every=2), flush_every_steps=1)
assert rec.group.count == n and rec.group.index == pid, rec.group
vg = tj.value_and_grad(loss, recorder=rec)
tx = tj.watch(optax.adam(1e-2), rec)
opt = tx.init(params)


@jax.jit
def step(p, o, x, y):
    val, g = vg(p, x, y)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, val


for t in range(steps):
    x = np.random.default_rng(t + 1).normal(size=(24, 16)).astype(np.float32)
    xs, ys = put(x, P("data", None)), put(np.sin(x[:, :8]), P("data", None))
    params, opt, val = step(params, opt, xs, ys)
    rec.log(t, loss=float(val))
    if t == kill_at and pid == n - 1:
        rec.flush()
        os._exit(9)  # this process dies mid-run
    if t == kill_at:  # the survivors: an SPMD step cannot run without the dead process
        rec.flush()
        os._exit(0)
rec.close()
print(f"process {pid}: done, wrote {rec._writer.rows_committed} rows", flush=True)
