"""Gradient-flow health per layer and over time.

For every layer (tensors grouped by layer path, in forward order) the analysis reads
the stat vectors of ``grad``, ``param``, ``update`` and ``activation`` and computes:

- ``grad_norm``: median over steps of the layer's gradient L2 norm
  (``sqrt(Σ_tensors l2²)``), and its coefficient of variation over steps;
- ``rel_grad``: median of ``grad_norm / param_norm`` (scale-free gradient size);
- ``update_ratio``: median of ``‖θ_{t+1} − θ_t‖ / ‖θ_t‖`` (the update/param ratio);
- ``grad_growth``: median grad norm of the last quarter of steps / of the first quarter;
- ``act_zero_frac``: median zero fraction of the layer's activation;
- saturation of bounded activations (see :class:`HealthThresholds`).

Issues (each with a severity and a concrete recommendation): VANISHING, EXPLODING, DEAD,
SATURATED, DECAY_WITH_DEPTH, LAYER_IMBALANCE, ATTENTION_QKV_IMBALANCE. A layer's score is
``100 − Σ penalties`` (critical 60, warning 25, floored at 0); status is ``critical`` with
any critical issue, ``warning`` with any warning, else ``healthy``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import (
    ProgressCallback,
    Reducer,
    StatsCache,
    Tracker,
    _quiet,
    column_median,
    finite_float,
    layer_norms,
    stat_index,
)
from traintape.schema import Kind, split_name

if TYPE_CHECKING:
    from traintape.core.reader import Run


class IssueType(StrEnum):
    VANISHING = "VANISHING"
    EXPLODING = "EXPLODING"
    DEAD = "DEAD"
    SATURATED = "SATURATED"
    DECAY_WITH_DEPTH = "DECAY_WITH_DEPTH"
    LAYER_IMBALANCE = "LAYER_IMBALANCE"
    ATTENTION_QKV_IMBALANCE = "ATTENTION_QKV_IMBALANCE"


class Status(StrEnum):
    HEALTHY = "healthy"
    WARNING = "warning"
    CRITICAL = "critical"


class HealthThresholds(BaseModel):
    """Documented, configurable thresholds (defaults in parentheses).

    - ``vanishing_rel`` (1e-2) / ``vanishing_rel_critical`` (1e-3): a layer whose
      ``rel_grad`` is below this fraction of the largest layer's is VANISHING (warning /
      critical); so is any layer whose median grad norm is below ``vanishing_abs`` (1e-8).
    - ``exploding_norm`` (1e3): median or max grad norm above this is EXPLODING (critical),
      as are non-finite gradients; ``exploding_growth`` (100): grad norm growing by this
      factor from the first to the last quarter of the run is EXPLODING (warning; critical
      with ``update_ratio`` above ``update_ratio_high``).
    - ``update_ratio_high`` (0.1): update/param ratio above this is EXPLODING (critical).
    - ``dead_zero_frac`` (0.99): an activation with this zero fraction, or a layer whose
      gradients are exactly zero at ``dead_steps_frac`` (0.9) of steps, is DEAD (critical).
    - ``saturated_frac`` (0.9): a bounded activation (all values in [-1, 1]) whose
      ``abs_mean`` is above this fraction of its bound, or a [0, 1] activation whose mean
      is within ``1 − saturated_frac`` of 0 or 1 with std below ``saturated_std`` (0.05),
      is SATURATED (warning).
    - ``decay_ratio`` (100): last-layer / first-layer ``rel_grad`` above this is
      DECAY_WITH_DEPTH (warning; run level).
    - ``imbalance_ratio`` (1e3): max / min layer ``update_ratio`` above this is
      LAYER_IMBALANCE (warning; run level).
    - ``qkv_ratio`` (10): max / min of the q, k, v grad norms of one attention layer above
      this is ATTENTION_QKV_IMBALANCE (warning).
    """

    vanishing_rel: float = 1e-2
    vanishing_rel_critical: float = 1e-3
    vanishing_abs: float = 1e-8
    exploding_norm: float = 1e3
    exploding_growth: float = 100.0
    update_ratio_high: float = 0.1
    dead_zero_frac: float = 0.99
    dead_steps_frac: float = 0.9
    saturated_frac: float = 0.9
    saturated_std: float = 0.05
    decay_ratio: float = 100.0
    imbalance_ratio: float = 1e3
    qkv_ratio: float = 10.0
    critical_penalty: float = 60.0
    warning_penalty: float = 25.0


class Issue(BaseModel):
    """One health issue of a layer (or of the run when ``layer`` is None)."""

    type: IssueType
    severity: Status
    layer: str | None = None
    message: str
    recommendation: str
    evidence: dict[str, Any] = Field(default_factory=dict)


class LayerHealth(BaseModel):
    """Health of one layer (medians over recorded steps; None where not recorded)."""

    layer: str
    depth: int = Field(description="position in forward order, 0 = first")
    grad_norm: float | None = None
    grad_norm_cv: float | None = Field(None, description="std/mean of grad norm over steps")
    rel_grad: float | None = Field(None, description="median grad_norm / param_norm")
    update_ratio: float | None = Field(None, description="median ‖Δθ‖/‖θ‖ per step")
    grad_growth: float | None = Field(None, description="last-quarter / first-quarter grad norm")
    act_zero_frac: float | None = None
    score: float = 100.0
    status: Status = Status.HEALTHY
    issues: list[Issue] = Field(default_factory=list)


class HealthReport(BaseModel):
    url: str
    steps: int
    layers: list[LayerHealth]
    run_issues: list[Issue] = Field(default_factory=list)
    thresholds: HealthThresholds
    score: float = Field(description="mean of layer scores, minus run-level penalties")
    status: Status

    def issues(self) -> list[Issue]:
        """All issues, run-level first then per layer in forward order."""
        return [*self.run_issues, *(i for lh in self.layers for i in lh.issues)]

    def has(self, type: IssueType | str, layer: str | None = None) -> bool:
        return any(
            i.type == IssueType(type) and (layer is None or i.layer == layer) for i in self.issues()
        )


_RECO = {
    IssueType.VANISHING: "gradients barely reach this layer: use ReLU/GELU instead of "
    "sigmoid/tanh, He/Xavier initialisation, residual connections or normalisation layers",
    IssueType.EXPLODING: "lower the learning rate, add gradient clipping "
    "(e.g. clip global norm to 1.0) or learning-rate warm-up; check the loss scale",
    IssueType.DEAD: "the layer outputs (or receives) only zeros: check bias initialisation, "
    "use LeakyReLU/GELU, lower the learning rate, or re-initialise the layer",
    IssueType.SATURATED: "activations sit at the bounds of sigmoid/tanh: normalise inputs, "
    "add LayerNorm/BatchNorm before the nonlinearity, or scale down initial weights",
    IssueType.DECAY_WITH_DEPTH: "gradient size decays towards the input layers: add residual "
    "connections or normalisation, or use per-layer learning rates",
    IssueType.LAYER_IMBALANCE: "layers learn at very different speeds: use an adaptive "
    "optimizer (Adam), per-layer learning rates, or normalise layer scales",
    IssueType.ATTENTION_QKV_IMBALANCE: "q/k/v projections get very different gradients: "
    "check the attention scaling (1/sqrt(d)), initialisation of q/k, and QK-normalisation",
}


def _issue(t: IssueType, sev: Status, layer: str | None, msg: str, **evidence: Any) -> Issue:
    ev = {
        k: (finite_float(v) if isinstance(v, float | np.floating) else v)
        for k, v in evidence.items()
    }
    return Issue(
        type=t, severity=sev, layer=layer, message=msg, recommendation=_RECO[t], evidence=ev
    )


def _med(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else None


_KINDS = (Kind.GRAD, Kind.PARAM, Kind.UPDATE, Kind.ACTIVATION)
_ACT_SERIES = (
    ("zero_frac", "max"), ("min", "mean"), ("max", "mean"), ("abs_mean", "mean"),
    ("mean", "mean"), ("std", "mean"),
)  # fmt: skip


class GradTotals(Reducer):
    """Per layer of the grad kind, over all rows: non-finite values (NaN + Inf), rows at
    which every gradient tensor of the layer is exactly zero, and rows recorded.
    ``value = (nonfinite [layer], zero_rows [layer], recorded_rows [layer])``."""

    kind = Kind.GRAD

    def begin(self, cache: StatsCache) -> None:
        self.groups = cache.groups(Kind.GRAD)
        self.cols = [stat_index(cache.run, s) for s in ("nan_count", "inf_count", "zero_frac")]
        n = len(self.groups.layers)
        self.value = (np.zeros(n), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))

    def update(self, start: int, block: np.ndarray) -> None:
        nonfinite, zero_rows, recorded = self.value
        nf = block[:, :, self.cols[0]] + block[:, :, self.cols[1]]
        with np.errstate(all="ignore"):
            nonfinite += np.nansum(self.groups.reduce(nf, "sum"), axis=0)
        zmin = self.groups.reduce(block[:, :, self.cols[2]], "min")  # NaN: not recorded
        rec = ~np.isnan(zmin)
        recorded += rec.sum(axis=0)
        zero_rows += (rec & (zmin >= 1.0)).sum(axis=0)


def _column_groups(n_rows: int, n_cols: int, max_values: int = 4 << 20) -> range:
    return range(0, n_cols, max(1, max_values // max(n_rows, 1)))


def _grad_measures(g: np.ndarray) -> dict[str, np.ndarray]:
    """Per column of grad norms ``g [rows, layer]`` over the finite values: ``median``,
    ``cv`` (std/mean; NaN with fewer than 2 values or mean 0), ``growth`` (median of the
    last quarter / of the first quarter of the values; NaN with fewer than 4) and
    ``max`` (NaN if none). Vectorised in groups of columns."""
    n_rows, n_cols = g.shape
    out = {k: np.full(n_cols, np.nan) for k in ("median", "cv", "growth", "max")}
    step = _column_groups(n_rows, n_cols).step
    for c0 in range(0, n_cols, step):
        x = np.asarray(g[:, c0 : c0 + step], dtype=np.float64)
        fin = np.isfinite(x)
        n = fin.sum(axis=0)
        xf = np.where(fin, x, np.nan)
        sl = slice(c0, c0 + x.shape[1])
        out["median"][sl] = column_median(xf)
        with _quiet(), np.errstate(all="ignore"):
            mean, std = np.nanmean(xf, axis=0), np.nanstd(xf, axis=0)
            out["max"][sl] = np.nanmax(xf, axis=0)
            out["cv"][sl] = np.where((n > 1) & (mean > 0), std / mean, np.nan)
        growth = np.full(x.shape[1], np.nan)
        dense = fin.all(axis=0) & (n >= 4)
        if dense.any() and n_rows >= 4:  # the same quarter rows for every full column
            q = max(1, n_rows // 4)
            first, last = column_median(x[:q, dense]), column_median(x[-q:, dense])
            with np.errstate(all="ignore"):
                growth[dense] = np.where(first > 0, last / first, np.nan)
        for c in np.flatnonzero(~dense & (n >= 4)):  # columns with gaps: their own quarters
            v = x[fin[:, c], c]
            q = max(1, len(v) // 4)
            first, last = np.median(v[:q]), np.median(v[-q:])
            growth[c] = last / first if first > 0 else np.nan
        out["growth"][sl] = growth
    return out


def _ratio_median(
    a: np.ndarray | None,
    a_layers: list[str],
    b: np.ndarray | None,
    b_layers: list[str],
    layers: list[str],
) -> np.ndarray:
    """Per layer of ``layers``: median over rows of ``a[:, layer] / b[:, layer]`` (NaN
    where either series lacks the layer)."""  # fmt: skip
    out = np.full(len(layers), np.nan)
    if a is None or b is None:
        return out
    acol = {x: i for i, x in enumerate(a_layers)}
    bcol = {x: i for i, x in enumerate(b_layers)}
    pairs = [(k, acol[x], bcol[x]) for k, x in enumerate(layers) if x in acol and x in bcol]
    if not pairs:
        return out
    step = _column_groups(a.shape[0], len(pairs)).step
    for s0 in range(0, len(pairs), step):
        grp = pairs[s0 : s0 + step]
        ia = [p[1] for p in grp]
        ib = [p[2] for p in grp]
        out[[p[0] for p in grp]] = column_median(_ratio(a[:, ia], b[: a.shape[0], ib]))
    return out


def want_health(run: Run, cache: StatsCache) -> None:
    """Declare the stats :func:`health` reads (so a report loads them in one pass)."""
    for kind in (Kind.GRAD, Kind.PARAM, Kind.UPDATE):
        cache.want(kind, "l2", "norm")
    cache.want_reducer(("grad_totals",), GradTotals())
    for stat, how in _ACT_SERIES:
        cache.want(Kind.ACTIVATION, stat, how)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(a, dtype=np.float64) / b


def health(
    run: Run,
    thresholds: HealthThresholds | None = None,
    *,
    progress: ProgressCallback | None = None,
    cache: StatsCache | None = None,
) -> HealthReport:
    """Gradient-flow health of every layer of ``run`` (see module docstring).

    Args:
        run: an open run (:func:`traintape.open_run`).
        thresholds: override the defaults of :class:`HealthThresholds`.
        progress: ``callback(stage, done, total)``; a unit is one row block of a stats
            array read (grad, param, update, activation), plus one for the analysis.
        cache: a shared stats cache (used by the report so that each array is read once).
    """
    th = thresholds or HealthThresholds()
    if cache is None:
        cache = StatsCache(run, Tracker(progress))
    tracker = cache.tracker
    want_health(run, cache)
    tracker.add(cache.pending_blocks() + 1)
    cache.load()
    kinds = set(run.kinds())
    if Kind.GRAD in kinds:
        steps, layers, g = layer_norms(run, Kind.GRAD, cache)
    else:
        steps, layers, g = run.steps, [], np.zeros((run.rows, 0))
    p_layers: list[str] = []
    p: np.ndarray | None = None
    if Kind.PARAM in kinds:
        _, p_layers, p = layer_norms(run, Kind.PARAM, cache)
    u_layers: list[str] = []
    u: np.ndarray | None = None
    if Kind.UPDATE in kinds:
        _, u_layers, u = layer_norms(run, Kind.UPDATE, cache)
    all_layers = list(layers) + [x for x in p_layers if x not in set(layers)]
    grad_nonfinite: dict[str, float] = {}
    grad_zero_steps: dict[str, float] = {}
    if Kind.GRAD in kinds and layers:
        nonfinite, zero_rows, recorded = cache.result(("grad_totals",))
        for c, layer in enumerate(layers):
            grad_nonfinite[layer] = float(nonfinite[c])
            grad_zero_steps[layer] = float(zero_rows[c] / max(int(recorded[c]), 1))
    act: dict[str, dict[str, float | None]] = {}
    if Kind.ACTIVATION in kinds:
        a_layers = cache.groups(Kind.ACTIVATION).layers
        ser = {stat: cache.series(Kind.ACTIVATION, stat, how) for stat, how in _ACT_SERIES}
        meds = {k: column_median(ser[k]) for k in ("zero_frac", "abs_mean", "mean", "std")}
        with _quiet():
            amin, amax = np.nanmin(ser["min"], axis=0), np.nanmax(ser["max"], axis=0)
        for c, layer in enumerate(a_layers):
            act[layer] = {
                "zero_frac": finite_float(meds["zero_frac"][c]),
                "min": finite_float(amin[c]),
                "max": finite_float(amax[c]),
                "abs_mean": finite_float(meds["abs_mean"][c]),
                "mean": finite_float(meds["mean"][c]),
                "std": finite_float(meds["std"][c]),
            }
        seen = set(all_layers)
        all_layers += [x for x in a_layers if x not in seen]

    gm = _grad_measures(g)
    rel = _ratio_median(g, layers, p, p_layers, layers)
    upr = _ratio_median(u, u_layers, p, p_layers, u_layers)
    gcol = {x: i for i, x in enumerate(layers)}
    ucol = {x: i for i, x in enumerate(u_layers)}
    out: list[LayerHealth] = []
    for depth, layer in enumerate(all_layers):
        lh = LayerHealth(layer=layer, depth=depth)
        if layer in gcol:
            gi = gcol[layer]
            lh.grad_norm = finite_float(gm["median"][gi])
            lh.grad_norm_cv = finite_float(gm["cv"][gi])
            lh.grad_growth = finite_float(gm["growth"][gi])
            lh.rel_grad = finite_float(rel[gi])
        if layer in ucol:
            lh.update_ratio = finite_float(upr[ucol[layer]])
        if layer in act:
            lh.act_zero_frac = act[layer]["zero_frac"]
        out.append(lh)

    tracker.stage("analysing layers")
    # ---------------------------------------------------------------- per-layer issues
    rels = [lh.rel_grad for lh in out if lh.rel_grad is not None and lh.rel_grad > 0]
    top_rel = max(rels) if rels else None
    for lh in out:
        L = lh.layer
        nonfinite = (grad_nonfinite or {}).get(L, 0.0)
        if nonfinite > 0:
            lh.issues.append(_issue(IssueType.EXPLODING, Status.CRITICAL, L,
                                    f"{int(nonfinite)} non-finite gradient values",
                                    nonfinite_values=int(nonfinite)))  # fmt: skip
        elif lh.grad_norm is not None:
            gmax = float(gm["max"][gcol[L]]) if L in gcol else lh.grad_norm
            if lh.grad_norm > th.exploding_norm or gmax > th.exploding_norm:
                lh.issues.append(_issue(IssueType.EXPLODING, Status.CRITICAL, L,
                                        f"gradient norm up to {gmax:.3g} (> {th.exploding_norm:g})",
                                        grad_norm_median=lh.grad_norm, grad_norm_max=gmax))  # fmt: skip
            elif lh.update_ratio is not None and lh.update_ratio > th.update_ratio_high:
                lh.issues.append(_issue(IssueType.EXPLODING, Status.CRITICAL, L,
                                        f"update/param ratio {lh.update_ratio:.3g} "
                                        f"(> {th.update_ratio_high:g}): steps too large",
                                        update_ratio=lh.update_ratio, grad_growth=lh.grad_growth))  # fmt: skip
            elif lh.grad_growth is not None and lh.grad_growth > th.exploding_growth:
                lh.issues.append(_issue(IssueType.EXPLODING, Status.WARNING, L,
                                        f"gradient norm grew {lh.grad_growth:.3g}x over the run",
                                        grad_growth=lh.grad_growth))  # fmt: skip
        dead_act = lh.act_zero_frac is not None and lh.act_zero_frac >= th.dead_zero_frac
        dead_grad = (grad_zero_steps or {}).get(L, 0.0) >= th.dead_steps_frac
        if dead_act or dead_grad:
            lh.issues.append(_issue(IssueType.DEAD, Status.CRITICAL, L,
                                    ("activation is zero for "
                                     f"{100 * (lh.act_zero_frac or 0):.1f}% of values"
                                     if dead_act else "gradients are exactly zero")
                                    + (" and gradients are all-zero" if dead_act and dead_grad else ""),
                                    act_zero_frac=lh.act_zero_frac,
                                    grad_zero_steps_frac=(grad_zero_steps or {}).get(L)))  # fmt: skip
        elif (
            nonfinite == 0
            and lh.grad_norm is not None
            and (
                lh.grad_norm < th.vanishing_abs
                or (
                    top_rel and lh.rel_grad is not None and lh.rel_grad < th.vanishing_rel * top_rel
                )
            )
        ):
            frac = (lh.rel_grad / top_rel) if (top_rel and lh.rel_grad is not None) else 0.0
            crit = lh.grad_norm < th.vanishing_abs or frac < th.vanishing_rel_critical
            lh.issues.append(_issue(IssueType.VANISHING, Status.CRITICAL if crit else Status.WARNING, L,
                                    f"relative gradient {lh.rel_grad or 0:.3g} is {frac:.2g}x "
                                    f"the largest layer's ({top_rel or 0:.3g})",
                                    grad_norm=lh.grad_norm, rel_grad=lh.rel_grad,
                                    fraction_of_max=frac))  # fmt: skip
        a = act.get(L)
        if a and a["min"] is not None and a["max"] is not None and a["abs_mean"] is not None:
            lo, hi = a["min"], a["max"]
            sat = False
            if lo >= -1.0 and hi <= 1.0 and lo < 0 and a["abs_mean"] > th.saturated_frac:
                sat = True
            if (
                lo >= 0.0 and hi <= 1.0 and a["mean"] is not None and a["std"] is not None
                and a["std"] < th.saturated_std
                and (a["mean"] < 1 - th.saturated_frac or a["mean"] > th.saturated_frac)
                and not dead_act
            ):  # fmt: skip
                sat = True
            if sat:
                lh.issues.append(_issue(IssueType.SATURATED, Status.WARNING, L,
                                        f"bounded activation saturated (mean {a['mean']:.3g}, "
                                        f"|mean| {a['abs_mean']:.3g}, std {a['std']:.3g})",
                                        **{k: v for k, v in a.items() if v is not None}))  # fmt: skip

    # ---------------------------------------------------------------- run-level issues
    run_issues: list[Issue] = []
    with_rel = [lh for lh in out if lh.rel_grad is not None and lh.rel_grad > 0]
    if len(with_rel) >= 3:
        ratio = with_rel[-1].rel_grad / with_rel[0].rel_grad  # type: ignore[operator]
        if ratio > th.decay_ratio:
            run_issues.append(_issue(IssueType.DECAY_WITH_DEPTH, Status.WARNING, None,
                                     f"relative gradient falls {ratio:.3g}x from "
                                     f"{with_rel[-1].layer!r} back to {with_rel[0].layer!r}",
                                     ratio=ratio,
                                     profile={x.layer: x.rel_grad for x in with_rel}))  # fmt: skip
    ur = [lh for lh in out if lh.update_ratio is not None and lh.update_ratio > 0]
    if len(ur) >= 2:
        hi_l = max(ur, key=lambda x: x.update_ratio or 0)
        lo_l = min(ur, key=lambda x: x.update_ratio or 0)
        ratio = (hi_l.update_ratio or 0) / (lo_l.update_ratio or 1)
        if ratio > th.imbalance_ratio:
            run_issues.append(_issue(IssueType.LAYER_IMBALANCE, Status.WARNING, None,
                                     f"update/param ratio ranges {ratio:.3g}x: "
                                     f"{hi_l.layer!r} {hi_l.update_ratio:.3g} vs "
                                     f"{lo_l.layer!r} {lo_l.update_ratio:.3g}",
                                     ratio=ratio, fastest=hi_l.layer, slowest=lo_l.layer))  # fmt: skip
    # attention: sibling sub-layers q/k/v under one parent
    by_layer = {lh.layer: lh for lh in out}
    parents = {split_name(L)[0] for L in by_layer if split_name(L)[1] in ("q", "k", "v")}
    for parent in sorted(parents):
        gn = {
            s: by_layer[f"{parent}/{s}"].grad_norm
            for s in ("q", "k", "v")
            if f"{parent}/{s}" in by_layer
        }
        vals = [v for v in gn.values() if v is not None and v > 0]
        if len(vals) >= 2 and max(vals) / min(vals) > th.qkv_ratio:
            iss = _issue(IssueType.ATTENTION_QKV_IMBALANCE, Status.WARNING, parent,
                         f"q/k/v gradient norms differ {max(vals) / min(vals):.3g}x",
                         **{f"grad_norm_{k}": v for k, v in gn.items()})  # fmt: skip
            run_issues.append(iss)

    for lh in out:
        pen = sum(th.critical_penalty if i.severity == Status.CRITICAL else th.warning_penalty
                  for i in lh.issues)  # fmt: skip
        lh.score = float(max(0.0, 100.0 - pen))
        sev = {i.severity for i in lh.issues}
        lh.status = (Status.CRITICAL if Status.CRITICAL in sev
                     else Status.WARNING if Status.WARNING in sev else Status.HEALTHY)  # fmt: skip
    score = float(np.mean([lh.score for lh in out])) if out else 100.0
    score = max(0.0, score - th.warning_penalty / 5 * len(run_issues))
    sev_all = {i.severity for i in run_issues} | {lh.status for lh in out}
    status = (Status.CRITICAL if Status.CRITICAL in sev_all
              else Status.WARNING if Status.WARNING in sev_all else Status.HEALTHY)  # fmt: skip
    tracker.advance()
    return HealthReport(url=run.url, steps=len(steps), layers=out, run_issues=run_issues,
                        thresholds=th, score=round(score, 1), status=status)  # fmt: skip
