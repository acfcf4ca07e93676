"""The kind-semantics case: every adapter records the same ``grad`` and ``update``.

docs/store-format.md defines ``grad`` as the gradient before clipping (what
``jax.grad`` returns and ``clip_grad_norm_`` reports as its total norm) and ``update`` as
θ_{t+1} − θ_t *as applied* in the parameter's dtype (0 where the optimizer's change is
below half an ulp of θ). This case trains the conformance MLP (:data:`spec.MLP`, its
canonical initial weights) where both definitions matter:

- global-norm clipping at :data:`MAX_NORM`, active at every step (the gradient norms are
  far above it): torch ``AdamW`` + ``clip_grad_norm_`` ⇔ ``optax.chain(
  clip_by_global_norm, adamw)`` (Flax Linen ``value_and_grad``, Flax NNX
  ``nnx_value_and_grad`` + ``nnx.Optimizer``, both with ``traintape.jax.watch``);
- updates below half an ulp: the learning rate :data:`LR` (1.1e-8) is below half an ulp
  of the larger weights (|θ| ≥ 0.25: ulp/2 ≥ 1.5e-8) and above it for the smaller ones;
  Adam moves an element by ≈ lr (less where |g| ≲ ε), so at every step part of every
  kernel keeps its value — its recorded ``update`` must be exactly 0 there, while
  optax's ``u`` is not — and the rest changes.

Each store must record exactly that (:func:`check_store`: ``update`` snapshots equal
θ_{t+1} − θ_t from the ``param`` snapshots bit for bit, zero exactly where θ did not
change, ``zero_frac`` the fraction that did not, both kinds of element present; the
recorded grad norm is pre-clip),
and every pair of stores must compare identical under :func:`conformance.matrix.check_pair`
(strict, the Adam tolerances of float32). The JAX runs log ``grad/clip_factor`` as torch's
adapter does (optax's factor ``max_norm / ‖g‖``; torch's ``max_norm / (‖g‖ + 1e-6)``).

``python -m conformance.semantics [--out DIR]`` runs it alone; ``python -m conformance``
runs it after the matrix (``--no-semantics`` skips it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from conformance import spec as S

CONFIG = "float32+adamw-clip"
"""The matrix label of this case (its tolerances: ``tolerances_for('float32+adam')``)."""
MODEL = "mlp"
FRAMEWORKS = ("torch", "jax-linen", "jax-nnx")
STEPS = 6
LR = 3.0 * 2.0**-28
"""≈ 1.1e-8: below half an ulp of |θ| ≥ 0.25 (2**-26 ≈ 1.5e-8), above it for |θ| < 0.125."""
WEIGHT_DECAY = 2.0**-10
MAX_NORM = 2.0**-4
"""Below every step's gradient norm: clipping is active at every step."""


def weights() -> dict[str, np.ndarray]:
    """The MLP's canonical initial weights (:func:`conformance.spec.initial_weights`)."""
    return S.initial_weights(MODEL, "float32")


def _recorder(url: str) -> Any:
    import traintape

    kinds = ("param", "grad", "update", "activation", "opt_state")
    policy = traintape.CapturePolicy(
        every=1, full_every=1, kinds=kinds, snapshot_kinds=("param", "grad", "update", "opt_state")
    )
    return traintape.Recorder(
        url, policy=policy, strict=True, user={"forward_order": S.FORWARD_ORDER[MODEL]}
    )


def train_torch(url: str) -> None:
    """torch: ``AdamW`` + ``clip_grad_norm_`` under ``traintape.torch.watch``."""
    import torch
    import torch.nn.functional as F

    import traintape.torch as ttt
    from conformance.models_torch import BUILDERS

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")
    model = BUILDERS[MODEL]().float()
    ttt.from_canonical(model, weights(), strict=True)
    x, y = S.batches(MODEL, "float32")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(S.ADAM_B1, S.ADAM_B2),
                            eps=S.ADAM_EPS, weight_decay=WEIGHT_DECAY)  # fmt: skip
    with _recorder(url) as rec, ttt.watch(model, rec, optimizer=opt):
        for t in range(STEPS):
            opt.zero_grad()
            loss = F.mse_loss(model(torch.from_numpy(x[t])), torch.from_numpy(y[t]))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            rec.log(t, {"train/loss": float(loss)})


