"""Per-step cost of capture at the limit: tiny to medium MLPs x torch / JAX / Keras.

Issue 27's instrument. For every (framework, model) pair the same training step runs
with and without traintape in interleaved rounds of one process (``_common.interleave``:
each round times ``steps`` steps of each variant, the starting variant rotates, and a
round keeps its median step). Printed per row:

- ``plain ms`` / ``capture ms``: median step time without / with capture (ms, the step
  made synchronous: torch returns ``float(loss)``, JAX blocks on the loss, Keras
  ``.numpy()``);
- ``over ms``: the *paired* overhead (per round, capture median - plain median; median
  over rounds) and its inter-quartile range;
- ``x``: the median per-round ratio capture / plain.

Capture is the default policy (stats every step of ``param``, ``grad``, ``update`` and
``activation``), a Recorder with default options (system metrics on, writer thread on)
on a file store in a temporary folder. Models (``--models``):

- ``tiny``:   MLP 64->128->10, batch 32 (2 layers, 4 parameter tensors);
- ``deep``:   MLP 64->128 x8->10, batch 32 (9 layers, 18 parameter tensors): the same
  width as ``tiny`` with more tensors, so ``(over(deep) - over(tiny)) / 14`` is the
  cost of one more parameter tensor (with its grad, update and its layer's activation);
- ``small``:  MLP 256->512->512->512->10, batch 64 (0.79M params);
- ``medium``: MLP 1024->2048->2048->10, batch 128 (6.3M params);
- ``large``:  MLP 2048->8192->8192->2048->10, batch 1024 (101M params; not in the
  default list): a step the *device* bounds on a GPU (the others are bound by Python's
  kernel launches there), so its steps in flight say whether capture serialises
  dispatch.

JAX only: **steps in flight**. A jitted step dispatches asynchronously; ``n`` steps are
dispatched in a loop without blocking (``dispatch``), then the last result is blocked
on (``total``). ``ahead = (total - dispatch) / (total / n)`` is how many steps were still
queued when the Python loop finished: close to ``n`` - 1 when dispatch runs far ahead of
the device, close to 0 when every step waits for the previous one (a host round trip in
the step's critical path serialises dispatch).

``--costs`` (torch, tiny model) measures where the fixed cost goes: training-thread CPU
time vs wall time per step (the difference is time the thread waited: GIL or OS), the
CPU time of the other threads per step, capture with the system sampler off, with the
writer paused (rows held in a list instead of reaching the writer thread), under
``sys.setswitchinterval`` 1 ms / 5 ms (default) / 50 ms, a cProfile of the captured
steps, and the system sampler's own CPU cost per sample.

Options: ``--quick`` (tiny + deep, 2 rounds: a smoke run), ``--frameworks torch,jax,keras``,
``--device cpu|cuda``, ``--rounds``, ``--threads``. The load average of the machine is
printed before and after (``os.getloadavg()``): on a shared machine the figures are only
as good as that load allows.

Run: ``PYTHONPATH=$PWD python benchmarks/step_overhead.py [--quick] [--costs]``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from _common import Timings, interleave, repeat

import traintape


@dataclass(frozen=True)
class Model:
    """An MLP configuration: layer widths and batch size."""

    name: str
    sizes: tuple[int, ...]
    batch: int
    steps: int  # steps per variant per round (more for fast steps)

    @property
    def tensors(self) -> int:
        """Parameter tensors (a kernel and a bias per layer)."""
        return 2 * (len(self.sizes) - 1)

    @property
    def params(self) -> int:
        return sum(a * b + b for a, b in itertools.pairwise(self.sizes))


MODELS: dict[str, Model] = {
    "tiny": Model("tiny", (64, 128, 10), 32, 30),
    "deep": Model("deep", (64, *([128] * 8), 10), 32, 20),
    "small": Model("small", (256, 512, 512, 512, 10), 64, 10),
    "medium": Model("medium", (1024, 2048, 2048, 10), 128, 3),
    "large": Model("large", (2048, 8192, 8192, 2048, 10), 1024, 3),
}


@dataclass
class Row:
    """One printed line: a framework x model pair."""

    framework: str
    model: Model
    plain: float
    capture: float
    over: tuple[float, float, float]
    ratio: float
    extra: str = ""


def loadavg() -> str:
    """``os.getloadavg()`` as text (1, 5, 15 min) with the core count."""
    a = os.getloadavg()
    return f"load average {a[0]:.2f} {a[1]:.2f} {a[2]:.2f} on {os.cpu_count()} cores"


def new_recorder(tmp: str, name: str, **kw: Any) -> traintape.Recorder:
    """A Recorder with default options on a fresh file store under ``tmp``."""
    return traintape.Recorder(os.path.join(tmp, name), **kw)


def measure(
    plain: Callable[[], Any], capture: Callable[[], Any], steps: int, rounds: int
) -> Timings:
    """Interleave ``plain`` and ``capture`` (each a zero-argument synchronous step)."""
    return interleave(
        {"plain": repeat("plain", plain, steps), "capture": repeat("capture", capture, steps)},
        rounds,
    )


def row_of(framework: str, m: Model, t: Timings, extra: str = "") -> Row:
    return Row(framework, m, t.median("plain"), t.median("capture"),
               t.delta("capture", "plain"), t.ratio("capture", "plain"), extra)  # fmt: skip


# --------------------------------------------------------------------------- torch


class TorchBench:
    """Plain vs ``traintape.torch.watch`` steps of a torch MLP with SGD."""

    def __init__(self, device: str, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device(device)

    def model(self, m: Model) -> tuple[Any, Any, Callable[[], Any]]:
        """(model, optimizer, step) where ``step()`` trains once and returns the loss
        tensor (not synchronised: ``float()`` of it waits for the device)."""
        torch = self.torch
        nn = torch.nn
        torch.manual_seed(0)
        layers: list[Any] = []
        for i, (a, b) in enumerate(itertools.pairwise(m.sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(m.sizes) - 2:
                layers.append(nn.ReLU())
        net = nn.Sequential(*layers).to(self.device)
        opt = torch.optim.SGD(net.parameters(), lr=1e-2)
        x = torch.randn(m.batch, m.sizes[0], device=self.device)
        y = torch.randint(0, m.sizes[-1], (m.batch,), device=self.device)
        loss_fn = nn.CrossEntropyLoss()

        def step() -> float:
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        return net, opt, step

    def run(
        self, m: Model, rounds: int, tmp: str, ahead_n: int = 0, **rec_kw: Any
    ) -> tuple[Timings, str]:
        """Interleaved plain/capture timings, and on CUDA the steps in flight."""
        import traintape.torch as tt

        net, opt, step_async = self.model(m)

        def step() -> float:
            return float(step_async())

        rec = new_recorder(tmp, f"torch-{m.name}-{len(os.listdir(tmp))}", **rec_kw)
        at = [0]

        def capture_variant(t: Timings) -> None:
            with tt.watch(net, rec, optimizer=opt, start_step=at[0]):
                for _ in range(m.steps):
                    t.timed("capture", step)
                    at[0] += 1

        step()
        t = interleave(
            {"plain": repeat("plain", step, m.steps), "capture": capture_variant}, rounds
        )
        extra = ""
        if ahead_n and self.device.type == "cuda":
            sync = self.torch.cuda.synchronize
            a_plain = steps_ahead(step_async, sync, ahead_n, rounds)
            with tt.watch(net, rec, optimizer=opt, start_step=at[0]):
                a_capt = steps_ahead(step_async, sync, ahead_n, rounds)
            extra = (f"dispatch {a_plain[0]:.3f}/{a_capt[0]:.3f} ms/step, ahead "
                     f"{a_plain[1]:.1f}/{a_capt[1]:.1f} of {ahead_n} (plain/capture)")  # fmt: skip
        rec.close()
        return t, extra


def steps_ahead(
    step: Callable[[], Any], sync: Callable[[], Any], n: int, rounds: int
) -> tuple[float, float]:
    """(dispatch ms per step, steps still queued when the dispatch loop ended) of ``n``
    calls of ``step()`` without waiting, then ``sync()``; medians over ``rounds`` tries."""
    disp, queued = [], []
    for _ in range(max(rounds, 3)):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        disp.append((t1 - t0) / n * 1e3)
        queued.append((t2 - t1) / ((t2 - t0) / n))
    return statistics.median(disp), statistics.median(queued)


# --------------------------------------------------------------------------- JAX


class JaxBench:
    """Plain vs captured jitted steps of a Flax NNX MLP (``nnx_value_and_grad`` +
    ``traintape.jax.watch(optax.sgd)``), state threaded functionally through ``jax.jit``
    (``nnx.split``/``nnx.merge`` inside the step), so dispatch is asynchronous."""

    def __init__(self, device: str) -> None:
        import jax

        if device == "cuda" and jax.default_backend() != "gpu":
            raise SystemExit(f"--device cuda: JAX's backend is {jax.default_backend()}")
        self.jax = jax

    def steps(self, m: Model, rec: traintape.Recorder | None) -> tuple[Callable, Any]:
        """(jitted step, initial state). ``step(state) -> (state, loss)``."""
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        import traintape.jax as tj

        class MLP(nnx.Module):
            def __init__(self, sizes: tuple[int, ...], rngs: nnx.Rngs) -> None:
                self.layers = nnx.List(
                    [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)]
                )

            def __call__(self, x: jax.Array) -> jax.Array:
                for layer in self.layers[:-1]:
                    x = nnx.relu(layer(x))
                return self.layers[-1](x)

        model = MLP(m.sizes, nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        x = jax.random.normal(jax.random.key(1), (m.batch, m.sizes[0]))
        y = jax.random.randint(jax.random.key(2), (m.batch,), 0, m.sizes[-1])

        def loss_fn(mod: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            logits = mod(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        sgd = optax.sgd(1e-2)
        if rec is None:
            vg, tx = nnx.value_and_grad(loss_fn), sgd
        else:
            vg, tx = tj.nnx_value_and_grad(loss_fn, recorder=rec), tj.watch(sgd, rec)

        @jax.jit
        def step(state: Any) -> Any:
            p, o = state
            loss, g = vg(nnx.merge(graphdef, p), x, y)
            u, o = tx.update(g, o, p)
            return (optax.apply_updates(p, u), o), loss

        state = (params, tx.init(params))
        del jnp
        return step, state

    def run(self, m: Model, rounds: int, tmp: str, ahead_n: int) -> tuple[Timings, str]:
        rec = new_recorder(tmp, f"jax-{m.name}")
        plain, sp = self.steps(m, None)
        capt, sc = self.steps(m, rec)
        box = {"plain": [plain, sp], "capture": [capt, sc]}

        def one(name: str) -> Callable[[], Any]:
            def go() -> Any:
                fn, st = box[name]
                st, loss = fn(st)
                box[name][1] = st
                return loss.block_until_ready()

            return go

        t = measure(one("plain"), one("capture"), m.steps, rounds)

        def dispatch(name: str) -> Callable[[], None]:
            def go() -> None:
                fn, st = box[name]
                box[name][1] = fn(st)[0]

            return go

        def sync(name: str) -> Callable[[], None]:
            return lambda: self.jax.block_until_ready(box[name][1])

        ah = (
            {k: steps_ahead(dispatch(k), sync(k), ahead_n, rounds) for k in box}
            if ahead_n
            else None
        )
        rec.close()
        if ah is None:
            return t, ""
        extra = (f"dispatch {ah['plain'][0]:.3f}/{ah['capture'][0]:.3f} ms/step, "
                 f"ahead {ah['plain'][1]:.1f}/{ah['capture'][1]:.1f} of {ahead_n} "
                 "(plain/capture)")  # fmt: skip
        return t, extra


# --------------------------------------------------------------------------- Keras


class KerasBench:
    """Plain ``tf.GradientTape`` vs ``traintape.tf.GradientTape`` in a ``tf.function``
    training step of a Keras MLP with SGD."""

    def __init__(self, device: str, threads: int) -> None:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        if device == "cuda" and not tf.config.list_physical_devices("GPU"):
            raise SystemExit("--device cuda: TensorFlow sees no GPU")
        self.tf = tf

    def run(self, m: Model, rounds: int, tmp: str) -> Timings:
        import keras

        import traintape.tf as ttf

        tf = self.tf
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((m.sizes[0],))]
            + [keras.layers.Dense(b, activation="relu", name=f"d{i}")
               for i, b in enumerate(m.sizes[1:-1])]
            + [keras.layers.Dense(m.sizes[-1], name="out")]
        )  # fmt: skip
        opt = keras.optimizers.SGD(1e-2)
        x = tf.random.normal([m.batch, m.sizes[0]])
        y = tf.random.uniform([m.batch], 0, m.sizes[-1], dtype=tf.int32)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        vs = model.trainable_variables
        rec = new_recorder(tmp, f"keras-{m.name}")
        step_var = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def plain() -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, vs), vs, strict=True))
            return loss

        @tf.function
        def capture() -> Any:
            with ttf.GradientTape(recorder=rec, model=model, step=step_var) as tape:
                loss = loss_fn(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, vs), vs, strict=True))
            step_var.assign_add(1)
            return loss

        plain(), capture()
        t = measure(lambda: plain().numpy(), lambda: capture().numpy(), m.steps, rounds)
        rec.close()
        return t


# --------------------------------------------------------------------------- costs


@contextlib.contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def torch_costs(tb: TorchBench, m: Model, rounds: int, tmp: str) -> None:
    """Where the torch fixed cost goes (see the module docstring)."""
    import traintape.torch as tt

    net, opt, step_async = tb.model(m)

    def step() -> float:
        return float(step_async())

    recs = {
        "capture": new_recorder(tmp, "c-default"),
        "no_sampler": new_recorder(tmp, "c-nosys", system_metrics=False),
        "writer_paused": new_recorder(tmp, "c-paused"),
        "switch_1ms": new_recorder(tmp, "c-sw1"),
        "switch_50ms": new_recorder(tmp, "c-sw50"),
    }
    held: list[Any] = []
    paused = recs["writer_paused"]
    real_put = paused._writer.put
    paused._writer.put = held.append  # rows never reach the writer thread
    at = dict.fromkeys(recs, 0)
    cpu: dict[str, list[tuple[float, float, float]]] = {}  # (wall, thread cpu, process cpu)

    def timed_step(t: Timings, name: str) -> None:
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        t.timed(name, step)
        cpu.setdefault(name, []).append(
            (time.perf_counter() - w0, time.thread_time() - c0, time.process_time() - p0)
        )

    def variant(name: str) -> Callable[[Timings], None]:
        interval = {"switch_1ms": 1e-3, "switch_50ms": 5e-2}.get(name)

        def run(t: Timings) -> None:
            if name == "plain":
                for _ in range(m.steps):
                    timed_step(t, name)
                return
            ctx = switch_interval(interval) if interval else contextlib.nullcontext()
            with ctx, tt.watch(net, recs[name], optimizer=opt, start_step=at[name]):
                for _ in range(m.steps):
                    timed_step(t, name)
                    at[name] += 1

        return run

    names = ["plain", *recs]
    step()
    t = interleave({n: variant(n) for n in names}, rounds)
    print(f"\n## torch fixed-cost analysis: {m.name} MLP {list(m.sizes)}, batch {m.batch}, "
          f"{rounds} rounds x {m.steps} steps ({loadavg()})")  # fmt: skip
    print(f"{'variant':15s} {'median ms':>9s} {'over ms [IQR]':>22s} {'thread cpu':>10s} "
          f"{'waited':>7s} {'other thr':>9s}  (ms/step; medians)")  # fmt: skip
    for n in names:
        d, lo, hi = t.delta(n, "plain")
        wall, thr, proc = (statistics.median(v) * 1e3 for v in zip(*cpu[n], strict=True))
        print(f"{n:15s} {t.median(n):9.3f} {d:8.3f} [{lo:6.3f},{hi:6.3f}] {thr:10.3f} "
              f"{max(wall - thr, 0):7.3f} {max(proc - thr, 0):9.3f}")  # fmt: skip
    paused._writer.put = real_put
    for item in held:
        real_put(item)
    for r in recs.values():
        r.close()

    # cProfile of captured steps: traintape's own functions vs the rest
    rec = new_recorder(tmp, "c-profile")
    n = 400 if m.steps >= 10 else 40
    prof = cProfile.Profile()
    with tt.watch(net, rec, optimizer=opt):
        for _ in range(20):
            step()
        w0 = time.perf_counter()
        prof.enable()
        for _ in range(n):
            step()
        prof.disable()
        wall = (time.perf_counter() - w0) / n * 1e3
    rec.close()
    st = pstats.Stats(prof)
    own = sum(v[2] for k, v in st.stats.items() if "traintape" in k[0]) / n * 1e3  # type: ignore[attr-defined]
    total = st.total_tt / n * 1e3  # type: ignore[attr-defined]
    print(f"\ncProfile over {n} captured steps (wall {wall:.3f} ms/step under the profiler): "
          f"profiled time {total:.3f} ms/step, in traintape's own functions (tottime) "
          f"{own:.3f} ms/step")  # fmt: skip
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    lines = buf.getvalue().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("ncalls")), 0)
    print("\n".join(lines[start : start + 19]))
    cum = sorted(
        ((v[3] / n * 1e3, f"{os.path.basename(k[0])}:{k[1]}({k[2]})")
         for k, v in st.stats.items() if "traintape" in k[0]),  # type: ignore[attr-defined]
        reverse=True,
    )  # fmt: skip
    print("\ntraintape functions by cumulative time (ms/step under the profiler):")
    for ms, where in cum[:14]:
        print(f"  {ms:7.3f}  {where}")
    sampler_cost()


def sampler_cost(samples: int = 200) -> None:
    """CPU time of one system-metrics sample and its share of a core at the default
    interval (1 s)."""
    from traintape.core.system import SystemSampler

    s = SystemSampler(interval=3600.0)  # its thread sleeps; we call _sample ourselves
    try:
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(samples):
            s._sample()
        cpu = (time.thread_time() - c0) / samples
        wall = (time.perf_counter() - w0) / samples
    finally:
        s.close()
    print(
        f"\nsystem sampler: {cpu * 1e3:.3f} ms CPU ({wall * 1e3:.3f} ms wall) per sample; "
        f"at the default 1 s interval {100 * cpu / 1.0:.3f}% of a core (target <= 1%)"
    )


# --------------------------------------------------------------------------- main


def print_rows(rows: list[Row]) -> None:
    print(f"\n{'framework':9s} {'model':7s} {'params':>8s} {'tensors':>7s} {'plain ms':>9s} "
          f"{'capture ms':>10s} {'over ms [IQR]':>24s} {'x':>6s}")  # fmt: skip
    for r in rows:
        d, lo, hi = r.over
        print(f"{r.framework:9s} {r.model.name:7s} {r.model.params:8d} {r.model.tensors:7d} "
              f"{r.plain:9.3f} {r.capture:10.3f} {d:8.3f} [{lo:6.3f},{hi:6.3f}] "
              f"{r.ratio:6.2f}" + (f"  {r.extra}" if r.extra else ""))  # fmt: skip
    by = {(r.framework, r.model.name): r for r in rows}
    for fw in dict.fromkeys(r.framework for r in rows):
        a, b = by.get((fw, "tiny")), by.get((fw, "deep"))
        if a and b:
            slope = (b.over[0] - a.over[0]) / (b.model.tensors - a.model.tensors) * 1e3
            print(f"{fw}: per additional parameter tensor (deep vs tiny, same width; with its "
                  f"grad, update and 1/2 layer activation) {slope:.1f} us/step; "
                  f"fixed (tiny overhead) {a.over[0]:.3f} ms/step")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny + deep, 2 rounds (smoke)")
    ap.add_argument("--frameworks", default="torch,jax,keras")
    ap.add_argument("--models", default=None, help="comma list of " + ",".join(MODELS))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (10)")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="x steps per round")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="framework intra-op threads (1: a tiny step gains nothing from more, and on a loaded machine loses much)",
    )
    ap.add_argument("--ahead", type=int, default=50,
                    help="steps dispatched without waiting, for 'steps in flight' (JAX; "
                    "torch on CUDA); 0: not measured")  # fmt: skip
    ap.add_argument("--costs", action="store_true", help="torch fixed-cost analysis")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 10)
    names = args.models or ("tiny,deep" if args.quick else "tiny,deep,small,medium")
    scale = args.steps_scale * (0.34 if args.quick else 1.0)
    models = [MODELS[n] for n in names.split(",")]
    models = [Model(m.name, m.sizes, m.batch, max(2, round(m.steps * scale))) for m in models]
    frameworks = [f for f in args.frameworks.split(",") if f]
    os.environ.setdefault("TRAINTAPE_FUSED_THREADS", str(args.threads))
    print(f"step_overhead: device {args.device}, {rounds} rounds, python "
          f"{sys.version.split()[0]}, {loadavg()}")  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="tt-step-")
    rows: list[Row] = []
    failed: list[str] = []
    for fw in frameworks:
        if fw not in ("torch", "jax", "keras"):
            raise SystemExit(f"--frameworks: unknown framework {fw!r} (torch, jax, keras)")
        try:
            rows.extend(run_framework(fw, args, models, rounds, tmp))
        except Exception as e:  # one framework failing (e.g. on a device) leaves the rest
            import traceback

            traceback.print_exc()
            print(f"  {fw} FAILED: {type(e).__name__}: {e}")
            failed.append(fw)
            continue
        print(f"  {fw} done ({loadavg()})", flush=True)
    if rows:
        print_rows(rows)
    print(f"\nafter: {loadavg()}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def run_framework(
    fw: str, args: argparse.Namespace, models: list[Model], rounds: int, tmp: str
) -> list[Row]:
    """The rows of one framework (``--costs``: torch's cost analysis, no rows)."""
    rows: list[Row] = []
    if fw == "torch":
        tb = TorchBench(args.device, args.threads)
        print(f"torch {tb.torch.__version__} on {tb.device}")
        if args.costs:
            torch_costs(tb, models[0], rounds, tmp)
            return rows
        for m in models:
            t, extra = tb.run(m, rounds, tmp, args.ahead)
            rows.append(row_of("torch", m, t, extra))
    elif fw == "jax":
        jb = JaxBench(args.device)
        print(f"jax {jb.jax.__version__} on {jb.jax.devices()[0]}")
        for m in models:
            t, extra = jb.run(m, rounds, tmp, args.ahead)
            rows.append(row_of("jax", m, t, extra))
    else:
        kb = KerasBench(args.device, args.threads)
        print(f"tensorflow {kb.tf.__version__}")
        for m in models:
            rows.append(row_of("keras", m, kb.run(m, rounds, tmp)))
    return rows


if __name__ == "__main__":
    main()
