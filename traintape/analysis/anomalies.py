"""Anomalies over a run: where and when something went wrong.

Detectors (thresholds in :class:`AnomalyThresholds`, defaults in parentheses):

- ``nan`` / ``inf``: the first step with a non-finite value in any recorded tensor or
  metric, and the first tensor at that step. Within one step data flows
  param θ_t → activations → grads → update, so candidates are ordered by kind in that
  order, then by forward order of the layer (see :mod:`traintape.analysis._common`),
  then by name. One anomaly per (type, kind, tensor) at its first step.
- ``loss_spike`` / ``loss_drop``: robust rolling z-score of the loss against the
  preceding ``window`` (20) values above ``z`` (6) / below ``−z``:
  ``z_t = (x_t − median) / (1.4826·MAD + eps)`` over ``x_{t−w..t−1}``. Warm-up: a
  z-score counts only once ``min_history`` (20) finite values precede it. A spike is a
  **warning** when it climbs back at least ``spike_undo`` (0.5) of the way from the
  rolling median to the highest rolling median before it (it undoes that much of the
  progress); a smaller one — a noisy batch late in a converged run — is **info**. Drops
  are info.
- ``grad_spike``: the same z-score on log10 of each layer's gradient norm above ``z``
  (a warning only at ``grad_spike_factor`` (10) times the rolling median or more),
  graded the same way on the norms themselves.
- ``update_ratio``: per layer, steps where ``‖Δθ‖/‖θ‖`` leaves
  [``update_ratio_low`` (1e-7), ``update_ratio_high`` (0.1)]; reported at the first such
  step; a warning when out of range at ``update_ratio_frac`` (10%) of the layer's steps,
  else info.
- ``dead_units``: median activation zero fraction above ``dead_frac`` (0.9, warning; ``dead_frac_error``
  0.99, error); where activation snapshots exist, the fraction of units that are zero for
  every example of the probe batch is given as evidence.
- ``stalled``: the loss changed by less than ``stall_rel`` (1e-4, relative) over the last
  ``stall_window`` (20) steps while not near zero; a warning while the loss is above
  ``stall_progress`` (0.5) of its starting level, info once it fell below (converged).
- loss spikes the training recovers from at once (the median of the next
  ``spike_recover_steps`` (5) losses has a robust z below ``z / 2``) are info.
- ``memory_spike``: a system memory metric (``sys/rss_bytes``, ``sys/gpu_mem_allocated_bytes``,
  ``sys/gpu_mem_reserved_bytes``; :mod:`traintape.core.system`) jumps above its rolling
  median by more than ``memory_spike_frac`` (0.2) of it with robust z above ``z``, after
  the warm-up; one warning per episode (consecutive rows above), at its first step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import (
    KIND_RANK,
    FirstPositive,
    ProgressCallback,
    StatsCache,
    Tracker,
    column_median,
    finite_float,
    forward_rank,
    layer_norms,
    layer_of,
    layer_stat,
    natural_key,
    robust_z_median,
    tensor_rank,
)
from traintape.core.system import is_system
from traintape.schema import Kind, Severity

if TYPE_CHECKING:
    from traintape.core.reader import Run


class AnomalyThresholds(BaseModel):
    """Thresholds of the detectors (see the module docstring)."""

    window: int = Field(20, ge=1, description="rolling window of the z-scores (steps)")
    min_history: int = Field(
        20,
        ge=1,
        description="warm-up: a z-score counts only with this many finite values in the "
        "preceding window (at most `window`)",
    )
    z: float = Field(6.0, gt=0, description="|robust z| above this is a spike / drop")
    spike_undo: float = Field(
        0.5,
        ge=0,
        description="a spike is a warning when it climbs back at least this fraction of "
        "the way from the rolling median to the highest rolling median seen before; "
        "smaller spikes (a noisy batch late in a converged run) are info",
    )
    grad_spike_factor: float = Field(
        10.0,
        gt=0,
        description="a grad spike is a warning only when the norm is at least this many "
        "times its rolling median (healthy minibatch training has 2-4x spikes: corpus "
        "mlp_adam, lstm); smaller ones are info",
    )
    update_ratio_low: float = 1e-7
    update_ratio_frac: float = Field(
        0.1,
        ge=0,
        le=1,
        description="update_ratio is a warning when out of range at this fraction of the "
        "layer's steps at least; fewer (Adam's first step, a schedule's last steps at lr "
        "0: corpus gpt2_trainer) are info",
    )
    update_ratio_high: float = 0.1
    dead_frac: float = 0.9
    dead_frac_error: float = 0.99
    stall_window: int = Field(20, ge=2)
    stall_rel: float = 1e-4
    stall_progress: float = Field(
        0.5,
        gt=0,
        description="a stall is a warning only while the loss is above this fraction of "
        "its starting level (a converged run whose schedule ended is no stall: corpus "
        "encoder_warmup_cosine, 230x down); below, info",
    )
    spike_recover_steps: int = Field(
        5,
        ge=1,
        description="a warning loss spike the next this-many losses recover from at once "
        "(their median's robust z below z/2) is info",
    )
    loss_metric: str = "loss"
    memory_spike_frac: float = Field(
        0.2, gt=0, description="a memory spike exceeds the rolling median by this fraction"
    )


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

    def summary(self) -> str:
        """One line: ``none``, or counts by severity and by type, and the first
        non-finite value (what ``traintape demo`` and ``traintape anomalies`` print)."""
        if not self.anomalies:
            return "none"
        parts = []
        for sev in (Severity.ERROR, Severity.WARNING, Severity.INFO):
            found = [a for a in self.anomalies if a.severity == sev]
            if not found:
                continue
            by: dict[str, int] = {}
            for a in found:
                by[a.type] = by.get(a.type, 0) + 1
            name = {"error": "error", "warning": "warning", "info": "info"}[sev.value]
            plural = "s" if len(found) > 1 and sev != Severity.INFO else ""
            detail = ", ".join(f"{n} {t}" for t, n in sorted(by.items(), key=lambda x: -x[1]))
            parts.append(f"{len(found)} {name}{plural} ({detail})")
        if not any(a.severity in (Severity.ERROR, Severity.WARNING) for a in self.anomalies):
            parts.insert(0, "no errors or warnings")
        line = "; ".join(parts)
        f = self.first_nonfinite
        if f is not None:
            line += f"; first non-finite: step {f.step}, {f.kind.value if f.kind else 'metric'} {f.tensor}"
        return line


def _ev(**kw: Any) -> dict[str, Any]:
    return {k: finite_float(v) if isinstance(v, float | np.floating) else v for k, v in kw.items()}


def want_anomalies(run: Run, cache: StatsCache) -> None:
    """Declare the stats :func:`anomalies` reads (so a report loads them in one pass)."""
    for kind in run.kinds():
        for stat in ("nan_count", "inf_count"):
            cache.want_reducer(("first", kind, stat), FirstPositive(kind, stat))
    cache.want(Kind.GRAD, "l2", "norm")
    cache.want(Kind.PARAM, "l2", "norm")
    cache.want(Kind.UPDATE, "l2", "norm")
    cache.want(Kind.ACTIVATION, "zero_frac", "max")


def _nonfinite(run: Run, cache: StatsCache) -> list[Anomaly]:
    rank = forward_rank(run)
    out: list[tuple[tuple, Anomaly]] = []
    steps = run.steps
    for kind in run.kinds():
        names = run.tensor_names(kind)
        if not names:
            continue
        for typ, stat in (("nan", "nan_count"), ("inf", "inf_count")):
            first, at, count = cache.result(("first", kind, stat))
            for j in np.flatnonzero(first >= 0):
                r = int(first[j])
                name = names[j]
                a = Anomaly(
                    type=typ,
                    step=int(steps[r]),
                    tensor=name,
                    layer=layer_of(name),
                    kind=kind,
                    severity=Severity.ERROR,
                    message=f"first {typ.upper()} in {kind.value} {name} ({int(at[j])} values)",
                    evidence=_ev(count=int(at[j]), steps_affected=int(count[j])),
                )
                key = (a.step, KIND_RANK[kind], tensor_rank(rank, name), natural_key(name))
                out.append((key, a))
    for a in _metric_nonfinite(run):
        out.append(((a.step, 9, 0, natural_key(a.tensor or "")), a))
    out.sort(key=lambda x: x[0])
    return [a for _, a in out]


def _recovered(
    spikes: list[Anomaly], steps: np.ndarray, loss: np.ndarray, th: AnomalyThresholds
) -> list[Anomaly]:
    """Grade warning loss spikes by what followed: one the training recovered from at
    once — the median of the next ``spike_recover_steps`` (5) losses no longer a spike
    (its robust z against the same rolling median and spread below ``z / 2``) — is info
    (a hard batch; corpus ``gru``: one step at 7.7x); a spike the loss stays up after
    stays a warning."""
    pos = {int(s): i for i, s in enumerate(np.asarray(steps).tolist())}
    for a in spikes:
        if a.type != "loss_spike" or a.severity != Severity.WARNING or a.step not in pos:
            continue
        after = loss[pos[a.step] + 1 : pos[a.step] + 1 + th.spike_recover_steps]
        after = after[np.isfinite(after)]
        base, value, z = (a.evidence.get(k) for k in ("rolling_median", "value", "z"))
        if len(after) < th.spike_recover_steps or not (base and value and z):
            continue
        spread = (value - base) / z  # the robust scale the spike's z was measured with
        if spread > 0 and (float(np.median(after)) - base) / spread < th.z / 2:
            a.severity = Severity.INFO
            a.message += f" (recovered: the next {len(after)} losses are back at the median)"
    return spikes


def _metric_nonfinite(run: Run) -> list[Anomaly]:
    """The first NaN / Inf *recorded* in each user metric.

    A metric not logged at a step is missing there — its column holds the fill value
    NaN, which says nothing (HF's Trainer logs ``train/total_flos`` only at the end) — so
    NaN comes from the NaN/Inf events the Recorder writes when a non-finite value is
    logged (:class:`traintape.core.rows.NonfiniteEvents`); Inf, which no fill value
    produces, also from the column itself. System metrics (``sys/*``: traintape's own
    timings and memory) are never errors."""
    found: dict[tuple[str, str], Anomaly] = {}
    logged = set(run.manifest.metrics)
    for e in run.events():
        name = e.tensor
        if (e.kind is not None or name is None or name not in logged or is_system(name)
                or e.type not in ("nan", "inf")):  # fmt: skip
            continue
        key = (str(e.type), name)
        if key not in found or e.step < found[key].step:
            found[key] = Anomaly(type=str(e.type), step=int(e.step), tensor=f"metric:{name}",
                                 severity=Severity.ERROR,
                                 message=f"first {str(e.type).upper()} in metric {name}",
                                 evidence=_ev(**{k: v for k, v in e.data.items()}))  # fmt: skip
    met = run.metrics()
    for c in met.columns:
        col = met[c].to_numpy(dtype=np.float64)
        mask = np.isinf(col)
        if mask.any() and ("inf", c) not in found:
            i = int(np.argmax(mask))
            found[("inf", c)] = Anomaly(type="inf", step=int(met.index[i]), tensor=f"metric:{c}",
                                        severity=Severity.ERROR,
                                        message=f"first INF in metric {c}",
                                        evidence=_ev(steps_affected=int(mask.sum())))  # fmt: skip
    return sorted(found.values(), key=lambda a: a.step)


def _series_z(
    what: list[str],
    steps: np.ndarray,
    x: np.ndarray,
    th: AnomalyThresholds,
    typ_up: str,
    typ_down: str | None,
    layers: list[str | None] | None = None,
    *,
    log: bool = False,
    min_factor: float = 0.0,
    max_values: int = 4 << 20,
) -> list[Anomaly]:
    """Spikes (and drops) of the columns of ``x [rows, col]`` (``what[c]`` names column
    c): robust z against the preceding window, after the warm-up (``log``: ``x`` holds
    log10 values; evidence and the warning rule use the values themselves). A spike is
    a warning when it climbs back at least ``spike_undo`` of the way from the rolling
    median to the highest rolling median before it, else info. Vectorised over the
    columns, in groups of at most ``max_values`` values."""
    out: list[Anomaly] = []
    n_rows = x.shape[0]
    if n_rows == 0 or x.shape[1] == 0:
        return out
    step = max(1, max_values // n_rows)
    for c0 in range(0, x.shape[1], step):
        xb = np.asarray(x[:, c0 : c0 + step], dtype=np.float64)
        z, med = robust_z_median(xb, th.window, th.min_history)
        hit = np.abs(np.nan_to_num(z)) > th.z
        if typ_down is None:
            hit &= z > 0
        if not hit.any():
            continue
        # how far back towards the highest level seen before does a spike climb?
        lin = np.power(10.0, med) if log else med
        peak = np.fmax.accumulate(np.where(np.isnan(lin), -np.inf, lin), axis=0)
        for i, c in zip(*np.nonzero(hit), strict=True):
            up = bool(z[i, c] > 0)
            value = float(10.0 ** xb[i, c]) if log else float(xb[i, c])
            base = float(lin[i, c])
            undo = (value - base) / (peak[i, c] - base) if peak[i, c] > base else float("inf")
            warn = up and undo >= th.spike_undo and (base <= 0 or value >= min_factor * base)
            kind_of = "spike" if up else "drop"
            out.append(
                Anomaly(
                    type=typ_up if up else (typ_down or typ_up),
                    step=int(steps[i]),
                    layer=None if layers is None else layers[c0 + c],
                    severity=Severity.WARNING if warn else Severity.INFO,
                    message=f"{what[c0 + c]} {kind_of}: robust z = {z[i, c]:.1f}, "
                    f"{value / base if base else float('inf'):.3g}x the rolling median"
                    + ("" if not up or warn else f" (back {100 * undo:.0f}% of the way to "
                       "the earlier level: minor)"),
                    evidence=_ev(
                        value=value, rolling_median=base, z=float(z[i, c]),
                        undo_frac=float(undo) if up else None,
                    ),
                )
            )  # fmt: skip
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
    want_anomalies(run, cache)
    tracker.add(cache.pending_blocks() + 1)
    cache.load()
    found: list[Anomaly] = []
    nonfinite = _nonfinite(run, cache)
    tracker.stage("detecting anomalies")
    found += nonfinite
    kinds = set(run.kinds())

    met = run.metrics()
    if th.loss_metric in met.columns:
        loss = met[th.loss_metric].to_numpy(dtype=np.float64)
        lsteps = met.index.to_numpy()
        logged = ~np.isnan(loss)  # NaN: not logged at that row (a logged NaN is evented)
        loss, lsteps = loss[logged], lsteps[logged]
        found += _recovered(
            _series_z(["loss"], lsteps, loss[:, None], th, "loss_spike", "loss_drop"),
            lsteps, loss, th,
        )  # fmt: skip
        fin = np.isfinite(loss)
        if fin.sum() > th.stall_window:
            tail = loss[fin][-th.stall_window :]
            scale = max(abs(tail[0]), 1e-12)
            rel = abs(tail[-1] - tail[0]) / scale
            head = float(np.median(loss[fin][: th.stall_window]))
            progress = abs(tail[-1]) < th.stall_progress * abs(head)
            if rel < th.stall_rel and abs(tail[-1]) > 1e-6:
                found.append(
                    Anomaly(
                        type="stalled",
                        step=int(lsteps[fin][-th.stall_window]),
                        severity=Severity.INFO if progress else Severity.WARNING,
                        message=f"loss changed by {rel:.2g} (relative) over the last "
                        f"{th.stall_window} steps",
                        evidence=_ev(relative_change=rel, loss=float(tail[-1])),
                    )
                )

    if Kind.GRAD in kinds:
        steps, layers, g = layer_norms(run, Kind.GRAD, cache)
        lg = np.empty(g.shape, dtype=np.float32 if g.dtype == np.float32 else np.float64)
        with np.errstate(all="ignore"):
            np.log10(g, out=lg, where=g > 0)
        lg[~(g > 0)] = np.nan
        spikes = _series_z(
            [f"grad norm of {x}" for x in layers], steps, lg, th, "grad_spike", None,
            list(layers), log=True, min_factor=th.grad_spike_factor,
        )  # fmt: skip
        del lg
        found += _spike_consequence(run, cache, spikes, found, th)

    if Kind.UPDATE in kinds and Kind.PARAM in kinds:
        steps, ul, u = layer_norms(run, Kind.UPDATE, cache)
        _, pl, p = layer_norms(run, Kind.PARAM, cache)
        pcol = {x: i for i, x in enumerate(pl)}
        for c, layer in enumerate(ul):
            if layer not in pcol:
                continue
            with np.errstate(all="ignore"):
                r = np.asarray(u[:, c], dtype=np.float64) / p[:, pcol[layer]]
            fin = np.isfinite(r)
            for label, mask in (
                ("high", fin & (r > th.update_ratio_high)),
                ("low", fin & (r < th.update_ratio_low) & (r >= 0)),
            ):
                if mask.any():
                    i = int(np.argmax(mask))
                    sustained = mask.sum() >= th.update_ratio_frac * max(int(fin.sum()), 1)
                    found.append(
                        Anomaly(
                            type="update_ratio",
                            step=int(steps[i]),
                            layer=layer,
                            severity=Severity.WARNING if sustained else Severity.INFO,
                            message=f"update/param ratio {label}: {r[i]:.3g} at {layer} "
                            f"({int(mask.sum())} steps out of range)",
                            evidence=_ev(
                                ratio=float(r[i]),
                                steps_out_of_range=int(mask.sum()),
                                median=float(np.median(r[fin])),
                            ),
                        )
                    )

    found += _memory_spikes(run, th)

    if Kind.ACTIVATION in kinds:
        steps, layers, zf = layer_stat(run, Kind.ACTIVATION, "zero_frac", "max", cache)
        meds = column_median(zf)
        for c, layer in enumerate(layers):
            col = zf[:, c]
            mask = np.nan_to_num(col) > th.dead_frac
            med = float(meds[c])
            if not mask.any() or not med > th.dead_frac:
                continue
            i = int(np.argmax(mask))
            ev = _ev(zero_frac_first=float(col[i]), zero_frac_median=med)
            dead_units = _dead_units(run, f"{layer}/output")
            if dead_units is not None:
                ev["dead_unit_frac"] = dead_units
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


_MEMORY = ("sys/rss_bytes", "sys/gpu_mem_allocated_bytes", "sys/gpu_mem_reserved_bytes")


def _spike_consequence(
    run: Run, cache: StatsCache, spikes: list[Anomaly], found: list[Anomaly], th: AnomalyThresholds
) -> list[Anomaly]:
    """Grade warning gradient spikes by what they did to training: one stays a warning
    when the loss reacts (a warning ``loss_spike`` within ``window`` steps from it) or
    the layer's update/param ratio at that step is above ``update_ratio_high`` (it threw
    the weights); otherwise it is info — healthy minibatch training has gradient bursts
    an optimizer absorbs (corpus: ``bert_from_init`` grows its gradient 15x while the
    loss starts to fall, ``mlp_adam`` and ``lstm`` have 2-4x spikes). Without a logged
    loss only the update rule applies; without ``update`` either, spikes stay as graded."""
    warn = [a for a in spikes if a.severity == Severity.WARNING]
    if not warn:
        return spikes
    loss_steps = np.asarray(sorted(a.step for a in found if a.type == "loss_spike"
                                   and a.severity == Severity.WARNING), np.int64)  # fmt: skip
    has_loss = th.loss_metric in run.metrics().columns
    kinds = set(run.kinds())
    ratio_at: dict[tuple[str, int], float] = {}
    if Kind.UPDATE in kinds and Kind.PARAM in kinds:
        steps, ul, u = layer_norms(run, Kind.UPDATE, cache)
        _, pl, p = layer_norms(run, Kind.PARAM, cache)
        ucol, pcol = {x: i for i, x in enumerate(ul)}, {x: i for i, x in enumerate(pl)}
        row = {int(s): i for i, s in enumerate(np.asarray(steps).tolist())}
        for a in warn:
            if a.layer in ucol and a.layer in pcol and a.step in row:
                i = row[a.step]
                with np.errstate(all="ignore"):
                    ratio_at[(a.layer, a.step)] = float(u[i, ucol[a.layer]] / p[i, pcol[a.layer]])
    elif not has_loss:
        return spikes
    for a in warn:
        near = bool(len(loss_steps)) and bool((np.abs(loss_steps - a.step) <= th.window).any())
        r = ratio_at.get((a.layer or "", a.step), float("nan"))
        if near or (np.isfinite(r) and r > th.update_ratio_high):
            continue
        if not has_loss and not np.isfinite(r):
            continue
        a.severity = Severity.INFO
        a.message += " (the loss did not react and the weights moved normally: absorbed)"
    return spikes


def _memory_spikes(run: Run, th: AnomalyThresholds) -> list[Anomaly]:
    """``memory_spike`` anomalies of the system memory metrics (see module docstring)."""
    sysm = run.system()
    out: list[Anomaly] = []
    for name in (n for n in _MEMORY if n in sysm.columns):
        x = sysm[name].to_numpy(dtype=np.float64)
        z, med = robust_z_median(x[:, None], th.window, th.min_history)
        z, med = z[:, 0], med[:, 0]
        with np.errstate(invalid="ignore"):
            hit = (np.nan_to_num(z) > th.z) & (x > med * (1.0 + th.memory_spike_frac))
        starts = np.flatnonzero(hit & ~np.concatenate(([False], hit[:-1])))
        for i in starts:
            end = i
            while end + 1 < len(hit) and hit[end + 1]:
                end += 1
            out.append(
                Anomaly(
                    type="memory_spike",
                    step=int(sysm.index[i]),
                    severity=Severity.WARNING,
                    message=f"{name} jumped to {x[i] / 2**20:.0f} MiB, "
                    f"{x[i] / med[i]:.2f}x its rolling median ({med[i] / 2**20:.0f} MiB), "
                    f"for {end - i + 1} row(s)",
                    evidence=_ev(
                        metric=name, value=float(x[i]), rolling_median=float(med[i]),
                        z=float(z[i]), rows=int(end - i + 1),
                        peak=float(np.max(x[i : end + 1])),
                    ),
                )
            )  # fmt: skip
    return out


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


class AnomaliesAnalysis:
    """:func:`anomalies` as an :class:`~traintape.analysis.protocol.Analysis`."""

    name = "anomalies"

    def __init__(self, thresholds: AnomalyThresholds | None = None) -> None:
        self.thresholds = thresholds

    def wants(self, cache: StatsCache) -> None:
        want_anomalies(cache.run, cache)

    def compute(self, cache: StatsCache) -> AnomalyReport:
        return anomalies(cache.run, self.thresholds, cache=cache)
