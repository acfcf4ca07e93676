"""Overhead of traintape.jax capture on a >= 10M-parameter MLP (CPU).

Variants, interleaved round-robin in one process (same model, same batches):

- ``baseline``: jitted step (value_and_grad + Adam) without capture;
- ``stats``: traintape.jax.value_and_grad + watch, stat vectors every step;
- ``full100``: as ``stats`` plus full snapshots every 100 steps; ``full1``: full
  snapshots every step (fewer steps per round), to price one full step: amortised cost
  of full-every-100 = full100's extra + (full1 − stats) / 100;
- ``floor``: baseline step + one plain sum over the same tensors (params, grads,
  updates) inside the same jit — one memory pass, the floor for stats capture;
- ``naive``: baseline step + ``jax.device_get`` of all grads + ``np.save`` every step
  (what a user writes by hand).

Prints medians (ms/step), overhead vs baseline, overhead / floor and the naive ratio,
plus the floor and the stat matrix timed in isolation on the same tensors (the in-step
deltas are noisy on a shared machine; the isolated ratio is the robust one).
Usage: python benchmarks/jax_overhead.py [--batch 512] [--rounds 8] [--steps 10]
(``TRAINTAPE_JAX_STATS=xla`` measures the XLA-reduction stat matrix instead of the
default CPU path, the fused C kernel as an XLA custom call; the isolated lines time
both, each inside its own jit.)
"""

from __future__ import annotations

import argparse
import io
import itertools
import resource
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import traintape
import traintape.jax as tj
from traintape.adapters.jax import ffi_kernel
from traintape.adapters.jax.stats import stats_mode


def mlp_params(key: jax.Array, sizes: list[int]) -> dict:
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        key, k = jax.random.split(key)
        params[f"layers_{i}"] = {
            "kernel": jax.random.normal(k, (a, b)) / np.sqrt(a),
            "bias": jnp.zeros(b),
        }
    return params


