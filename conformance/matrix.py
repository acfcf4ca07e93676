"""Produce the conformance stores and compare every pair of frameworks, per model/dtype.

A cell (model, framework pair, dtype) is **identical** when

1. ``traintape.compare`` finds no structural difference and every tensor of every kind
   stays within :data:`TOLERANCES` at every step (stats and full snapshots), and
2. the initial parameters are *exactly* equal: every ``param`` snapshot at step 0 is
   bit-for-bit the same in both stores, and equal to :func:`conformance.spec.initial_weights`
   (loading through ``from_canonical`` is a permutation/reshape: no rounding allowed).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from conformance import spec as S
from conformance.worker import FRAMEWORKS, store_path, written_in

DTYPES = ("float32", "float64")
ADAM_CONFIGS = ("float32+adam", "float64+adam")
ADAM_FRAMEWORKS = ("torch", "tf", "jax-linen", "jax-nnx", "equinox", "keras-jax", "keras-torch")
"""Adam runs in every framework: torch ``Adam`` ⇔ ``optax.adam`` ⇔ Keras ``Adam`` with
ε_K(t) = ε·√(1−β₂ᵗ) (Keras adds ε to the uncorrected √v; README). The Adam cells also
compare ``opt_state`` (``<param>/mu``, ``<param>/nu``)."""
ADAM_MODELS = ("mlp", "transformer")

TOLERANCES: dict[str, dict[str, dict[str, float]]] = {
    # float32: ε = 1.2e-7. Equivalent models differ only by reduction order (matmul
    # blocking, conv algorithm, softmax/LayerNorm/BatchNorm reductions, the fused vs
    # unfused GRU gates); each reduction of n terms carries ~sqrt(n)·ε relative noise,
    # compounded through 20 momentum-SGD steps. rtol 1e-5 on params (O(1) values) and
    # 1e-4 on grads/updates/activations (results of longer reduction chains) with atol
    # floors for elements that are ~0 (an update is lr·v ≈ 1e-3 of a param, so its
    # absolute noise is ~1e-3 · ε·|θ| ≈ 1e-10; the floor 1e-7 leaves room for cancellation).
    "float32": {
        "param": {"atol": 1e-6, "rtol": 1e-5},
        "grad": {"atol": 1e-6, "rtol": 1e-4},
        "update": {"atol": 1e-7, "rtol": 1e-4},
        "activation": {"atol": 1e-5, "rtol": 1e-4},
        "opt_state": {"atol": 1e-7, "rtol": 1e-4},
        "metrics": {"atol": 1e-6, "rtol": 1e-5},
    },
    # float64: ε = 2.2e-16, i.e. 2^-29 ≈ 1.9e-9 times float32's; the same argument
    # scaled by ~1e-8 (rounded up to a decade). Any layout/gate/epsilon bug is orders of
    # magnitude above these.
    "float64": {
        "param": {"atol": 1e-13, "rtol": 1e-12},
        "grad": {"atol": 1e-13, "rtol": 1e-11},
        "update": {"atol": 1e-14, "rtol": 1e-11},
        "activation": {"atol": 1e-12, "rtol": 1e-11},
        "opt_state": {"atol": 1e-14, "rtol": 1e-11},
        "metrics": {"atol": 1e-13, "rtol": 1e-12},
    },
}
"""Per-dtype, per-kind tolerances: a value a agrees with b when |a−b| <= atol + rtol·|b|."""


def tolerances_for(config: str) -> dict[str, dict[str, float]]:
    """The tolerance table of a config (``'float32'``, ``'float64+adam'``...).

    Adam's update ``lr·m̂/(√v̂ + ε)`` is ≈ ``(lr/ε)·g`` for a gradient element |g| ≪ ε, so
    it amplifies the gradient's absolute rounding noise by lr/ε (= 8 here): a near-zero
    grad element carrying 6e-8 of float32 noise (allowed: grad atol is 1e-6) moves the
    update by 5e-7. The update atol is therefore scaled by 10 (lr/ε rounded up to a
    decade) for Adam; everything else is unchanged.
    """
    base = {k: dict(v) for k, v in TOLERANCES[S.dtype_of(config)].items()}
    if S.optimizer_of(config) == "adam":
        amp = 10.0 ** np.ceil(np.log10(S.ADAM_LR / S.ADAM_EPS))
        base["update"]["atol"] *= float(amp)
    return base


@dataclass
class Cell:
    """The verdict of one (dtype, model, framework A, framework B) comparison."""

    dtype: str
    model: str
    a: str
    b: str
    identical: bool
    initial_exact: bool
    max_abs: float | None = None
    max_rel: float | None = None
    worst: str | None = None
    """'kind tensor' with the largest absolute error."""
    first_divergence: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return "identical" if self.identical else "differs"


def produce(
    root: str | Path,
    frameworks: tuple[str, ...] = FRAMEWORKS,
    dtypes: tuple[str, ...] = DTYPES,
    models: tuple[str, ...] = tuple(S.MODELS),
    jobs: int = 2,
) -> dict[tuple[str, str], str]:
    """Run every (framework, dtype) worker in its own subprocess, ``jobs`` at a time
    (a subprocess per framework keeps TF/torch/JAX thread pools and JAX's x64 flag apart).

    Returns ``{(framework, dtype): error tail}`` for workers that failed (their cells
    are reported as failed; the others are still compared).
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    todo = [(f, d) for d in dtypes for f in frameworks]
    running: list[tuple[tuple[str, str], subprocess.Popen[bytes]]] = []
    failures: dict[tuple[str, str], str] = {}
    while todo or running:
        while todo and len(running) < jobs:
            f, d = todo.pop(0)
            cmd = [sys.executable, "-m", "conformance.worker", f, d, str(root), *models]
            running.append(((f, d), subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))  # fmt: skip
        (f, d), p = running.pop(0)
        out, _ = p.communicate()
        if p.returncode != 0:
            lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
            err = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
            failures[(f, d)] = f"{f} {d} worker failed (exit {p.returncode}): {err[:300]}"
    return failures


def _initial_exact(ra: Any, rb: Any, model: str, dtype: str) -> list[str]:
    problems = []
    want = S.initial_weights(model, S.dtype_of(dtype))
    names = sorted(set(ra.tensor_names("param")) & set(rb.tensor_names("param")))
    for n in names:
        xa, xb = ra.snapshot(n, "param", 0), rb.snapshot(n, "param", 0)
        if xa.dtype != xb.dtype or not np.array_equal(xa, xb):
            d = float(np.max(np.abs(xa.astype(np.float64) - xb))) if xa.shape == xb.shape else None
            problems.append(f"initial param {n} not bit-identical (max |a-b| {d})")
        elif n in want and not np.array_equal(xa, want[n]):
            problems.append(f"initial param {n} differs from the canonical initial weights")
    return problems


def check_pair(
    a_url: str | Path, b_url: str | Path, model: str, dtype: str,
    names: tuple[str, str] = ("A", "B"),
    tolerances: dict[str, dict[str, float]] | None = None,
) -> Cell:  # fmt: skip
    """Compare two stores of ``model`` under the conformance definition of identical."""
    import traintape

    ra, rb = traintape.open_run(a_url), traintape.open_run(b_url)
    tols = tolerances or tolerances_for(dtype)
    rep = traintape.compare(ra, rb, tolerances=tols, strict=True)
    problems = [s.message for s in rep.structural]
    try:
        problems += _initial_exact(ra, rb, model, dtype)
    except Exception as e:  # a missing step-0 snapshot is itself a failure
        problems.append(f"initial params: {e}")
    problems += _anchor(ra, names[0])
    cell = Cell(dtype, model, names[0], names[1], identical=rep.identical and not problems,
                initial_exact=not any(p.startswith("initial") for p in problems),
                problems=problems)  # fmt: skip
    best: tuple[float, str] | None = None
    for t in rep.tensors:
        if t.max_abs is None:
            continue
        cell.max_abs = max(cell.max_abs or 0.0, t.max_abs)
        cell.max_rel = max(cell.max_rel or 0.0, t.max_rel or 0.0)
        if best is None or t.max_abs > best[0]:
            best = (t.max_abs, f"{t.kind} {t.tensor}")
        if not t.within:
            problems.append(f"{t.kind} {t.tensor}: out of tolerance from step "
                            f"{t.first_step_out} ({t.first_out_via}; max |a-b| {t.max_abs:.3g})")  # fmt: skip
    if best is not None:
        cell.worst = best[1]
    fd = rep.first_divergence
    if fd is not None:
        cell.first_divergence = f"{fd.kind} {fd.tensor} at step {fd.first_step_out}"
    return cell


def _anchor(run: Any, label: str) -> list[str]:
    """Framework ``label``'s stats against float64 numpy of its own tensors
    (:mod:`conformance.anchor`): identical must also mean right."""
    from conformance.anchor import anchor_problems

    try:
        return anchor_problems(run, label)
    except Exception as e:  # a store the anchor cannot read is itself a failure
        return [f"anchor {label}: {type(e).__name__}: {e}"]


def require_cells(cells: list[Cell], frameworks: tuple[str, ...]) -> None:
    """Refuse a matrix with zero cells (it would pass having compared nothing)."""
    if not cells:
        raise ValueError(
            f"the conformance matrix has zero cells for frameworks {list(frameworks)}: "
            "a cell compares two frameworks, so name at least two"
        )


def compare_all(
    root: str | Path,
    frameworks: tuple[str, ...] = FRAMEWORKS,
    dtypes: tuple[str, ...] = DTYPES,
    models: tuple[str, ...] = tuple(S.MODELS),
    failures: dict[tuple[str, str], str] | None = None,
) -> list[Cell]:
    """Compare every pair of ``frameworks`` per dtype and model (stores under ``root``)."""
    cells = []
    failures = failures or {}
    for d in dtypes:
        for m in models:
            for fa, fb in itertools.combinations(frameworks, 2):
                bad = [failures[(f, d)] for f in (fa, fb) if (f, d) in failures]
                bad += [f"{m} is not written in {f}" for f in (fa, fb) if m not in written_in(f)]
                if bad:
                    cells.append(Cell(d, m, fa, fb, identical=False, initial_exact=False,
                                      problems=bad))  # fmt: skip
                    continue
                cells.append(check_pair(store_path(root, fa, m, d), store_path(root, fb, m, d),
                                        m, d, names=(fa, fb)))  # fmt: skip
    return cells


Plan = list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]
"""[(frameworks, configs, models), ...]: each entry is one all-pairs block of the matrix."""


