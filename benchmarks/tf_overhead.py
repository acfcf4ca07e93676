"""Overhead of traintape.tf.GradientTape stats inside tf.function, >= 10M-param MLP (CPU).

Variants, each one ``tf.function`` train step (forward, gradient, Adam), interleaved
round-robin in one process (same model, same batch, medians):

- ``baseline``: ``tf.GradientTape``;
- ``traintape``: ``traintape.tf.GradientTape`` recording ``param`` + ``grad`` stat
  vectors every step (default: on CPU the tensors go to the host through the one
  ``tf.numpy_function`` and the fused C kernel computes the stats);
- ``traintape_graph``: the same with the stats computed by TF ops in the graph
  (the adapter's non-CPU path), to show which is faster;
- ``floor``: baseline step + one plain ``reduce_sum`` over every variable and gradient
  in the same graph (one memory pass: the floor for stats capture);
- ``tf_summary``: baseline step + ``tf.summary.histogram`` of every variable and
  gradient every step, in the same graph (what TensorBoard users write by hand).

Prints ms/step medians, overhead / floor and overhead as % of step, and peer ratios.
Usage: python benchmarks/tf_overhead.py [--batch 512] [--rounds 5] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

import traintape
import traintape.tf as ttf
from traintape.adapters.tf import stats as tf_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = ap.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    os.environ.setdefault("TRAINTAPE_FUSED_THREADS", str(args.threads))
    import keras

    sizes = [1024, 2048, 2048, 2048, 1024, 10]
    if args.quick:
        sizes, args.batch, args.rounds, args.steps = [64, 128, 10], 32, 2, 2
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((sizes[0],))]
        + [
            keras.layers.Dense(b, activation="relu", name=f"d{i}")
            for i, b in enumerate(sizes[1:-1])
        ]
        + [keras.layers.Dense(sizes[-1], name="out")]
    )
    n_params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    opt = keras.optimizers.Adam(1e-4)
    x = tf.random.normal([args.batch, sizes[0]])
    y = tf.random.uniform([args.batch], 0, sizes[-1], dtype=tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    vs = model.trainable_variables
    print(f"model: Keras MLP {sizes}, {n_params / 1e6:.2f}M params, batch {args.batch}, "
          f"{args.threads} threads, tensorflow {tf.__version__}")  # fmt: skip

    def grads_of(tape_cls, **kw):
        with tape_cls(**kw) as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, vs)

    @tf.function
    def baseline():
        loss, g = grads_of(tf.GradientTape)
        opt.apply_gradients(zip(g, vs, strict=True))
        return loss

    @tf.function
    def floor():
        loss, g = grads_of(tf.GradientTape)
        s = tf.add_n([tf.reduce_sum(t) for t in [*vs, *g]])
        opt.apply_gradients(zip(g, vs, strict=True))
        return loss + 0.0 * s

    tmp = tempfile.mkdtemp(prefix="tt-tf-bench-")
    writer = tf.summary.create_file_writer(os.path.join(tmp, "tb"))
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def tf_summary():
        loss, g = grads_of(tf.GradientTape)
        with writer.as_default(step=counter):
            for v, gv in zip(vs, g, strict=True):
                tf.summary.histogram(v.path, v)
                tf.summary.histogram(v.path + "/grad", gv)
        counter.assign_add(1)
        opt.apply_gradients(zip(g, vs, strict=True))
        return loss

    policy = traintape.CapturePolicy(every=1, kinds=("param", "grad"))

    def tt_step(name: str, host: bool):
        rec = traintape.Recorder(f"memory://tf-bench-{name}", policy, flush_every_steps=10_000)
        step = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def fn():
            loss, g = grads_of(ttf.GradientTape, recorder=rec, model=model, step=step)
            opt.apply_gradients(zip(g, vs, strict=True))
            step.assign_add(1)
            return loss

        tf_stats._HOST = host  # the mode is fixed when the function is traced
        fn()
        return rec, fn

    host_ok = tf_stats.host_stats_enabled()
    rec_h, tt_host = tt_step("host", host_ok)
    rec_g, tt_graph = tt_step("graph", False)
    tf_stats._HOST = None
    variants = {"baseline": baseline, "floor": floor, "traintape": tt_host,
                "traintape_graph": tt_graph, "tf_summary": tf_summary}  # fmt: skip
    for fn in variants.values():
        fn()  # trace + warm up
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, fn in variants.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fn().numpy()
                times[k].append(time.perf_counter() - t0)
    rec_h.close()
    rec_g.close()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    base = med["baseline"]
    fl = max(med["floor"] - base, 1e-9)
    print("\nmedian ms/step:", ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    print(f"floor (one reduce_sum pass over vars+grads, {2 * n_params / 1e6:.1f}M elements, "
          f"in the step graph): {fl:.2f} ms")  # fmt: skip
    for k, label in (("traintape", "host fused kernel" if host_ok else "graph"),
                     ("traintape_graph", "TF-op graph")):  # fmt: skip
        over = med[k] - base
        print(f"{k} ({label}) stats every step: overhead {over:.2f} ms = {over / fl:.2f}x floor, "
              f"{100 * over / base:.2f}% of step (target <= 2x, <= 5%)")  # fmt: skip
    over = med["tf_summary"] - base
    print(f"tf.summary.histogram every var+grad: step {med['tf_summary'] / base:.2f}x baseline "
          f"({over:.1f} ms overhead)")  # fmt: skip


if __name__ == "__main__":
    main()
