"""Parameter change between steps: how much, where, and how sparse.

From **snapshots**: for every pair of consecutive param snapshots ``(s0, s1)``,
``Δ = θ_{s1} − θ_{s0}`` per tensor, aggregated per layer, per component and globally:
``l1 = Σ|Δ|``, ``l2 = ‖Δ‖₂``, ``max = max|Δ|``, ``sparsity[thr]`` = fraction of entries with
``|Δ| <= thr`` for each threshold (default 1e-8, 1e-6, 1e-4), and ``relative = ‖Δ‖₂ / ‖θ_{s0}‖₂``.
Snapshots are read one tensor at a time.

From **stats** (always available): per step ``t`` and layer, ``‖update_t‖₂ / ‖θ_t‖₂`` —
the single-step relative change — in :func:`change_from_stats`.

Components: ``attention/q|k|v|o`` (a tensor under a ``q``/``k``/``v``/``o`` sub-layer),
``embedding`` (role embedding), ``norm`` (layer kinds *norm*, or roles scale/running_*,
or a layer path segment containing "norm"/"ln"), ``mlp`` (everything else with a kernel or
bias: dense, conv, recurrent).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import (
    ProgressCallback,
    StatsCache,
    Tracker,
    layer_norms,
    layer_of,
)
from traintape.schema import Kind

if TYPE_CHECKING:
    from traintape.core.reader import Run
    from traintape.schema import TensorSpec

DEFAULT_THRESHOLDS: tuple[float, ...] = (1e-8, 1e-6, 1e-4)


def component_of(spec: TensorSpec) -> str:
    """Component class of a parameter (see module docstring)."""
    segs = spec.name.split("/")
    if len(segs) >= 2 and segs[-2] in ("q", "k", "v", "o"):
        return f"attention/{segs[-2]}"
    if spec.role == "embedding" or spec.layer_kind == "embedding":
        return "embedding"
    lk = spec.layer_kind or ""
    if "norm" in lk or spec.role in ("scale", "running_mean", "running_var"):
        return "norm"
    if any("norm" in s.lower() or s.lower() in ("ln", "ln1", "ln2", "ln_f") for s in segs[:-1]):
        return "norm"
    return "mlp"


class ChangeStats(BaseModel):
    """Change of a group of tensors between two steps."""

    numel: int
    l1: float
    l2: float
    max: float
    relative: float | None = Field(None, description="‖Δ‖₂ / ‖θ_old‖₂")
    sparsity: dict[str, float] = Field(description="threshold → fraction with |Δ| <= threshold")


class StepPairChange(BaseModel):
    step_old: int
    step_new: int
    total: ChangeStats
    per_layer: dict[str, ChangeStats]
    per_component: dict[str, ChangeStats]
    per_tensor: dict[str, ChangeStats]


class ParameterChange(BaseModel):
    url: str
    thresholds: list[float]
    pairs: list[StepPairChange]


class _Agg:
    def __init__(self, thresholds: tuple[float, ...]) -> None:
        self.n = 0
        self.l1 = 0.0
        self.sq = 0.0
        self.mx = 0.0
        self.old_sq = 0.0
        self.below = np.zeros(len(thresholds))
        self.thr = thresholds

    def add(self, d: np.ndarray, old: np.ndarray) -> None:
        a = np.abs(d)
        self.n += a.size
        self.l1 += float(a.sum())
        self.sq += float((a * a).sum())
        self.mx = max(self.mx, float(a.max()) if a.size else 0.0)
        self.old_sq += float((old * old).sum())
        for i, t in enumerate(self.thr):
            self.below[i] += float((a <= t).sum())

    def result(self) -> ChangeStats:
        return ChangeStats(
            numel=self.n,
            l1=self.l1,
            l2=float(np.sqrt(self.sq)),
            max=self.mx,
            relative=float(np.sqrt(self.sq / self.old_sq)) if self.old_sq > 0 else None,
            sparsity={
                f"{t:g}": float(b / max(self.n, 1))
                for t, b in zip(self.thr, self.below, strict=True)
            },
        )


def parameter_change(
    run: Run,
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS,
    *,
    max_pairs: int | None = None,
    progress: ProgressCallback | None = None,
) -> ParameterChange:
    """Change between consecutive param snapshots (all tensors with snapshots).

    Args:
        run: an open run (:func:`traintape.open_run`).
        thresholds: ``|Δ|`` thresholds of the sparsity fractions.
        max_pairs: only the last ``max_pairs`` snapshot pairs.
        progress: ``callback(stage, done, total)``; a unit is one tensor of one step pair.
    """
    specs = run.manifest.specs(Kind.PARAM)
    steps_by: dict[str, np.ndarray] = {}
    if Kind.PARAM in run.manifest.commit.snapshots:
        steps_by = {s.name: run.snapshot_steps(s.name, Kind.PARAM) for s in specs}
    all_steps = sorted({int(x) for v in steps_by.values() for x in v})
    pairs = list(itertools.pairwise(all_steps))
    if max_pairs is not None:
        pairs = pairs[-max_pairs:]
    tracker = Tracker(progress)
    tracker.add(len(pairs) * len(steps_by))
    out = []
    for s0, s1 in pairs:
        tracker.stage(f"parameter change {s0}→{s1}")
        total = _Agg(thresholds)
        layers: dict[str, _Agg] = {}
        comps: dict[str, _Agg] = {}
        tens: dict[str, ChangeStats] = {}
        for spec in specs:
            st = steps_by.get(spec.name)
            if st is None:
                continue
            tracker.advance()
            if s0 not in st or s1 not in st:
                continue
            old = run.snapshot(spec.name, Kind.PARAM, s0).astype(np.float64)
            new = run.snapshot(spec.name, Kind.PARAM, s1).astype(np.float64)
            d = new - old
            t = _Agg(thresholds)
            t.add(d, old)
            tens[spec.name] = t.result()
            for agg in (
                total,
                layers.setdefault(layer_of(spec.name), _Agg(thresholds)),
                comps.setdefault(component_of(spec), _Agg(thresholds)),
            ):
                agg.add(d, old)
        out.append(
            StepPairChange(
                step_old=s0,
                step_new=s1,
                total=total.result(),
                per_layer={k: v.result() for k, v in layers.items()},
                per_component={k: v.result() for k, v in sorted(comps.items())},
                per_tensor=tens,
            )
        )
    tracker.finish()
    return ParameterChange(url=run.url, thresholds=list(thresholds), pairs=out)


def change_from_stats(
    run: Run, cache: StatsCache | None = None
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Single-step relative change per layer: ``(steps, layers, ratio [rows, layer])``,
    ``ratio = ‖update_t‖₂ / ‖θ_t‖₂`` (NaN where either was not recorded).

    ``cache`` shares the stats reads with other analyses (see the report)."""
    if Kind.UPDATE not in run.kinds() or Kind.PARAM not in run.kinds():
        return run.steps, [], np.zeros((run.rows, 0))
    steps, ul, u = layer_norms(run, Kind.UPDATE, cache)
    _, pl, p = layer_norms(run, Kind.PARAM, cache)
    layers = [x for x in ul if x in pl]
    with np.errstate(all="ignore"):
        r = (
            np.stack([u[:, ul.index(x)] / p[:, pl.index(x)] for x in layers], axis=1)
            if layers
            else u[:, :0]
        )
    return steps, layers, r
