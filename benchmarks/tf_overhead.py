"""Overhead of traintape.tf.GradientTape stats inside tf.function, >= 10M-param MLP (CPU).

Step variants, each one ``tf.function`` train step (forward, gradient, Adam) on the same
model and batch, interleaved in rounds (``benchmarks/_common.py``: rotating round-robin,
per-round medians, paired deltas against the baseline of the same round):

- ``baseline``: ``tf.GradientTape``;
- ``floor``: baseline step + one plain ``reduce_sum`` over every variable and gradient
  in the same graph (one memory pass: the floor for stats capture);
- ``traintape``: ``traintape.tf.GradientTape`` recording ``param`` + ``grad`` stat
  vectors every step (default CPU path: the tensors cross to the host zero-copy through
  one ``tf.numpy_function`` and the fused C kernel computes every stat in one pass);
- ``traintape_graph``: the same with the stats computed by TF ops in the graph (the
  adapter's non-CPU path), to show which is faster;
- ``tf_summary``: baseline step + ``tf.summary.histogram`` of every variable and
  gradient every step, in the same graph (what TensorBoard users write by hand).

Then the stat computation and the floor **in isolation**, on the same tensors (the
variables and gradients of one step), interleaved the same way with the CPU caches
flushed before each call (as in a step, the ~100 MB arrive cold) — robust where the
in-step deltas drown in the noise of a shared CPU:

- ``sum_pass``: ``tf.function`` of ``add_n(reduce_sum(t))`` (the floor);
- ``tt_host``: ``tf.function`` of the adapter's host crossing — one
  ``tf.numpy_function`` running the fused kernel (:func:`host_raw_matrices`);
- ``fused_numpy``: the fused kernel alone on zero-copy numpy views (no TF);
- ``np_sum``: a numpy sum pass over those views (the host's own floor);
- ``tt_graph``: ``tf.function`` of :func:`traintape.adapters.tf.stats.raw_matrix` (TF-op graph).

And, inside the ``traintape`` steps themselves, the wall time of the host stat call
(``host_raw_matrices``, wrapped with a timer by this script): the stats' cost in situ,
free of the step-to-step noise.

Prints ms/step medians, overhead / floor and overhead as % of step (in-step, in situ
and isolated), and the tf.summary ratio.

``--keras-jax``: instead, Keras 3 on the JAX backend (``KERAS_BACKEND=jax``, set by this
script before Keras is imported), the same MLP and batch, Adam, ``jit_compile`` on:

- ``keras``: Keras's own train step, jitted exactly as ``fit`` jits it
  (``jax.jit(model.train_step, donate_argnums=0)`` over the explicit state);
- ``keras_traintape``: a second model with the same weights and
  ``traintape.keras.Callback`` installed (``on_train_begin``: its hooks in the train
  step, stats computed inside the jitted step), jitted the same way, with the
  callback's ``on_train_batch_begin``/``on_train_batch_end`` called as ``fit`` calls them
  (the default policy: param, grad, update, activation stats every step; the batch's
  ``logs`` logged).

Both block on the step's loss each step; interleaved in rounds as above. Prints the
ratio keras_traintape / keras (target <= 1.2x).

Usage: python benchmarks/tf_overhead.py [--batch 512] [--rounds 12] [--steps 3]
[--kernel-reps 5] [--threads 2] [--quick] [--keras-jax]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "--keras-jax" in sys.argv:  # Keras picks its backend when first imported
    os.environ["KERAS_BACKEND"] = "jax"

import numpy as np
from _common import (
    add_common_args,
    apply_quick,
    interleave,
    overhead_line,
    print_table,
    repeat,
    time_kernels,
)

import traintape

if "--keras-jax" not in sys.argv:  # the Keras-on-JAX comparison needs no TensorFlow
    import tensorflow as tf

    import traintape.tf as ttf
    from traintape.adapters.tf import capture as tf_capture
    from traintape.adapters.tf import stats as tf_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, rounds=12, steps=3)
    ap.add_argument("--kernel-reps", type=int, default=5, help="isolated calls per round")
    ap.add_argument(
        "--keras-jax", action="store_true", help="Keras 3 on JAX: fit's step vs callback"
    )
    args = ap.parse_args()
    sizes = apply_quick(args)
    if args.keras_jax:
        keras_jax(args, sizes)
        return
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    os.environ.setdefault("TRAINTAPE_FUSED_THREADS", str(args.threads))
    import keras

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
    host_ok = tf_stats.host_stats_enabled()
    print(f"model: Keras MLP {sizes}, {n_params / 1e6:.2f}M params, batch {args.batch}, "
          f"{args.threads} threads, tensorflow {tf.__version__}, traintape stats on "
          f"{'the host (fused C kernel)' if host_ok else 'the TF graph'}")  # fmt: skip

    def grads_of(tape_cls: Any, **kw: Any) -> tuple[tf.Tensor, list[tf.Tensor]]:
        with tape_cls(**kw) as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, vs)

    @tf.function
    def baseline() -> tf.Tensor:
        loss, g = grads_of(tf.GradientTape)
        opt.apply_gradients(zip(g, vs, strict=True))
        return loss

    @tf.function
    def floor() -> tf.Tensor:
        loss, g = grads_of(tf.GradientTape)
        s = tf.add_n([tf.reduce_sum(t) for t in [*vs, *g]])
        opt.apply_gradients(zip(g, vs, strict=True))
        return loss + 0.0 * s

    tmp = tempfile.mkdtemp(prefix="tt-tf-bench-")
    writer = tf.summary.create_file_writer(os.path.join(tmp, "tb"))
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def tf_summary() -> tf.Tensor:
        loss, g = grads_of(tf.GradientTape)
        with writer.as_default(step=counter):
            for v, gv in zip(vs, g, strict=True):
                tf.summary.histogram(v.path, v)
                tf.summary.histogram(v.path + "/grad", gv)
        counter.assign_add(1)
        opt.apply_gradients(zip(g, vs, strict=True))
        return loss

    policy = traintape.CapturePolicy(every=1, kinds=("param", "grad"))

    def tt_step(name: str, host: bool) -> tuple[traintape.Recorder, Any]:
        rec = traintape.Recorder(f"memory://tf-bench-{name}", policy, flush_every_steps=10_000)
        step = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def fn() -> tf.Tensor:
            loss, g = grads_of(ttf.GradientTape, recorder=rec, model=model, step=step)
            opt.apply_gradients(zip(g, vs, strict=True))
            step.assign_add(1)
            return loss

        tf_stats._HOST = host  # the mode is fixed when the function is traced
        fn()
        return rec, fn

    in_situ: list[float] = []  # wall time of each host stat call inside the steps
    host_stats = tf_capture.host_raw_matrices

    def timed_host_stats(groups: Any) -> Any:
        t0 = time.perf_counter()
        out = host_stats(groups)
        in_situ.append(time.perf_counter() - t0)
        return out

    tf_capture.host_raw_matrices = timed_host_stats
    rec_h, tt_host = tt_step("host", host_ok)
    rec_g, tt_graph = tt_step("graph", False)
    tf_stats._HOST = None
    steps = {"baseline": baseline, "floor": floor, "traintape": tt_host,
             "traintape_graph": tt_graph, "tf_summary": tf_summary}  # fmt: skip
    for fn in steps.values():
        fn()  # trace + warm up
    in_situ.clear()
    t = interleave(
        {k: repeat(k, lambda fn=fn: fn().numpy(), args.steps) for k, fn in steps.items()},
        args.rounds,
    )
    rec_h.close()
    rec_g.close()
    tf_capture.host_raw_matrices = host_stats

    # ---- isolated: the stat computation vs the floor, on the same tensors
    grads = tf.function(lambda: grads_of(tf.GradientTape)[1])()
    tensors = [tf.convert_to_tensor(v) for v in vs] + list(grads)
    views = [np.asarray(a) for a in tensors]  # zero-copy
    sum_pass = tf.function(lambda ts: tf.add_n([tf.reduce_sum(a) for a in ts]))

    def host_fn(*arrays: np.ndarray) -> np.ndarray:
        return tf_stats.host_raw_matrices([arrays])[0]

    tt_host_iso = tf.function(lambda ts: tf.numpy_function(host_fn, ts, tf.float64, stateful=True))
    tt_graph_iso = tf.function(tf_stats.raw_matrix)
    kernels = {
        "sum_pass": lambda: sum_pass(tensors).numpy(),
        "tt_host": lambda: tt_host_iso(tensors).numpy(),
        "fused_numpy": lambda: tf_stats.host_raw_matrices([views]),
        "np_sum": lambda: sum(float(a.sum()) for a in views),
        "tt_graph": lambda: tt_graph_iso(tensors).numpy(),
    }
    k = time_kernels(kernels, args.rounds, args.kernel_reps)

    # ---- report
    base = t.median("baseline")
    print_table(t, "baseline")
    fl = t.delta("floor", "baseline")[0]
    print(f"\nin-step floor (one reduce_sum pass over vars+grads, {2 * n_params / 1e6:.1f}M "
          f"elements, in the step graph): {fl:.2f} ms")  # fmt: skip
    for name, label in (("traintape", "host fused kernel" if host_ok else "graph"),
                        ("traintape_graph", "TF-op graph")):  # fmt: skip
        print(overhead_line(f"{name} ({label}) stats every step, in-step",
                            t.delta(name, "baseline")[0], fl, base))  # fmt: skip
    ks = k.medians()
    if in_situ:
        situ = statistics.median(in_situ) * 1e3
        print(overhead_line(f"traintape host stat call timed inside the steps ({len(in_situ)} "
                            "calls; floor = isolated sum pass)", situ, ks["sum_pass"], base))  # fmt: skip
    print(f"\nisolated, cold caches, on the same {len(tensors)} tensors ({2 * n_params / 1e6:.1f}M "
          f"elements), median ms: " + ", ".join(f"{n} {v:.2f}" for n, v in ks.items()))  # fmt: skip
    for name, label in (("tt_host", "numpy_function + fused kernel, the adapter's CPU path"),
                        ("fused_numpy", "fused kernel alone"),
                        ("tt_graph", "TF-op stat graph")):  # fmt: skip
        print(overhead_line(f"{name} ({label})", ks[name], ks["sum_pass"], base)
              + f"; {k.ratio(name, 'sum_pass'):.2f}x paired")  # fmt: skip
    print(f"host floor: numpy sum pass {ks['np_sum']:.2f} ms "
          f"(fused kernel = {ks['fused_numpy'] / ks['np_sum']:.2f}x it)")  # fmt: skip
    over_tt = t.delta("traintape", "baseline")[0]
    over_sum = t.delta("tf_summary", "baseline")[0]
    rel = f", {over_sum / over_tt:.0f}x traintape's" if over_tt > 0 else ""
    print(f"\ntf.summary.histogram every var+grad: step {t.ratio('tf_summary', 'baseline'):.2f}x "
          f"baseline ({over_sum:.1f} ms overhead{rel})")  # fmt: skip


def keras_jax(args: argparse.Namespace, sizes: list[int]) -> None:
    """The ``--keras-jax`` comparison (module docstring)."""
    import jax
    import keras

    import traintape.keras as ttk

    assert keras.backend.backend() == "jax", keras.backend.backend()

    def build() -> Any:
        keras.utils.set_random_seed(0)
        m = keras.Sequential(
            [keras.Input((sizes[0],))]
            + [keras.layers.Dense(b, activation="relu", name=f"d{i}")
               for i, b in enumerate(sizes[1:-1])]
            + [keras.layers.Dense(sizes[-1], name="out")]
        )  # fmt: skip
        m.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
        m.optimizer.build(m.trainable_variables)
        return m

    r = np.random.default_rng(0)
    x = jax.numpy.asarray(r.normal(size=(args.batch, sizes[0])).astype("float32"))
    y = jax.numpy.asarray(r.integers(0, sizes[-1], size=(args.batch,)).astype("int32"))
    plain, recorded = build(), build()
    recorded.set_weights(plain.get_weights())
    n_params = int(sum(np.prod(v.shape) for v in plain.trainable_variables))
    rec = traintape.Recorder("memory://keras-jax-bench", flush_every_steps=10_000)
    cb = ttk.Callback(rec)
    cb.set_model(recorded)
    cb.on_train_begin()
    assert recorded.jit_compile, "jit_compile must stay on"

    def state_of(m: Any) -> Any:
        return m._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                optimizer_variables=True, metrics_variables=True)  # fmt: skip

    f_plain = jax.jit(plain.train_step, donate_argnums=0)
    f_rec = jax.jit(recorded.train_step, donate_argnums=0)
    states = {"keras": state_of(plain), "keras_traintape": state_of(recorded)}
    batch = [0]

    def run_plain() -> None:
        logs, states["keras"] = f_plain(states["keras"], (x, y))
        jax.block_until_ready(logs["loss"])

    def run_rec() -> None:
        cb.on_train_batch_begin(batch[0])
        logs, states["keras_traintape"] = f_rec(states["keras_traintape"], (x, y))
        jax.block_until_ready(logs["loss"])
        cb.on_train_batch_end(batch[0], logs)
        batch[0] += 1

    print(f"model: Keras MLP {sizes}, {n_params / 1e6:.2f}M params, batch {args.batch}, "
          f"keras {keras.__version__} / jax {jax.__version__} ({jax.default_backend()}), "
          f"jit on, traintape stats: {rec.manifest.producer.stats_backend}")  # fmt: skip
    for fn in (run_plain, run_rec):
        fn()  # trace + compile
    t = interleave({"keras": repeat("keras", run_plain, args.steps),
                    "keras_traintape": repeat("keras_traintape", run_rec, args.steps)},
                   args.rounds)  # fmt: skip
    rec.close()
    print_table(t, "keras")
    d, lo, hi = t.delta("keras_traintape", "keras")
    print(f"\nKeras on JAX, callback vs none: {t.ratio('keras_traintape', 'keras'):.3f}x "
          f"(paired delta {d:.2f} ms [{lo:.2f}, {hi:.2f}]; target <= 1.2x); "
          f"{len(rec.manifest.tensors)} tensors recorded per step")  # fmt: skip


if __name__ == "__main__":
    main()
