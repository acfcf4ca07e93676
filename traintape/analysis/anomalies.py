"""Anomalies over a run: where and when something went wrong.

Detectors (thresholds in :class:`AnomalyThresholds`, defaults in parentheses):

- ``nan`` / ``inf``: the first step with a non-finite value in any recorded tensor or
  metric, and the first tensor at that step. Within one step data flows
  param θ_t → activations → grads → update, so candidates are ordered by kind in that
  order, then by forward order of the layer (see :mod:`traintape.analysis._common`),
  then by name. One anomaly per (type, kind, tensor) at its first step.
- ``loss_spike`` / ``loss_drop``: robust rolling z-score of the loss against the
  preceding ``window`` (20) values above ``z`` (6) / below ``−z``.
- ``grad_spike``: the same z-score on log10 of each layer's gradient norm above ``z``.
- ``update_ratio``: per layer, steps where ``‖Δθ‖/‖θ‖`` leaves
  [``update_ratio_low`` (1e-7), ``update_ratio_high`` (0.1)]; reported at the first such step.
- ``dead_units``: median activation zero fraction above ``dead_frac`` (0.9, warning; ``dead_frac_error``
  0.99, error); where activation snapshots exist, the fraction of units that are zero for
  every example of the probe batch is given as evidence.
- ``stalled``: the loss changed by less than ``stall_rel`` (1e-4, relative) over the last
  ``stall_window`` (20) steps while not near zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import (
    KIND_RANK,
    ProgressCallback,
    StatsCache,
    Tracker,
    finite_float,
    forward_rank,
    layer_norms,
    layer_of,
    layer_stat,
    natural_key,
    robust_z,
    stat_index,
    tensor_rank,
)
from traintape.schema import Kind, Severity

if TYPE_CHECKING:
    from traintape.core.reader import Run


class AnomalyThresholds(BaseModel):
    window: int = 20
    z: float = 6.0
    update_ratio_low: float = 1e-7
    update_ratio_high: float = 0.1
    dead_frac: float = 0.9
    dead_frac_error: float = 0.99
    stall_window: int = 20
    stall_rel: float = 1e-4
    loss_metric: str = "loss"


class Anomaly(BaseModel):
    """One anomaly: what, when (optimizer step), where, how bad, and the numbers."""

    type: str
    step: int
    tensor: str | None = None
    layer: str | None = None
    kind: Kind | None = None
    severity: Severity
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)


class AnomalyReport(BaseModel):
    url: str
    anomalies: list[Anomaly]
    first_nonfinite: Anomaly | None = Field(
        None, description="the first NaN/Inf: earliest step, then kind flow, forward order"
    )
    thresholds: AnomalyThresholds

    def of_type(self, type: str) -> list[Anomaly]:
        return [a for a in self.anomalies if a.type == type]


def _ev(**kw: Any) -> dict[str, Any]:
    return {k: finite_float(v) if isinstance(v, float | np.floating) else v for k, v in kw.items()}


def _nonfinite(run: Run, cache: StatsCache) -> list[Anomaly]:
    rank = forward_rank(run)
    out: list[tuple[tuple, Anomaly]] = []
    steps = run.steps
    for kind in run.kinds():
        names = run.tensor_names(kind)
        data = cache.get(kind)
        for typ, stat in (("nan", "nan_count"), ("inf", "inf_count")):
            col = stat_index(run, stat)
            cnt = data[:, :, col]
            bad = np.nan_to_num(cnt, nan=0.0) > 0
            for j in np.flatnonzero(bad.any(axis=0)):
                r = int(np.argmax(bad[:, j]))
                name = names[j]
                a = Anomaly(
                    type=typ,
                    step=int(steps[r]),
                    tensor=name,
                    layer=layer_of(name),
                    kind=kind,
                    severity=Severity.ERROR,
                    message=f"first {typ.upper()} in {kind.value} {name} ({int(cnt[r, j])} values)",
                    evidence=_ev(count=int(cnt[r, j]), steps_affected=int(bad[:, j].sum())),
                )
                key = (a.step, KIND_RANK[kind], tensor_rank(rank, name), natural_key(name))
                out.append((key, a))
    met = run.metrics()
    for c in met.columns:
        col = met[c].to_numpy()
        for typ, mask in (("nan", np.isnan(col)), ("inf", np.isinf(col))):
            if mask.any():
                i = int(np.argmax(mask))
                a = Anomaly(
                    type=typ,
                    step=int(met.index[i]),
                    tensor=f"metric:{c}",
                    severity=Severity.ERROR,
                    message=f"first {typ.upper()} in metric {c}",
                    evidence=_ev(steps_affected=int(mask.sum())),
                )
                out.append(((a.step, 9, 0, natural_key(c)), a))
    out.sort(key=lambda x: x[0])
    return [a for _, a in out]


def _series_z(
    name: str,
    steps: np.ndarray,
    x: np.ndarray,
    th: AnomalyThresholds,
    typ_up: str,
    typ_down: str | None,
    layer: str | None = None,
) -> list[Anomaly]:
    z = robust_z(x, th.window)
    out = []
    for i in np.flatnonzero(np.abs(np.nan_to_num(z)) > th.z):
        up = z[i] > 0
        if not up and typ_down is None:
            continue
        typ = typ_up if up else typ_down
        w = x[max(0, i - th.window) : i]
        out.append(
            Anomaly(
                type=typ or typ_up,
                step=int(steps[i]),
                layer=layer,
                severity=Severity.WARNING if up else Severity.INFO,
                message=f"{name} {'spike' if up else 'drop'}: robust z = {z[i]:.1f}",
                evidence=_ev(
                    value=float(x[i]), rolling_median=float(np.nanmedian(w)), z=float(z[i])
                ),
            )
        )
    return out


def anomalies(
    run: Run,
    thresholds: AnomalyThresholds | None = None,
    *,
    progress: ProgressCallback | None = None,
    cache: StatsCache | None = None,
) -> AnomalyReport:
    """Detect anomalies in ``run`` (see module docstring); sorted by step.

    Args:
        run: an open run (:func:`traintape.open_run`).
        thresholds: override the defaults of :class:`AnomalyThresholds`.
        progress: ``callback(stage, done, total)``; a unit is one row block of a stats
            array read (every kind), plus one for the detectors.
        cache: a shared stats cache (used by the report so that each array is read once).
    """
    th = thresholds or AnomalyThresholds()
    if cache is None:
        cache = StatsCache(run, Tracker(progress))
    tracker = cache.tracker
    tracker.add(cache.blocks() + 1)
    found: list[Anomaly] = []
    nonfinite = _nonfinite(run, cache)
    tracker.stage("detecting anomalies")
    found += nonfinite
    kinds = set(run.kinds())

    met = run.metrics()
    if th.loss_metric in met.columns:
        loss = met[th.loss_metric].to_numpy(dtype=np.float64)
        lsteps = met.index.to_numpy()
        found += _series_z("loss", lsteps, loss, th, "loss_spike", "loss_drop")
        fin = np.isfinite(loss)
        if fin.sum() > th.stall_window:
            tail = loss[fin][-th.stall_window :]
            scale = max(abs(tail[0]), 1e-12)
            rel = abs(tail[-1] - tail[0]) / scale
            if rel < th.stall_rel and abs(tail[-1]) > 1e-6:
                found.append(
                    Anomaly(
                        type="stalled",
                        step=int(lsteps[fin][-th.stall_window]),
                        severity=Severity.WARNING,
                        message=f"loss changed by {rel:.2g} (relative) over the last "
                        f"{th.stall_window} steps",
                        evidence=_ev(relative_change=rel, loss=float(tail[-1])),
                    )
                )

    if Kind.GRAD in kinds:
        steps, layers, g = layer_norms(run, Kind.GRAD, cache)
        with np.errstate(all="ignore"):
            lg = np.log10(np.where(g > 0, g, np.nan))
        for c, layer in enumerate(layers):
            found += _series_z(
                f"grad norm of {layer}", steps, lg[:, c], th, "grad_spike", None, layer
            )

    if Kind.UPDATE in kinds and Kind.PARAM in kinds:
        steps, ul, u = layer_norms(run, Kind.UPDATE, cache)
        _, pl, p = layer_norms(run, Kind.PARAM, cache)
        for layer in ul:
            if layer not in pl:
                continue
            with np.errstate(all="ignore"):
                r = u[:, ul.index(layer)] / p[:, pl.index(layer)]
            fin = np.isfinite(r)
            for label, mask in (
                ("high", fin & (r > th.update_ratio_high)),
                ("low", fin & (r < th.update_ratio_low) & (r >= 0)),
            ):
                if mask.any():
                    i = int(np.argmax(mask))
                    found.append(
                        Anomaly(
                            type="update_ratio",
                            step=int(steps[i]),
                            layer=layer,
                            severity=Severity.WARNING,
                            message=f"update/param ratio {label}: {r[i]:.3g} at {layer} "
                            f"({int(mask.sum())} steps out of range)",
                            evidence=_ev(
                                ratio=float(r[i]),
                                steps_out_of_range=int(mask.sum()),
                                median=float(np.median(r[fin])),
                            ),
                        )
                    )

    if Kind.ACTIVATION in kinds:
        steps, layers, zf = layer_stat(run, Kind.ACTIVATION, "zero_frac", "max", cache)
        for c, layer in enumerate(layers):
            col = zf[:, c]
            mask = np.nan_to_num(col) > th.dead_frac
            if not mask.any() or not float(np.nanmedian(col)) > th.dead_frac:
                continue
            i = int(np.argmax(mask))
            ev = _ev(zero_frac_first=float(col[i]), zero_frac_median=float(np.nanmedian(col)))
            dead_units = _dead_units(run, f"{layer}/output")
            if dead_units is not None:
                ev["dead_unit_frac"] = dead_units
            med = float(np.nanmedian(col))
            found.append(
                Anomaly(
                    type="dead_units",
                    step=int(steps[i]),
                    tensor=f"{layer}/output",
                    layer=layer,
                    kind=Kind.ACTIVATION,
                    severity=Severity.ERROR if med >= th.dead_frac_error else Severity.WARNING,
                    message=f"{layer}: {100 * med:.1f}% of activation values are zero (median)",
                    evidence=ev,
                )
            )
    tracker.advance()
    found.sort(key=lambda a: a.step)  # stable: keeps the non-finite priority order
    first = nonfinite[0] if nonfinite else None  # documented priority (kind flow, forward order)
    return AnomalyReport(url=run.url, anomalies=found, first_nonfinite=first, thresholds=th)


def _dead_units(run: Run, name: str) -> float | None:
    """Fraction of units (last axis) zero for every probe example in the last snapshot."""
    try:
        steps = run.snapshot_steps(name, Kind.ACTIVATION)
    except KeyError:
        return None
    if len(steps) == 0:
        return None
    a = run.snapshot(name, Kind.ACTIVATION, int(steps[-1]))
    if a.ndim < 1 or a.size == 0:
        return None
    flat = a.reshape(-1, a.shape[-1])
    return float((flat == 0).all(axis=0).mean())