def default_plan(
    frameworks: tuple[str, ...] = FRAMEWORKS,
    dtypes: tuple[str, ...] = DTYPES,
    models: tuple[str, ...] = tuple(S.MODELS),
    adam: bool = True,
) -> Plan:
    """SGD with momentum for every framework/model/dtype, plus (``adam``) Adam for the
    frameworks whose Adam agrees (:data:`ADAM_FRAMEWORKS`) on :data:`ADAM_MODELS`."""
    plan: Plan = [(tuple(frameworks), tuple(dtypes), tuple(models))]
    if adam:
        fws = tuple(f for f in frameworks if f in ADAM_FRAMEWORKS)
        ms = tuple(m for m in models if m in ADAM_MODELS)
        cfg = tuple(f"{d}+adam" for d in dtypes)
        if len(fws) >= 2 and ms:
            plan.append((fws, cfg, ms))
    return plan


def run_matrix(
    frameworks: tuple[str, ...] = FRAMEWORKS,
    dtypes: tuple[str, ...] = DTYPES,
    models: tuple[str, ...] = tuple(S.MODELS),
    root: str | Path | None = None,
    jobs: int = 2,
    adam: bool = True,
) -> list[Cell]:
    """Produce all stores of :func:`default_plan` (under ``root`` or a temporary
    directory) and compare them; one :class:`Cell` per (config, model, pair)."""
    plan = default_plan(frameworks, dtypes, models, adam)
    if root is None:
        with tempfile.TemporaryDirectory(prefix="traintape-conformance-") as tmp:
            return run_plan(plan, tmp, jobs)
    return run_plan(plan, root, jobs)


