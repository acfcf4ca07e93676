"""Analyses over run stores (framework-free; read through :func:`traintape.open_run`).

- :func:`health` — gradient-flow health per layer (VANISHING, EXPLODING, DEAD, ...);
  :func:`health_trend` — the same per window of steps (plus TURBULENT, PRESSURE_SPIKE,
  ACCELERATING); :func:`health_against` / :func:`compare_health` — per layer, is a run
  improved, degraded or unchanged against a baseline?
- :func:`architecture` — architecture-aware checks (bottlenecks, residual stream growth or
  decay, attention vs FFN and per-head gradient balance, recurrent gates); part of
  :func:`health`.
- :func:`anomalies` — NaN/Inf first seen, loss and gradient spikes, dead units, stalls.
- :func:`parameter_change` / :func:`change_from_stats` — how much parameters moved;
  :func:`lora_delta` — a LoRA run's effective update ΔW = s·A·B per adapted layer.
- :func:`sparse_update_quality` / :func:`sparse_update_from_run` — would a sparse update
  have done the same?
- :func:`compare` — are two runs identical; which tensor diverged first.
- :func:`write_report` — one self-contained HTML report; :func:`render_markdown` — a
  Markdown summary to paste into an issue tracker.
- :func:`check` / :func:`metric` (:mod:`~traintape.analysis.registry`) — register a user
  check over a run (or install one under the entry-point group ``traintape.checks``);
  :func:`run_checks` runs them, and so do :func:`health` and the reports.
- :func:`export` — Parquet / CSV / NPZ; :func:`export_tensorboard` / :func:`export_wandb`
  — a TensorBoard event file / an offline W&B run (scalars, metrics, histograms).
"""

from traintape.analysis.anomalies import Anomaly, AnomalyReport, AnomalyThresholds, anomalies
from traintape.analysis.architecture import (
    ArchitectureReport,
    ArchitectureThresholds,
    architecture,
)
from traintape.analysis.bridges import export_tensorboard, export_wandb
from traintape.analysis.change import (
    LoraDelta,
    ParameterChange,
    change_from_stats,
    lora_delta,
    parameter_change,
)
from traintape.analysis.compare import DEFAULT_TOLERANCES, CompareReport, Tolerance, compare
from traintape.analysis.export import export
from traintape.analysis.health import health
from traintape.analysis.health_compare import (
    HealthComparison,
    IssueChange,
    LayerComparison,
    MeasureChange,
    NoSharedLayersError,
    Verdict,
    compare_health,
    health_against,
)
from traintape.analysis.health_model import (
    HealthReport,
    HealthThresholds,
    LayerHealth,
    LoraHealth,
)
from traintape.analysis.health_trend import (
    HealthTrend,
    LayerTrend,
    StatusChange,
    StepWindow,
    TrendIssue,
    health_trend,
)
from traintape.analysis.issues import (
    Issue,
    IssueType,
    Recommendation,
    Severity,
    Status,
    recommendations,
)
from traintape.analysis.registry import (
    CheckIssue,
    CheckResult,
    check,
    metric,
    run_checks,
)
from traintape.analysis.registry import register as register_check
from traintape.analysis.report import render_markdown, render_report, write_report
from traintape.analysis.sparse import (
    OutputAgreement,
    SparseUpdateQuality,
    sparse_update_from_run,
    sparse_update_quality,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "Anomaly",
    "AnomalyReport",
    "AnomalyThresholds",
    "ArchitectureReport",
    "ArchitectureThresholds",
    "CheckIssue",
    "CheckResult",
    "CompareReport",
    "HealthComparison",
    "HealthReport",
    "HealthThresholds",
    "HealthTrend",
    "Issue",
    "IssueChange",
    "IssueType",
    "LayerComparison",
    "LayerHealth",
    "LayerTrend",
    "LoraDelta",
    "LoraHealth",
    "MeasureChange",
    "NoSharedLayersError",
    "OutputAgreement",
    "ParameterChange",
    "Recommendation",
    "Severity",
    "SparseUpdateQuality",
    "Status",
    "StatusChange",
    "StepWindow",
    "Tolerance",
    "TrendIssue",
    "Verdict",
    "anomalies",
    "architecture",
    "change_from_stats",
    "check",
    "compare",
    "compare_health",
    "export",
    "export_tensorboard",
    "export_wandb",
    "health",
    "health_against",
    "health_trend",
    "lora_delta",
    "metric",
    "parameter_change",
    "recommendations",
    "register_check",
    "render_markdown",
    "render_report",
    "run_checks",
    "sparse_update_from_run",
    "sparse_update_quality",
    "write_report",
]
