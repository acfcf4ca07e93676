"""Multi-process capture: per-process stats overhead and snapshot write throughput.

Runs itself as 2 processes (torch ``gloo`` on 127.0.0.1, one thread each) holding an MLP
sharded with FSDP2 (``fully_shard``; parameters, gradients are DTensors). In each process,
interleaved in rounds (``_common.py``; both processes run the same schedule, so the
collectives line up):

(a) stats, per process, caches flushed before each call, then a barrier (untimed: the
    processes start each call together, as after a training step's own collectives —
    else the merge's wait for the other process would time its cache flush):
    - ``floor``: one plain ``sum`` pass over the local shards of params + grads;
    - ``stats_local``: the adapter's raw rows of those shards (``stats.raw_stats``);
    - ``stats_merged``: the same plus the exact merge over processes
      (``core.group.merge_over``: one all_gather of the raw rows) — what
      ``traintape.torch.watch`` does per captured step under FSDP2;
    - ``merge`` (for reference): the merge alone, of rows computed before.
    Target: the same ≤ 2x floor as single-process capture.
(b) full-snapshot write throughput, aggregate over the 2 processes, each step durable:
    - ``raw``: every process writes its local shards with ``numpy.tofile`` + fsync to
      new files (the aggregate disk bandwidth of 2 writers that keep what they write,
      as the store keeps every snapshot; as in ``store_throughput.py``);
    - ``raw_overwrite`` (for reference): the same into the same files every step,
      overwritten in place — cheaper on ext4 than creating files (about 2x here), but
      it keeps only the last step;
    - ``traintape``: the snapshot step as the adapter does it — every process copies the
      block it holds (``dist.snapshot_part``), ``Recorder.record_raw`` with those blocks,
      ``flush()`` (each process writes its blocks; process 0 commits once the other has
      confirmed its own). Both variants end with a barrier: the time is the job's.
    Target: ≥ 0.8x raw.

``--jax``: the same questions under ``jax.distributed`` (2 processes x 2 CPU devices, the
MLP's kernels tensor-parallel over "model" and replicated over "data", a jitted step with
``traintape.jax.value_and_grad``): (a) the step, the step plus a plain sum pass over the
parameters inside it (the floor), the step with traintape's param stats every step — the
target is stats ≤ 2x the floor's cost; (b) the full-capture step (every process writes
the slabs its devices hold) minus the stats step, both flushed and ending with a barrier,
vs 2 raw writers of the same bytes (each process half of every tensor, new files).

Usage: python benchmarks/distributed_overhead.py [--rounds 8] [--reps 3] [--quick] [--jax]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

SIZES = [1024, 2048, 2048, 1024, 10]
QUICK = [64, 128, 10]


def child(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    import itertools

    import numpy as np
    import torch
    import torch.distributed as dist
    from _common import Timings, flush_caches, interleave, repeat
    from torch import nn

    import traintape
    from traintape.adapters.torch import stats as S
    from traintape.adapters.torch.dist import counts_here, local, snapshot_part
    from traintape.core.group import merge_over

    torch.set_num_threads(1)
    os.environ["TRAINTAPE_FUSED_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sizes = QUICK if args.quick else SIZES
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(64, sizes[0])
    model(x).square().mean().backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    shards = [local(t) for t in params + grads]
    here = np.array([counts_here(t, rank) for t in params + grads])
    n_global = sum(p.numel() for p in params)
    from traintape.core.group import detect

    group = detect()
    assert group.count == world

    def floor() -> float:
        with torch.no_grad():
            return sum(float(t.sum()) for t in shards)

    def stats_local() -> None:
        S.to_host(S.raw_stats(shards))

    def stats_merged() -> None:
        merge_over(group, S.to_host(S.raw_stats(shards)), here)

    rows = S.to_host(S.raw_stats(shards))

    def merge() -> None:  # the merge alone, on rows computed before
        merge_over(group, rows, here)

    def cold() -> None:  # untimed: caches flushed, then both processes start together
        flush_caches()
        dist.barrier()

    kernels = {"floor": floor, "stats_local": stats_local, "stats_merged": stats_merged,
               "merge": merge}  # fmt: skip
    k = interleave({n: repeat(n, f, args.reps, cold) for n, f in kernels.items()}, args.rounds)

    # (b) snapshot throughput
    d = os.path.join(out_dir, f"rank{rank}")
    os.makedirs(d, exist_ok=True)
    names = [f"p{i}" for i in range(len(params))]
    url = os.path.join(out_dir, "store")
    pol = traintape.CapturePolicy(full_every=1, kinds=("param",), snapshot_kinds=("param",))
    rec = traintape.Recorder(url, pol)
    rec.declare([
        traintape.TensorSpec.build(n, "param", dtype="float32", shape=list(p.shape))
        for n, p in zip(names, params, strict=True)
    ])  # fmt: skip
    step = [0]
    raw_rows = S.to_host(S.raw_stats([local(p) for p in params]))

    def traintape_step() -> None:
        snaps = {n: snapshot_part(p, None, rank) for n, p in zip(names, params, strict=True)}
        rec.record_raw(step[0], "param", raw_rows, names=names, snapshots=snaps)
        step[0] += 1
        rec.log(step[0], tick=1.0)  # seals the step: it is committed by flush()
        rec.flush()
        dist.barrier()

    raw_steps = itertools.count()

    def raw_write(name: str) -> None:
        for i, p in enumerate(params):
            with open(os.path.join(d, f"{name}_{i}.bin"), "wb") as f:
                local(p).detach().numpy().tofile(f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier()

    traintape_step()  # creates the snapshot arrays: setup, not throughput
    w = interleave({
        "raw": repeat("raw", lambda: raw_write(f"raw{next(raw_steps)}"), 1),
        "raw_overwrite": repeat("raw_overwrite", lambda: raw_write("over"), 1),
        "traintape": repeat("traintape", traintape_step, 1),
    }, args.rounds, Timings())  # fmt: skip
    rec.close()
    if rank == 0:
        fl, lo, me = k.median("floor"), k.median("stats_local"), k.median("stats_merged")
        print(f"FSDP2 MLP {sizes}: {n_global / 1e6:.2f}M params, {world} processes, 1 thread each")
        print(f"(a) per process (its shards, {sum(s.numel() for s in shards) / 1e6:.2f}M "
              f"elements): floor {fl:.2f} ms, stats {lo:.2f} ms ({lo / fl:.2f}x floor), "
              f"stats + merge over processes {me:.2f} ms ({me / fl:.2f}x floor; "
              f"{k.ratio('stats_merged', 'floor'):.2f}x paired) — target <= 2x; the merge "
              f"alone {k.median('merge'):.2f} ms")  # fmt: skip
        nbytes = 4 * n_global
        r, o, t = w.median("raw"), w.median("raw_overwrite"), w.median("traintape")
        mib = nbytes / 2**20
        print(f"(b) full snapshot of {mib:.1f} MiB per step, durable: raw 2 writers "
              f"{mib / (r / 1e3):.0f} MiB/s ({r:.1f} ms), traintape {mib / (t / 1e3):.0f} "
              f"MiB/s ({t:.1f} ms): {r / t:.2f}x raw ({1 / w.ratio('traintape', 'raw'):.2f}x "
              f"paired; target >= 0.8x); raw overwriting its files in place {o:.1f} ms: "
              f"{o / t:.2f}x")  # fmt: skip
    dist.destroy_process_group()


def child_jax(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    """(b) for JAX: 2 processes x 2 CPU devices, kernels tensor-parallel over "model" and
    replicated over "data"; each snapshot tensor is written by the processes holding it
    (traintape.adapters.jax.blocks)."""
    import itertools

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world,
                               process_id=rank, initialization_timeout=120)  # fmt: skip
    import jax.numpy as jnp
    import numpy as np
    from _common import Timings, interleave, repeat
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import traintape
    import traintape.jax as tj

    sizes = QUICK if args.quick else SIZES
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    rng = np.random.default_rng(0)
    pairs = list(itertools.pairwise(sizes))
    host = {f"l{i}": (rng.normal(size=ab) * 0.01).astype(np.float32) for i, ab in enumerate(pairs)}
    specs = {k: P(None, "model") if i % 2 == 0 else P("model", None) for i, k in enumerate(host)}

    def put(a: np.ndarray, s: P) -> jax.Array:
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, s), lambda i: a[i])

    params = {k: put(a, specs[k]) for k, a in host.items()}
    xh = np.random.default_rng(1).normal(size=(64, sizes[0])).astype(np.float32)
    x = put(xh, P("data", None))

    def loss(p: dict, x: jax.Array) -> jax.Array:
        h = x
        for k in host:
            h = jnp.tanh(h @ p[k])
        return jnp.mean(h**2)

    url = os.path.join(out_dir, "store_jax")
    pol = traintape.CapturePolicy(full_every=1, kinds=("param",), snapshot_kinds=("param",))
    rec = traintape.Recorder(url, pol)
    plain = jax.jit(jax.value_and_grad(loss))
    # the floor: the step plus one plain sum pass over the parameters, inside the step
    summed = jax.jit(
        lambda p, x: (jax.value_and_grad(loss)(p, x), [jnp.sum(v) for v in p.values()])
    )
    traced = jax.jit(tj.value_and_grad(loss, recorder=rec))
    rec_stats = traintape.Recorder(url + "_stats", traintape.CapturePolicy(kinds=("param",)))
    stats_only = jax.jit(tj.value_and_grad(loss, recorder=rec_stats))

    def barrier() -> None:
        multihost_utils.sync_global_devices("traintape-bench")

    def compute() -> None:
        jax.block_until_ready(plain(params, x))
        barrier()

    def floor_step() -> None:
        jax.block_until_ready(summed(params, x))
        barrier()

    def traintape_step() -> None:
        jax.block_until_ready(traced(params, x))
        rec.flush()
        barrier()

    def stats_step(flush: bool = False) -> None:
        jax.block_until_ready(stats_only(params, x))
        if flush:
            rec_stats.flush()
        barrier()

    # raw: each process writes half of every tensor's bytes (2 writers, same bytes)
    d = os.path.join(out_dir, f"jax{rank}")
    os.makedirs(d, exist_ok=True)
    halves = [np.ascontiguousarray(np.array_split(a, world)[rank]) for a in host.values()]
    raw_steps = itertools.count()

    def raw_write() -> None:
        name = f"raw{next(raw_steps)}"
        for i, a in enumerate(halves):
            with open(os.path.join(d, f"{name}_{i}.bin"), "wb") as f:
                a.tofile(f)
                f.flush()
                os.fsync(f.fileno())
        barrier()

    traintape_step()  # traces, creates the arrays: setup, not throughput
    stats_step()
    w = interleave({
        "compute": repeat("compute", compute, 1),
        "floor": repeat("floor", floor_step, 1),
        "stats": repeat("stats", stats_step, 1),
        "stats_flush": repeat("stats_flush", lambda: stats_step(True), 1),
        "raw": repeat("raw", raw_write, 1),
        "traintape": repeat("traintape", traintape_step, 1),
    }, args.rounds, Timings())  # fmt: skip
    rec.close()
    rec_stats.close()
    if rank == 0:
        mib = sum(a.nbytes for a in host.values()) / 2**20
        c, st = w.median("compute"), w.median("stats")
        r, t, sf = w.median("raw"), w.median("traintape"), w.median("stats_flush")
        snap = max(t - sf, 1e-9)
        print(f"JAX MLP {sizes}, {world} processes x 2 CPU devices, tensor-parallel kernels")
        df, ds = w.delta("floor", "compute")[0], w.delta("stats", "compute")[0]  # paired
        print(f"(a) step {c:.1f} ms; + a sum pass over the params (floor) +{df:.1f} ms; "
              f"+ traintape's param stats +{ds:.1f} ms ({st / c:.2f}x the step; "
              f"{ds / max(df, 1e-9):.2f}x the floor's cost; paired deltas)")  # fmt: skip
        print(f"(b) full snapshot of {mib:.1f} MiB per step, durable: raw 2 writers "
              f"{mib / (r / 1e3):.0f} MiB/s ({r:.1f} ms); full-capture step {t:.1f} ms - "
              f"stats step {sf:.1f} ms (both flushed) = {snap:.1f} ms for the snapshot "
              f"({mib / (snap / 1e3):.0f} MiB/s): {r / snap:.2f}x raw (target >= 0.8x)")  # fmt: skip
    jax.distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jax", action="store_true",
                    help="(b) for JAX under jax.distributed instead of torch FSDP2")  # fmt: skip
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.reps = 2, 1
    if args.child:
        rank, port, out_dir = args.child
        (child_jax if args.jax else child)(int(rank), 2, int(port), args, out_dir)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as out_dir:
        extra = ["--quick"] if args.quick else ["--rounds", str(args.rounds), "--reps",
                                                 str(args.reps)]  # fmt: skip
        env = dict(os.environ)
        if args.jax:
            extra.append("--jax")
            env.update(JAX_PLATFORMS="cpu",
                       XLA_FLAGS="--xla_force_host_platform_device_count=2")  # fmt: skip
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, __file__, *extra, "--child", str(r),
                                   str(port), out_dir], env=env) for r in range(2)]  # fmt: skip
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        print(f"({time.perf_counter() - t0:.0f} s)")
        sys.exit(max(codes))


if __name__ == "__main__":
    main()
