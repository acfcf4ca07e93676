"""``traintape demo``: train a small Flax model on a synthetic task and record it.

Task: classify 2-D points of two interleaved spirals (3 classes) with a Flax Linen MLP
(Dense → LayerNorm → Dense → Dense), Adam, batch 128, on CPU. Records param/grad/update/
activation stats every step and full tensors every ``full_every`` steps into ``out``.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class DemoResult:
    """What the demo did: store location, steps, tensors recorded, losses."""

    out: str
    steps: int
    tensors: int
    first_loss: float
    final_loss: float
    final_accuracy: float
    seconds: float
    events: list[str]
    """The recorder's events (first NaN/Inf, notes)."""
    anomalies: str
    """:meth:`traintape.analysis.AnomalyReport.summary` of the run — the line
    ``traintape anomalies`` prints first."""


def _spirals(n: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    k = rng.integers(0, 3, n)
    r = rng.uniform(0.05, 1.0, n)
    t = 4.0 * r + k * (2 * math.pi / 3) + rng.normal(0, 0.15, n)
    x = np.stack([r * np.cos(t), r * np.sin(t)], 1).astype(np.float32)
    return x, k.astype(np.int32)


def run_demo(
    out: str = "runs/demo",
    steps: int = 300,
    *,
    full_every: int = 100,
    batch: int = 128,
    seed: int = 0,
    progress: bool = True,
    overwrite: bool = True,
) -> DemoResult:
    """Train and record the demo run into ``out`` (a local directory, replaced if it is a
    traintape store and ``overwrite``). Returns a :class:`DemoResult`."""
    import flax.linen as nn
    import jax
    import numpy as np
    import optax
    from rich.progress import Progress

    import traintape
    import traintape.jax as tj

    path = Path(out)
    if path.exists() and overwrite and (path / "zarr.json").exists():
        shutil.rmtree(path)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.gelu(nn.Dense(64, name="input")(x), approximate=False)
            x = nn.LayerNorm(name="norm")(x)
            for i in range(2):
                x = nn.gelu(nn.Dense(64, name=f"layers_{i}")(x), approximate=False)
            return nn.Dense(3, name="head")(x)

    model = MLP()
    xs, ys = _spirals(batch * 64, seed)
    params = model.init(jax.random.key(seed), xs[:1])
    rec = traintape.Recorder(out, traintape.CapturePolicy(full_every=full_every))

    def loss_fn(p, x, y):
        logits = model.apply(p, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, (logits.argmax(-1) == y).mean()

    vg = tj.value_and_grad(loss_fn, has_aux=True, recorder=rec)
    tx = tj.watch(optax.adam(3e-3), rec)
    opt = tx.init(params)

    @jax.jit
    def step(p, o, x, y):
        (loss, acc), g = vg(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss, acc

    rng = np.random.default_rng(seed + 1)
    t0 = time.perf_counter()
    losses: list[float] = []
    acc = 0.0
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("training (demo)", total=steps)
        for t in range(steps):
            idx = rng.integers(0, len(xs), batch)
            params, opt, loss, acc_a = step(params, opt, xs[idx], ys[idx])
            loss_v, acc = float(loss), float(acc_a)
            losses.append(loss_v)
            rec.log(t, loss=loss_v, accuracy=acc)
            bar.update(task, advance=1, description=f"training (demo) loss {loss_v:.3f}")
    rec.close()
    seconds = time.perf_counter() - t0
    run = traintape.open_run(out)
    m = run.manifest
    return DemoResult(
        out=str(out),
        steps=int(run.rows),
        tensors=len(m.tensors),
        first_loss=losses[0],
        final_loss=losses[-1],
        final_accuracy=acc,
        seconds=seconds,
        events=[f"step {e.step}: {e.message}" for e in m.events],
        anomalies=_anomalies(run).summary(),
    )


def _anomalies(run: Any) -> Any:
    from traintape.analysis import anomalies

    return anomalies(run)


def summary(result: DemoResult) -> str:
    """A short human summary of the demo run with the next commands to try."""
    lines = [
        f"recorded {result.steps} steps, {result.tensors} tensor specs into {result.out} "
        f"in {result.seconds:.1f} s",
        f"loss {result.first_loss:.4g} -> {result.final_loss:.4g}, "
        f"final batch accuracy {result.final_accuracy:.2f}",
        f"anomalies: {result.anomalies}",
        "next:",
        f"  traintape show {result.out}",
        f"  traintape anomalies {result.out}",
        f"  traintape validate {result.out}",
    ]
    return "\n".join(lines)