def run_plan(plan: Plan, root: str | Path, jobs: int = 2) -> list[Cell]:
    """Produce and compare every block of ``plan`` under ``root``."""
    cells: list[Cell] = []
    for fws, cfgs, ms in plan:
        failed = produce(root, fws, cfgs, ms, jobs)
        cells += compare_all(root, fws, cfgs, ms, failed)
    return cells


def render(cells: list[Cell]) -> Any:
    """A rich table: rows = dtype × model, columns = framework pairs."""
    from rich.table import Table

    pairs = list(dict.fromkeys((c.a, c.b) for c in cells))
    table = Table(title="traintape conformance: models × framework pairs",
                  caption="verdict; largest |a−b| over all kinds, tensors, steps, stats and "
                          "snapshots (and where)")  # fmt: skip
    table.add_column("dtype[+optimizer]")
    table.add_column("model")
    for a, b in pairs:
        table.add_column(f"{a} ↔ {b}")
    rows = list(dict.fromkeys((c.dtype, c.model) for c in cells))
    by = {(c.dtype, c.model, c.a, c.b): c for c in cells}
    for d, m in rows:
        out = []
        for a, b in pairs:
            c = by.get((d, m, a, b))
            if c is None:
                out.append("")
                continue
            from conformance.known import known_gap

            gap = not c.identical and known_gap(c.dtype, c.model, c.a, c.b) is not None
            colour = "green" if c.identical else "yellow" if gap else "red"
            txt = f"[{colour}]{c.verdict}{' (known gap)' if gap else ''}[/{colour}]"
            if c.max_abs is not None:
                txt += f"\nmax |a−b| {c.max_abs:.1e}"
            if c.worst is not None:
                txt += f" ({c.worst})"
            if not c.identical and c.problems:
                txt += "\n" + "\n".join(c.problems[:3])
                if len(c.problems) > 3:
                    txt += f"\n… {len(c.problems) - 3} more"
            out.append(txt)
        table.add_row(d, m, *out)
    return table