def _tx() -> Any:
    import optax

    return optax.chain(
        optax.clip_by_global_norm(MAX_NORM),
        optax.adamw(LR, b1=S.ADAM_B1, b2=S.ADAM_B2, eps=S.ADAM_EPS, weight_decay=WEIGHT_DECAY),
    )


def _clip_factor(g: Any) -> Any:
    """optax.clip_by_global_norm's factor: 1 below ``MAX_NORM``, else MAX_NORM / ‖g‖."""
    import jax.numpy as jnp
    import optax

    n = optax.tree.norm(g)
    return jnp.where(n < MAX_NORM, 1.0, MAX_NORM / n)


def train_linen(url: str) -> None:
    """Flax Linen: ``traintape.jax.value_and_grad`` + ``watch(optax.chain(clip, adamw))``."""
    from conformance.models_jax import _jax, _mse, linen_model, linen_variables

    jax = _jax("float32")
    import optax

    import traintape.jax as ttj

    model = linen_model(MODEL, "float32")
    params = linen_variables(weights())["params"]
    x, y = S.batches(MODEL, "float32")
    with _recorder(url) as rec:
        tx = ttj.watch(_tx(), rec)
        vg = ttj.value_and_grad(lambda p, xb, yb: _mse(model.apply({"params": p}, xb), yb),
                                recorder=rec)  # fmt: skip

        @jax.jit
        def step(p: Any, o: Any, xb: Any, yb: Any) -> Any:
            loss, g = vg(p, xb, yb)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o, loss, _clip_factor(g)

        opt = tx.init(params)
        for t in range(STEPS):
            params, opt, loss, c = step(params, opt, x[t], y[t])
            rec.log(t, {"train/loss": float(loss), "grad/clip_factor": float(c)})


def train_nnx(url: str) -> None:
    """Flax NNX: ``traintape.jax.nnx_value_and_grad`` + ``nnx.Optimizer(watch(chain))``."""
    from conformance.models_jax import _jax, _mse, load_nnx, nnx_model

    jax = _jax("float32")
    from flax import nnx

    import traintape.jax as ttj

    model = nnx_model(MODEL, "float32")
    load_nnx(model, weights())
    x, y = S.batches(MODEL, "float32")
    with _recorder(url) as rec:
        opt = nnx.Optimizer(model, ttj.watch(_tx(), rec), wrt=nnx.Param)
        vg = ttj.nnx_value_and_grad(lambda m, xb, yb: _mse(m(xb), yb), recorder=rec)

        @nnx.jit
        def step(m: Any, o: Any, xb: Any, yb: Any) -> Any:
            loss, g = vg(m, xb, yb)
            o.update(m, g)
            return loss, _clip_factor(g)

        for t in range(STEPS):
            loss, c = step(model, opt, x[t], y[t])
            rec.log(t, {"train/loss": float(loss), "grad/clip_factor": float(c)})
        jax.block_until_ready(nnx.state(model))


TRAIN = {"torch": train_torch, "jax-linen": train_linen, "jax-nnx": train_nnx}


def store_path(root: str | Path, framework: str) -> Path:
    return Path(root) / CONFIG / framework / MODEL