def loss_fn(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    n = len(p)
    for i in range(n):
        x = x @ p[f"layers_{i}"]["kernel"] + p[f"layers_{i}"]["bias"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - y) ** 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--depth", type=int, default=5, help="hidden layers")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    args = ap.parse_args()

    sizes = [512] + [args.width] * args.depth + [512]
    params0 = mlp_params(jax.random.key(0), sizes)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params0))
    x = jax.random.normal(jax.random.key(1), (args.batch, sizes[0]))
    y = jax.random.normal(jax.random.key(2), (args.batch, sizes[-1]))
    print(f"MLP {sizes}: {n_params / 1e6:.1f}M params, batch {args.batch}, "
          f"devices {jax.devices()}, stats computed on: {stats_mode()}")  # fmt: skip

    adam = optax.adam(1e-4)
    tmp = tempfile.mkdtemp(prefix="tt-bench-")

    def plain_step(extra=None):
        @jax.jit
        def step(p, o, x, y):
            loss, g = jax.value_and_grad(loss_fn)(p, x, y)
            u, o = adam.update(g, o, p)
            new = optax.apply_updates(p, u)
            s = extra(p, g, u) if extra else jnp.float32(0)
            return new, o, loss, s, g

        return step

    def floor_sum(p, g, u):
        return sum(jnp.sum(a) for t in (p, g, u) for a in jax.tree_util.tree_leaves(t))

    def traced_step(rec: traintape.Recorder):
        vg = tj.value_and_grad(loss_fn, recorder=rec)
        tx = tj.watch(adam, rec)

        @jax.jit
        def step(p, o, x, y):
            loss, g = vg(p, x, y)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o, loss, jnp.float32(0), g

        return step, tx

    rec_stats = traintape.Recorder(
        f"{tmp}/stats", traintape.CapturePolicy(kinds=("param", "grad", "update"))
    )
    rec_full = traintape.Recorder(
        f"{tmp}/full", traintape.CapturePolicy(kinds=("param", "grad", "update"), full_every=100)
    )
    rec_full1 = traintape.Recorder(
        f"{tmp}/full1", traintape.CapturePolicy(kinds=("param", "grad", "update"), full_every=1)
    )
    s_stats, tx_s = traced_step(rec_stats)
    s_full, tx_f = traced_step(rec_full)
    s_full1, tx_f1 = traced_step(rec_full1)
    variants = {
        "baseline": (plain_step(), adam.init(params0)),
        "floor": (plain_step(floor_sum), adam.init(params0)),
        "stats": (s_stats, tx_s.init(params0)),
        "full100": (s_full, tx_f.init(params0)),
        "full1": (s_full1, tx_f1.init(params0)),  # every step a full step (fewer steps)
        "naive": (plain_step(), adam.init(params0)),
    }
    state = {k: [params0, v[1]] for k, v in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    faults: dict[str, list[int]] = {k: [] for k in variants}  # minor page faults per step

    def run(name: str, n: int, record: bool) -> None:
        step, _ = variants[name]
        p, o = state[name]
        for _ in range(n):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            p, o, loss, s, g = step(p, o, x, y)
            if name == "naive":
                host = jax.device_get(g)
                buf = io.BytesIO()
                for leaf in jax.tree_util.tree_leaves(host):
                    np.save(buf, leaf)
            jax.block_until_ready((p, loss, s))
            if record:
                times[name].append(time.perf_counter() - t0)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        state[name] = [p, o]

    for name in variants:  # compile + warm up
        run(name, 2, record=False)
    for _ in range(args.rounds):
        for name in variants:
            run(name, max(1, args.steps // 5) if name == "full1" else args.steps, record=True)
    for r in (rec_stats, rec_full, rec_full1):
        r.close()

    # isolated kernels on the same tensors (robust against step-time noise): the floor
    # (one plain sum pass) vs traintape's fused stat matrix, interleaved
    p_, o_ = state["baseline"]
    _, _, _, _, g_ = variants["baseline"][0](p_, o_, x, y)
    u_ = jax.tree_util.tree_map(lambda a: a * 1e-3, g_)
    tensors = [a for t in (p_, g_, u_) for a in jax.tree_util.tree_leaves(t)]
    kernels = {
        "sum_pass": jax.jit(lambda ts: sum(jnp.sum(a) for a in ts)),
        "stat_matrix": jax.jit(tj.raw_matrix),
    }
    if ffi_kernel.available():
        kernels["ffi_kernel"] = jax.jit(ffi_kernel.raw_rows)
    ktimes: dict[str, list[float]] = {k: [] for k in kernels}
    for f in kernels.values():
        jax.block_until_ready(f(tensors))
    for _ in range(args.rounds * args.steps):
        for k, f in kernels.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(tensors))
            ktimes[k].append(time.perf_counter() - t0)
    kmed = {k: statistics.median(v) * 1e3 for k, v in ktimes.items()}

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    base = med["baseline"]
    floor = med["floor"] - base
    print(f"{'variant':10s} {'median ms':>10s} {'vs baseline':>12s} {'page faults/step':>17s}")
    for k, v in med.items():
        print(f"{k:10s} {v:10.2f} {v / base:12.3f}x {statistics.median(faults[k]):17.0f}")
    stats_over = med["stats"] - base
    print(f"floor (one sum pass over params+grads+updates): {floor:.2f} ms")
    ratio = f"{stats_over / floor:.2f}x floor" if floor > 0 else "floor below noise"
    print(f"stats overhead: {stats_over:.2f} ms = {100 * stats_over / base:.1f}% of step, {ratio}")
    print(f"isolated on the same {len(tensors)} tensors: sum pass {kmed['sum_pass']:.2f} ms, "
          f"stat matrix {kmed['stat_matrix']:.2f} ms = "
          f"{kmed['stat_matrix'] / kmed['sum_pass']:.2f}x the floor (XLA reductions)")  # fmt: skip
    if "ffi_kernel" in kmed:
        print(f"  fused C kernel as an XLA custom call: {kmed['ffi_kernel']:.2f} ms = "
              f"{kmed['ffi_kernel'] / kmed['sum_pass']:.2f}x the floor")  # fmt: skip
    # full every 100, amortised: full100's median (its steps are stats steps plus the
    # device-side full-step test) + 1/100 of what a full step adds over a stats step
    # (full1: every step full, 132 MB written per step); robust, unlike a mean over
    # the one full step a short run holds
    full_extra = med["full1"] - med["stats"]
    amort = med["full100"] - base + full_extra / 100
    print(f"full step (all params, grads, updates written): +{full_extra:.1f} ms over a "
          f"stats step; full every 100 amortised: +{amort:.2f} ms = "
          f"+{100 * amort / base:.1f}% of step")  # fmt: skip
    naive_over = med["naive"] - base
    vs = f" = {naive_over / stats_over:.1f}x traintape's" if stats_over > 0 else ""
    print(f"naive device_get+np.save every step: {med['naive']:.2f} ms, "
          f"+{naive_over:.2f} ms vs baseline{vs} (traintape stats: +{stats_over:.2f} ms; "
          f"the grads in full, into memory, no stats)")  # fmt: skip


if __name__ == "__main__":
    main()
