"""A run's summary, computed once: what the HTML report and the Markdown summary show.

:func:`summarize` runs the analyses through the one driver
(:func:`~traintape.analysis.protocol.run_analyses`: health, anomalies and, for the HTML
report, health over time — every stats array read once), the parameter change, and the
report's figures; the renderers (:func:`~traintape.analysis.report.to_html`,
:func:`~traintape.analysis.report.to_markdown`) are pure functions of the
:class:`RunSummary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from traintape.analysis import report_figures as F
from traintape.analysis._common import ProgressCallback, StatsCache, Tracker, layer_norms
from traintape.analysis.anomalies import AnomaliesAnalysis, AnomalyReport
from traintape.analysis.change import (
    ParameterChange,
    change_from_stats,
    param_snapshot_steps,
    parameter_change,
)
from traintape.analysis.health import HealthAnalysis, HealthReport
from traintape.analysis.health_trend import HealthTrend, HealthTrendAnalysis, default_window
from traintape.analysis.protocol import Analysis, run_analyses
from traintape.schema import Kind

if TYPE_CHECKING:
    from traintape.core.reader import Run

TREND_WINDOWS = 10
"""About how many windows the report's health over time has."""
FIGURES = ("metrics", "grad_heatmap", "ratio_heatmap", "weights", "change")
"""The figures of the HTML report (each one progress unit); ``system`` is drawn with
the anomalies (its memory spikes) and counted with them."""


@dataclass
class RunSummary:
    """Everything a report shows, computed once (module docstring).

    ``info``: the run table (label, text); ``figures``: PNG data URIs by name (None:
    nothing to draw; empty when not asked for); ``change``: parameter change between
    param snapshots (None: fewer than two)."""

    run_id: str
    url: str
    info: list[tuple[str, str]]
    health: HealthReport
    anomalies: AnomalyReport
    trend: HealthTrend | None = None
    change: ParameterChange | None = None
    figures: dict[str, str | None] = field(default_factory=dict)
    single_metrics: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Metrics logged at one step only: ``{name: (step, value)}`` (no curve for them)."""


def run_info(run: Run) -> list[tuple[str, str]]:
    """The run table: store, run id, status, producer, steps, tensors, metrics, events."""
    m, p = run.manifest, run.manifest.producer
    steps = run.steps
    span = f"{int(steps[0])}..{int(steps[-1])}" if len(steps) else "none"
    return [
        ("store", run.url), ("run id", m.run_id), ("status", m.status),
        ("producer", f"{p.framework or 'numpy'} {p.framework_version or ''} "
                     f"({p.adapter or 'Recorder'})"),
        ("steps", f"{run.rows} rows, steps {span}"),
        ("tensors", ", ".join(f"{k.value}: {len(run.tensor_names(k))}" for k in run.kinds())),
        ("metrics", ", ".join(m.metrics) or "none"), ("events", str(len(m.events))),
    ]  # fmt: skip


def summarize(
    run: Run,
    *,
    figures: bool = False,
    tensors: str | None = None,
    progress: ProgressCallback | None = None,
) -> RunSummary:
    """The summary of ``run``. ``figures``: also health over time, every parameter-change
    pair (at most 20) and the report's figures (the HTML report); without, the change
    from the first to the last param snapshot (the Markdown summary). ``tensors``: an
    ``fnmatch`` pattern choosing the tensors whose grad and param distributions over time
    the figures draw from snapshots (default: the kernels).

    ``progress(stage, done, total)``: a unit is one row block of a stats array read (each
    once, shared by every part), one figure, one analysis (health, anomalies) and one
    tensor of a snapshot pair (parameter change)."""
    tracker = Tracker(progress)
    cache = StatsCache(run, tracker)
    analyses: list[Analysis] = [HealthAnalysis(), AnomaliesAnalysis()]
    if figures:
        window = default_window(run.steps, TREND_WINDOWS)
        analyses.append(HealthTrendAnalysis(window))
        F.want_weights(run, cache)  # read in the analyses' one pass
        tracker.add(len(FIGURES))
    res = run_analyses(run, analyses, cache=cache)
    figs = _figures(run, cache, tensors) if figures else {}
    h, an = res["health"], res["anomalies"]
    pc: ParameterChange | None = None
    if figures:
        figs["system"] = F.system_fig(run, an)
        pc = parameter_change(run, max_pairs=20, progress=tracker.child(), cache=cache)
        steps, layers, ratio = change_from_stats(run, cache)
        figs["change"] = F.change_fig(steps, layers, ratio)
        tracker.advance()
    else:
        snaps = param_snapshot_steps(run)
        if len(snaps) >= 2:
            pc = parameter_change(run, steps=(snaps[0], snaps[-1]), cache=cache,
                                  progress=tracker.child())  # fmt: skip
    tracker.finish()
    return RunSummary(run_id=run.manifest.run_id, url=run.url, info=run_info(run), health=h,
                      anomalies=an, trend=res.get("health_trend"), change=pc, figures=figs,
                      single_metrics=F.single_metrics(run))  # fmt: skip


def _figures(run: Run, cache: StatsCache, tensors: str | None) -> dict[str, str | None]:
    """The stats figures (metrics, the grad-norm heatmap and lines, the ratio heatmap,
    weights, value distributions from snapshots), one progress unit per kind of figure."""
    tracker = cache.tracker
    tracker.stage("figures")
    out: dict[str, str | None] = {"metrics": F.metrics_fig(run)}
    tracker.advance()
    out["grad_heatmap"] = None
    if Kind.GRAD in run.kinds() and run.rows:
        s, layers, g = layer_norms(run, Kind.GRAD, cache)
        out["grad_heatmap"] = F.heatmap(s, layers, g, "gradient L2 norm (log10), layer × step")
        out["grad_lines"] = F.grad_norm_lines_fig(s, layers, g)
    tracker.advance()
    s, layers, r = change_from_stats(run, cache)
    out["ratio_heatmap"] = (
        F.heatmap(s, layers, r, "‖update‖/‖param‖ (log10), layer × step")
        if layers and run.rows and np.size(r) else None
    )  # fmt: skip
    tracker.advance()
    out["weights"] = F.weights_fig(run, cache)
    for kind in (Kind.GRAD, Kind.PARAM):
        out[f"{kind.value}_distribution"] = F.distribution_fig(
            run, kind, F.pick_tensors(run, kind, tensors)
        )
    tracker.advance()
    return out


__all__ = ["FIGURES", "TREND_WINDOWS", "RunSummary", "run_info", "summarize"]