def check_store(url: str | Path) -> list[str]:
    """What in one store breaks the definitions (empty: nothing): ``update`` snapshots
    are θ_{t+1} − θ_t of the ``param`` snapshots bit for bit, 0 exactly where θ did not
    change, ``zero_frac`` the fraction unchanged; every kernel has both unchanged and
    changed elements; the recorded global grad norm is above :data:`MAX_NORM` (pre-clip)."""
    import traintape

    run = traintape.open_run(url)
    problems: list[str] = []
    if run.steps.tolist() != list(range(STEPS)):
        return [f"steps {run.steps.tolist()}, expected 0..{STEPS - 1}"]
    upd = run.stats("update").set_index(["step", "tensor"])
    grad = run.stats("grad")
    for t in range(STEPS - 1):
        for n in run.tensor_names("update"):
            delta = run.snapshot(n, "param", t + 1) - run.snapshot(n, "param", t)
            u = run.snapshot(n, "update", t)
            if u.dtype != delta.dtype or not np.array_equal(u, delta):
                problems.append(f"update {n} at step {t} is not θ_(t+1) − θ_t as applied")
            zf = float(upd.loc[(t, n), "zero_frac"])
            if zf != float((delta == 0).mean()):
                problems.append(f"update {n} at step {t}: zero_frac {zf} != {(delta == 0).mean()}")
            if n.endswith("kernel") and ((delta == 0).all() or (delta != 0).all()):
                problems.append(f"update {n} at step {t}: no mix of elements below and above "
                                f"half an ulp (the case tests nothing)")  # fmt: skip
    for t in range(STEPS):
        total = float(np.sqrt((grad[grad.step == t]["l2"] ** 2).sum()))
        if not total > MAX_NORM:
            problems.append(f"grad at step {t}: global norm {total:.3g} <= {MAX_NORM} (clipped?)")
    return problems


def produce(root: str | Path, frameworks: tuple[str, ...] = FRAMEWORKS) -> dict[str, str]:
    """Train every framework in its own subprocess (one at a time); ``{framework: error
    tail}`` for those that failed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    failures = {}
    for f in frameworks:
        cmd = [sys.executable, "-m", "conformance.semantics", "--worker", f, str(root)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            tail = (p.stdout + p.stderr).strip().splitlines()
            failures[f] = f"{f} worker failed (exit {p.returncode}): {(tail or [''])[-1][:300]}"
    return failures


def run_case(root: str | Path | None = None, frameworks: tuple[str, ...] = FRAMEWORKS) -> list:
    """Produce the stores and return one :class:`conformance.matrix.Cell` per pair: its
    compare verdict, with :func:`check_store`'s findings on either store as problems."""
    import itertools

    from conformance.matrix import Cell, check_pair, tolerances_for

    frameworks = tuple(f for f in frameworks if f in FRAMEWORKS)
    if root is None:
        with tempfile.TemporaryDirectory(prefix="traintape-semantics-") as tmp:
            return run_case(tmp, frameworks)
    failed = produce(root, frameworks)
    own = {f: check_store(store_path(root, f)) for f in frameworks if f not in failed}
    cells = []
    for a, b in itertools.combinations(frameworks, 2):
        bad = [failed[f] for f in (a, b) if f in failed]
        if bad:
            cells.append(Cell(CONFIG, MODEL, a, b, identical=False, initial_exact=False,
                              problems=bad))  # fmt: skip
            continue
        cell = check_pair(store_path(root, a), store_path(root, b), MODEL, CONFIG, names=(a, b),
                          tolerances=tolerances_for("float32+adam"))  # fmt: skip
        extra = [f"{f}: {p}" for f in (a, b) for p in own[f]]
        cell.problems += extra
        # every difference check_pair finds is a problem (structure, tolerance, initial)
        cell.identical = not cell.problems
        cells.append(cell)
    return cells


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m conformance.semantics", description=__doc__)
    p.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "ROOT"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="keep the stores here (default: temp dir)")
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    a = p.parse_args(argv)
    if a.worker:
        f, root = a.worker
        TRAIN[f](str(store_path(root, f)))
        return 0
    cells = run_case(a.out, tuple(a.frameworks))
    from rich.console import Console

    from conformance.matrix import render

    Console(width=200).print(render(cells))
    return 0 if all(c.identical for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
