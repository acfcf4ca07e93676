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
SATURATED, DECAY_WITH_DEPTH, LAYER_IMBALANCE, ATTENTION_QKV_IMBALANCE; the architecture
checks of :mod:`~traintape.analysis.architecture` (BOTTLENECK, RESIDUAL_DECAY,
ATTENTION_FFN_IMBALANCE, ATTENTION_HEAD_IMBALANCE, GATE_SATURATION, FORGET_GATE_CLOSED,
over the whole run, their measures in :attr:`HealthReport.architecture`); per window of
steps (:mod:`~traintape.analysis.health_trend`) also TURBULENT, PRESSURE_SPIKE and
ACCELERATING. A layer's score is ``100 − Σ penalties`` (critical 60, warning 25, floored
at 0); status is ``critical`` with any critical issue, ``warning`` with any warning, else
``healthy``. :mod:`~traintape.analysis.health_compare` compares two runs' health.

**Frozen layers.** In a run that records gradients, a layer whose tensors are recorded as
``param`` but none as ``grad`` is *frozen* (``requires_grad=False``: a LoRA/PEFT base
model, a frozen encoder): the adapters record no gradient for it on purpose. It is
listed in :attr:`HealthReport.frozen` and marked :attr:`LayerHealth.frozen`, carries no
penalty, and is never VANISHING, DEAD or EXPLODING (SATURATED, an activation rule, still
applies). A gradient recorded as exact zeros is not frozen — that is DEAD (e.g. a
``detach`` by mistake). A layer with some tensors frozen is judged on its trainable ones.

**LoRA factors** (layer kind ``lora``: ``<layer>/lora_A``, ``<layer>/lora_B``, see
:func:`~traintape.analysis.change.lora_pairs`) are judged as parts of the layer they
adapt, whose weight is ``W = W_base + s·A·B``, not by their own ratios: ``B`` starts at
exactly 0 (an embedding adapter's ``A``), so ``‖ΔB‖/‖B‖`` is about ``1/t`` under Adam
whatever the learning rate and ``‖g_B‖/‖B‖`` is unbounded early, and ``A``'s gradient
``s·g_W·Bᵀ`` is proportional to ``B``. Per step, with ``u`` the update, ``g`` the
gradient and Frobenius norms (:class:`LoraHealth`, medians over steps):

- effective update ratio of ``A``: ``s·‖u_A‖·(‖B‖ + ‖u_B‖) / ‖W_base‖``, of ``B``:
  ``s·‖A‖·‖u_B‖ / ‖W_base‖`` — they add up to an upper bound of
  ``‖Δ(s·A·B)‖ / ‖W_base‖``, the step's relative change of the layer's effective weight
  (``A'B' − AB = u_A·B' + A·u_B``). It replaces ``update_ratio`` in the EXPLODING ratio
  rule; without a recorded base weight the rule is skipped for the factors (their own
  ratio is no measure: the zero-initialised factor — ``B``, or ``A`` of an embedding
  adapter — has a huge one, and with PEFT's ``A`` init ``‖u_A‖/‖A‖`` starts near
  ``lr·√(3·in)`` under Adam: 0.11 at lr 1e-3 on a 4096-wide layer).
- effective relative gradient: ``‖g_A‖ / (s·‖B‖·‖W_base‖)`` and
  ``‖g_B‖ / (s·‖A‖·‖W_base‖)``, each a lower bound of ``‖∂L/∂W‖ / ‖W_base‖`` (since
  ``g_A = s·g_W·Bᵀ``, ``g_B = s·Aᵀ·g_W``; undefined at steps where the partner is 0). The
  relative VANISHING rule compares a factor with the largest of the *same* factor of the
  other adapters (A with A, B with B: the two bounds are not equally tight), never with
  other layers, and LoRA factors are never the reference of other layers; the absolute
  rule (``vanishing_abs``) is unchanged. DECAY_WITH_DEPTH and LAYER_IMBALANCE are judged
  separately among other layers, among ``lora_A`` factors and among ``lora_B`` factors
  (with the effective measures).
- the EXPLODING growth rule reads the growth of ``‖g‖ / ‖partner‖``.

``s`` is PEFT's scaling from :func:`~traintape.analysis.change.lora_scale` (1 when the run
does not say: then the effective ratios are up to the scale); ``‖W_base‖`` is the base
layer's param norm (its median over the run: frozen weights are read only at some steps).
Non-finite gradients, the gradient-norm limit and DEAD (exactly zero gradients) apply to
factors as to any layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
from traintape.analysis.architecture import (
    ArchitectureReport,
    ArchitectureThresholds,
    architecture,
)
from traintape.analysis.change import LoraPair, lora_pairs, lora_scale, qkv_groups
from traintape.analysis.registry import CheckResult, run_checks
from traintape.schema import Kind

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
    TURBULENT = "TURBULENT"
    PRESSURE_SPIKE = "PRESSURE_SPIKE"
    ACCELERATING = "ACCELERATING"
    BOTTLENECK = "BOTTLENECK"
    RESIDUAL_DECAY = "RESIDUAL_DECAY"
    ATTENTION_FFN_IMBALANCE = "ATTENTION_FFN_IMBALANCE"
    ATTENTION_HEAD_IMBALANCE = "ATTENTION_HEAD_IMBALANCE"
    GATE_SATURATION = "GATE_SATURATION"
    FORGET_GATE_CLOSED = "FORGET_GATE_CLOSED"


class Status(StrEnum):
    HEALTHY = "healthy"
    WARNING = "warning"
    CRITICAL = "critical"


class HealthThresholds(ArchitectureThresholds):
    """Documented, configurable thresholds (defaults in parentheses); the fields of
    :class:`~traintape.analysis.architecture.ArchitectureThresholds` (``bottleneck_ratio``,
    ``residual_factor``, ``head_ratio``, ``forget_bias_closed``, ...) are fields here too.

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

    Judged per window of steps only (:func:`~traintape.analysis.health_trend`; over a
    whole run the trend of the gradient norm would dominate them):

    - ``turbulence`` (1.0): a grad-norm coefficient of variation (std/mean over the
      window's steps) above this is TURBULENT (warning).
    - ``pressure_spike`` (10): a ``max_pressure`` (largest per-step grad/param norm ratio
      of the window) above this many times the window's median ``rel_grad`` is
      PRESSURE_SPIKE (warning).
    - ``accelerating_growth`` (10) / ``accelerating_t`` (3): a growing grad norm (positive
      ``velocity``, d ln‖g‖/d step) whose growth rate rises within the window so much that
      at its end the norm grows this factor more per window than at its start, with the
      fit's curvature at least ``accelerating_t`` standard errors from 0, is ACCELERATING
      (warning).

    TURBULENT and PRESSURE_SPIKE are not raised for a layer EXPLODING in that window.
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
    turbulence: float = 1.0
    pressure_spike: float = 10.0
    accelerating_growth: float = 10.0
    accelerating_t: float = 3.0
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


class LoraHealth(BaseModel):
    """How a LoRA factor layer is judged: as part of the layer it adapts (module docstring)."""

    part: str = Field(description="lora_A or lora_B")
    adapted: str = Field(description="the adapted layer (LoraPair.key)")
    scale: float = Field(description="s of ΔW = s·A·B (1.0 when unknown)")
    scale_source: str | None = Field(None, description="see change.lora_scale; None: unknown")
    rel_grad: float | None = Field(
        None, description="median ‖g‖ / (s·‖partner‖·‖W_base‖), a lower bound of ‖g_W‖/‖W_base‖"
    )
    update_ratio: float | None = Field(
        None, description="median of this factor's share of ‖Δ(s·A·B)‖ / ‖W_base‖ per step"
    )
    grad_growth: float | None = Field(
        None, description="last-quarter / first-quarter ‖g‖ / ‖partner‖"
    )


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
    frozen: bool = Field(False, description="param recorded, no grad: frozen, not judged")
    lora: LoraHealth | None = Field(None, description="LoRA factors: the effective measures")
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
    frozen: list[str] = Field(
        default_factory=list,
        description="frozen layers (param without grad, e.g. a LoRA base model): not judged",
    )
    architecture: ArchitectureReport | None = Field(
        None, description="measures of the architecture checks (blocks, heads, gates, ...)"
    )
    checks: list[CheckResult] = Field(
        default_factory=list,
        description="registered user checks (traintape.analysis.registry); their issues "
        "count towards status, not score",
    )

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
    IssueType.TURBULENT: "the gradient norm swings widely from step to step: lower the "
    "learning rate, increase the batch size (or accumulate gradients), add gradient "
    "clipping, or raise Adam's epsilon",
    IssueType.PRESSURE_SPIKE: "a few steps push this layer's weights far harder than the "
    "rest: clip gradients (global or per-layer norm), look for outlier batches at those "
    "steps, or lower the learning rate (with warm-up, if the spikes come first thing)",
    IssueType.ACCELERATING: "the gradient norm grows faster and faster, heading for "
    "divergence: lower the (peak) learning rate or lengthen warm-up, add gradient "
    "clipping, and check the loss scale",
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
    """Per window of rows and layer of the grad kind: non-finite values (NaN + Inf), rows
    at which every gradient tensor of the layer is exactly zero, and rows recorded.

    ``starts``: the first row of each window, increasing (default: one window, all rows).
    ``value = (nonfinite [window, layer], zero_rows [window, layer], recorded_rows
    [window, layer])``."""

    kind = Kind.GRAD

    def __init__(self, starts: np.ndarray | None = None) -> None:
        self.starts = np.zeros(1, np.intp) if starts is None else np.asarray(starts, np.intp)

    def begin(self, cache: StatsCache) -> None:
        self.groups = cache.groups(Kind.GRAD)
        self.cols = [stat_index(cache.run, s) for s in ("nan_count", "inf_count", "zero_frac")]
        shape = (len(self.starts), len(self.groups.layers))
        self.value = (np.zeros(shape), np.zeros(shape, dtype=np.int64),
                      np.zeros(shape, dtype=np.int64))  # fmt: skip

    def update(self, start: int, block: np.ndarray) -> None:
        nonfinite, zero_rows, recorded = self.value
        wid = np.searchsorted(self.starts, start + np.arange(len(block)), side="right") - 1
        seg = np.flatnonzero(np.diff(wid, prepend=-1))  # first block row of each window
        win = wid[seg]
        nf = self.groups.reduce(block[:, :, self.cols[0]] + block[:, :, self.cols[1]], "sum")
        nonfinite[win] += np.add.reduceat(np.where(np.isnan(nf), 0.0, nf), seg, axis=0)
        zmin = self.groups.reduce(block[:, :, self.cols[2]], "min")  # NaN: not recorded
        rec = ~np.isnan(zmin)
        recorded[win] += np.add.reduceat(rec, seg, axis=0, dtype=np.int64)
        zero_rows[win] += np.add.reduceat(rec & (zmin >= 1.0), seg, axis=0, dtype=np.int64)


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


def _ratio_reduce(
    a: np.ndarray | None,
    a_layers: list[str],
    b: np.ndarray | None,
    b_layers: list[str],
    layers: list[str],
    reduce: Callable[[np.ndarray], np.ndarray] = column_median,
) -> np.ndarray:
    """Per layer of ``layers``: ``reduce`` (default: median) over rows of
    ``a[:, layer] / b[:, layer]`` (NaN where either series lacks the layer)."""  # fmt: skip
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
        out[[p[0] for p in grp]] = reduce(_ratio(a[:, ia], b[: a.shape[0], ib]))
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


@dataclass
class _Series:
    """The per-layer series ``[rows, layer]`` the health rules read, from one run's
    cache: grad, param and update L2 norms (None where the kind is not recorded) and the
    activation statistics of ``_ACT_SERIES``; ``layers`` is every layer in forward order."""

    steps: np.ndarray
    g_layers: list[str]
    g: np.ndarray
    p_layers: list[str]
    p: np.ndarray | None
    u_layers: list[str]
    u: np.ndarray | None
    a_layers: list[str]
    act: dict[str, np.ndarray]
    layers: list[str]
    frozen: set[str] = field(default_factory=set)
    lora: dict[str, _LoraFactor] = field(default_factory=dict)


@dataclass
class _LoraFactor:
    """A LoRA factor layer's place: its part, its adapter, its partner factor's layer, the
    scale and the base weight's norm (None when not recorded)."""

    part: str
    pair: LoraPair
    partner: str
    scale: float
    scale_source: str | None
    base_norm: float | None


def _lora_factors(run: Run, p_layers: list[str], p: np.ndarray | None) -> dict[str, _LoraFactor]:
    """The LoRA factor layers of ``run`` (both factors recorded as param), by layer."""
    out: dict[str, _LoraFactor] = {}
    pcol = {x: i for i, x in enumerate(p_layers)}
    for pair in lora_pairs(run):
        scale, src = lora_scale(run, pair)
        base = None
        if p is not None and pair.base_layer in pcol:
            col = np.asarray(p[:, pcol[pair.base_layer]], dtype=np.float64)
            base = _med(col)
        base = base if base is not None and base > 0 else None
        for part, layer, partner in (("lora_A", pair.a_layer, pair.b_layer),
                                     ("lora_B", pair.b_layer, pair.a_layer)):  # fmt: skip
            out[layer] = _LoraFactor(part, pair, partner, scale, src, base)
    return out


def _load_series(run: Run, cache: StatsCache) -> _Series:
    """The series of :func:`want_health` (loaded by ``cache``)."""
    kinds = set(run.kinds())
    if Kind.GRAD in kinds:
        steps, g_layers, g = layer_norms(run, Kind.GRAD, cache)
    else:
        steps, g_layers, g = run.steps, [], np.zeros((run.rows, 0))
    p_layers: list[str] = []
    p: np.ndarray | None = None
    if Kind.PARAM in kinds:
        _, p_layers, p = layer_norms(run, Kind.PARAM, cache)
    u_layers: list[str] = []
    u: np.ndarray | None = None
    if Kind.UPDATE in kinds:
        _, u_layers, u = layer_norms(run, Kind.UPDATE, cache)
    layers = list(g_layers) + [x for x in p_layers if x not in set(g_layers)]
    a_layers: list[str] = []
    act: dict[str, np.ndarray] = {}
    if Kind.ACTIVATION in kinds:
        a_layers = cache.groups(Kind.ACTIVATION).layers
        act = {stat: cache.series(Kind.ACTIVATION, stat, how) for stat, how in _ACT_SERIES}
        seen = set(layers)
        layers += [x for x in a_layers if x not in seen]
    graded = set(g_layers)
    frozen = {x for x in p_layers if x not in graded} if graded else set()
    lora = _lora_factors(run, p_layers, p) if p is not None else {}
    return _Series(steps, g_layers, g, p_layers, p, u_layers, u, a_layers, act, layers,
                   frozen, lora)  # fmt: skip


@dataclass
class _Facts:
    """What the rules read per layer besides :class:`LayerHealth`'s fields: non-finite
    gradient values, fraction of rows with all-zero gradients, activation summary
    (median zero_frac, abs_mean, mean, std; min of min, max of max) and max grad norm."""

    nonfinite: dict[str, float] = field(default_factory=dict)
    zero_steps: dict[str, float] = field(default_factory=dict)
    act: dict[str, dict[str, float | None]] = field(default_factory=dict)
    gmax: dict[str, float] = field(default_factory=dict)


GradTotalsRow = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One window of :class:`GradTotals`: ``(nonfinite [layer], zero_rows [layer],
recorded_rows [layer])``."""


def _measure(
    s: _Series, rows: slice, totals: GradTotalsRow | None
) -> tuple[list[LayerHealth], _Facts]:
    """Every layer's measures over the rows ``rows`` of ``s`` (issues not yet judged);
    ``totals``: the grad totals of the same rows."""
    facts = _Facts()
    if totals is not None:
        nonfinite, zero_rows, recorded = totals
        for c, layer in enumerate(s.g_layers):
            facts.nonfinite[layer] = float(nonfinite[c])
            facts.zero_steps[layer] = float(zero_rows[c] / max(int(recorded[c]), 1))
    if s.act:
        ser = {k: v[rows] for k, v in s.act.items()}
        meds = {k: column_median(ser[k]) for k in ("zero_frac", "abs_mean", "mean", "std")}
        with _quiet():
            amin, amax = np.nanmin(ser["min"], axis=0), np.nanmax(ser["max"], axis=0)
        for c, layer in enumerate(s.a_layers):
            facts.act[layer] = {
                "zero_frac": finite_float(meds["zero_frac"][c]),
                "min": finite_float(amin[c]),
                "max": finite_float(amax[c]),
                "abs_mean": finite_float(meds["abs_mean"][c]),
                "mean": finite_float(meds["mean"][c]),
                "std": finite_float(meds["std"][c]),
            }
    g = s.g[rows]
    p = None if s.p is None else s.p[rows]
    u = None if s.u is None else s.u[rows]
    gm = _grad_measures(g)
    rel = _ratio_reduce(g, s.g_layers, p, s.p_layers, s.g_layers)
    upr = _ratio_reduce(u, s.u_layers, p, s.p_layers, s.u_layers)
    gcol = {x: i for i, x in enumerate(s.g_layers)}
    ucol = {x: i for i, x in enumerate(s.u_layers)}
    lora = _lora_measures(s, g, p, u)
    out: list[LayerHealth] = []
    for depth, layer in enumerate(s.layers):
        lh = LayerHealth(layer=layer, depth=depth, frozen=layer in s.frozen,
                         lora=lora.get(layer))  # fmt: skip
        if layer in gcol:
            gi = gcol[layer]
            lh.grad_norm = finite_float(gm["median"][gi])
            lh.grad_norm_cv = finite_float(gm["cv"][gi])
            lh.grad_growth = finite_float(gm["growth"][gi])
            lh.rel_grad = finite_float(rel[gi])
            facts.gmax[layer] = float(gm["max"][gi])
        if layer in ucol:
            lh.update_ratio = finite_float(upr[ucol[layer]])
        if layer in facts.act:
            lh.act_zero_frac = facts.act[layer]["zero_frac"]
        out.append(lh)
    return out, facts


def _lora_measures(
    s: _Series, g: np.ndarray, p: np.ndarray | None, u: np.ndarray | None
) -> dict[str, LoraHealth]:
    """The effective measures of every LoRA factor layer with a gradient (module
    docstring) over the rows of ``g``, ``p`` and ``u`` (the series' rows already sliced)."""
    if p is None or not s.lora:
        return {}
    gcol = {x: i for i, x in enumerate(s.g_layers)}
    pcol = {x: i for i, x in enumerate(s.p_layers)}
    ucol = {x: i for i, x in enumerate(s.u_layers)}
    nan = np.full(len(g), np.nan)

    def col(x: np.ndarray | None, c: dict[str, int], layer: str) -> np.ndarray:
        return nan if x is None or layer not in c else np.asarray(x[:, c[layer]], np.float64)

    layers = [x for x in s.lora if x in gcol and x in pcol and s.lora[x].partner in pcol]
    if not layers:
        return {}
    per_partner = np.stack(
        [_ratio(col(g, gcol, x), col(p, pcol, s.lora[x].partner)) for x in layers], axis=1
    )  # ‖g‖ / ‖partner‖ [rows, factor]
    gm = _grad_measures(per_partner)
    upd = []
    for x in layers:
        f = s.lora[x]
        own_u, partner = col(u, ucol, x), col(p, pcol, f.partner)
        if f.part == "lora_A":  # s·‖u_A‖·‖B_{t+1}‖, ‖B_{t+1}‖ ≤ ‖B_t‖ + ‖u_B‖
            upd.append(own_u * (partner + col(u, ucol, f.partner)))
        else:  # s·‖A_t‖·‖u_B‖
            upd.append(own_u * partner)
    upr = column_median(np.stack(upd, axis=1))
    out = {}
    for c, x in enumerate(layers):
        f = s.lora[x]
        base, sc = f.base_norm, abs(f.scale)
        with np.errstate(all="ignore"):
            rel = np.nan if base is None else gm["median"][c] / (sc * base)
            ur = np.nan if base is None else sc * upr[c] / base
        out[x] = LoraHealth(
            part=f.part, adapted=f.pair.key, scale=f.scale, scale_source=f.scale_source,
            rel_grad=finite_float(rel), update_ratio=finite_float(ur),
            grad_growth=finite_float(gm["growth"][c]),
        )  # fmt: skip
    return out


def _group(lh: LayerHealth) -> str | None:
    """Which layers a layer is compared with: its LoRA part, or None (other layers)."""
    return None if lh.lora is None else lh.lora.part


def _rel(lh: LayerHealth) -> float | None:
    """The relative gradient the rules read: a LoRA factor's effective one."""
    return lh.rel_grad if lh.lora is None else lh.lora.rel_grad


def _upr(lh: LayerHealth) -> float | None:
    """The update ratio the ratio rules read: a LoRA factor's effective one (None
    without a recorded base weight: a factor's own ratio is no measure, module docstring)."""
    return lh.update_ratio if lh.lora is None else lh.lora.update_ratio


def _judge(
    out: list[LayerHealth], facts: _Facts, th: HealthThresholds, span: str = "the run"
) -> list[Issue]:
    """Add each layer's issues to ``out``; return the run-level issues. ``span`` names
    the steps measured in messages ("the run", "the window"). Frozen layers get no
    gradient or DEAD issue; LoRA factors are judged by their effective measures, and
    compared with the same factor of other adapters only (module docstring)."""
    top_rel: dict[str | None, float] = {}
    for lh in out:
        r = _rel(lh)
        if r is not None and r > 0:
            top_rel[_group(lh)] = max(r, top_rel.get(_group(lh), 0.0))
    for lh in out:
        L = lh.layer
        nonfinite = facts.nonfinite.get(L, 0.0)
        ratio, growth = _upr(lh), lh.grad_growth if lh.lora is None else lh.lora.grad_growth
        if nonfinite > 0:
            lh.issues.append(_issue(IssueType.EXPLODING, Status.CRITICAL, L,
                                    f"{int(nonfinite)} non-finite gradient values",
                                    nonfinite_values=int(nonfinite)))  # fmt: skip
        elif lh.grad_norm is not None:
            gmax = facts.gmax.get(L, lh.grad_norm)
            if lh.grad_norm > th.exploding_norm or gmax > th.exploding_norm:
                lh.issues.append(_issue(IssueType.EXPLODING, Status.CRITICAL, L,
                                        f"gradient norm up to {gmax:.3g} (> {th.exploding_norm:g})",
                                        grad_norm_median=lh.grad_norm, grad_norm_max=gmax))  # fmt: skip
            elif ratio is not None and ratio > th.update_ratio_high:
                what = ("effective update ratio (of the adapted layer's weight)"
                        if lh.lora is not None else "update/param ratio")  # fmt: skip
                lh.issues.append(_issue(IssueType.EXPLODING, Status.CRITICAL, L,
                                        f"{what} {ratio:.3g} "
                                        f"(> {th.update_ratio_high:g}): steps too large",
                                        update_ratio=ratio, grad_growth=growth))  # fmt: skip
            elif growth is not None and growth > th.exploding_growth:
                lh.issues.append(_issue(IssueType.EXPLODING, Status.WARNING, L,
                                        f"gradient norm grew {growth:.3g}x over {span}",
                                        grad_growth=growth))  # fmt: skip
        zero_act = lh.act_zero_frac is not None and lh.act_zero_frac >= th.dead_zero_frac
        dead_act = zero_act and not lh.frozen
        dead_grad = facts.zero_steps.get(L, 0.0) >= th.dead_steps_frac
        rel, top = _rel(lh), top_rel.get(_group(lh))
        if dead_act or dead_grad:
            lh.issues.append(_issue(IssueType.DEAD, Status.CRITICAL, L,
                                    ("activation is zero for "
                                     f"{100 * (lh.act_zero_frac or 0):.1f}% of values"
                                     if dead_act else "gradients are exactly zero")
                                    + (" and gradients are all-zero" if dead_act and dead_grad else ""),
                                    act_zero_frac=lh.act_zero_frac,
                                    grad_zero_steps_frac=facts.zero_steps.get(L)))  # fmt: skip
        elif (
            nonfinite == 0
            and lh.grad_norm is not None
            and (lh.grad_norm < th.vanishing_abs
                 or (top and rel is not None and rel < th.vanishing_rel * top))
        ):  # fmt: skip
            frac = (rel / top) if (top and rel is not None) else 0.0
            crit = lh.grad_norm < th.vanishing_abs or frac < th.vanishing_rel_critical
            of = "the largest layer's" if lh.lora is None else f"the largest {lh.lora.part}'s"
            lh.issues.append(_issue(IssueType.VANISHING, Status.CRITICAL if crit else Status.WARNING, L,
                                    f"relative gradient {rel or 0:.3g} is {frac:.2g}x "
                                    f"{of} ({top or 0:.3g})",
                                    grad_norm=lh.grad_norm, rel_grad=rel,
                                    fraction_of_max=frac))  # fmt: skip
        a = facts.act.get(L)
        if a and a["min"] is not None and a["max"] is not None and a["abs_mean"] is not None:
            lo, hi = a["min"], a["max"]
            sat = False
            if lo >= -1.0 and hi <= 1.0 and lo < 0 and a["abs_mean"] > th.saturated_frac:
                sat = True
            if (
                lo >= 0.0 and hi <= 1.0 and a["mean"] is not None and a["std"] is not None
                and a["std"] < th.saturated_std
                and (a["mean"] < 1 - th.saturated_frac or a["mean"] > th.saturated_frac)
                and not zero_act
            ):  # fmt: skip
                sat = True
            if sat:
                lh.issues.append(_issue(IssueType.SATURATED, Status.WARNING, L,
                                        f"bounded activation saturated (mean {a['mean']:.3g}, "
                                        f"|mean| {a['abs_mean']:.3g}, std {a['std']:.3g})",
                                        **{k: v for k, v in a.items() if v is not None}))  # fmt: skip

    # ---------------------------------------------------------------- run-level issues
    run_issues: list[Issue] = []
    for grp in dict.fromkeys(_group(lh) for lh in out):  # other layers, lora_A, lora_B
        members = [lh for lh in out if _group(lh) == grp]
        run_issues += _depth_issues(members, th, "" if grp is None else f"{grp} ")
    # attention: sibling sub-layers q/k/v under one parent
    by_layer = {lh.layer: lh for lh in out}
    for parent, group in qkv_groups(by_layer).items():
        gn = {s: by_layer[layer].grad_norm for s, layer in group.items()}
        vals = [v for v in gn.values() if v is not None and v > 0]
        if len(vals) >= 2 and max(vals) / min(vals) > th.qkv_ratio:
            iss = _issue(IssueType.ATTENTION_QKV_IMBALANCE, Status.WARNING, parent,
                         f"q/k/v gradient norms differ {max(vals) / min(vals):.3g}x",
                         **{f"grad_norm_{k}": v for k, v in gn.items()})  # fmt: skip
            run_issues.append(iss)
    return run_issues


def _depth_issues(out: list[LayerHealth], th: HealthThresholds, what: str) -> list[Issue]:
    """DECAY_WITH_DEPTH and LAYER_IMBALANCE among the layers ``out`` (one comparison
    group; ``what`` names it in messages: "" or "lora_A ")."""
    run_issues: list[Issue] = []
    with_rel = [(lh, r) for lh in out if (r := _rel(lh)) is not None and r > 0]
    if len(with_rel) >= 3:
        (first, r0), (last, r1) = with_rel[0], with_rel[-1]
        ratio = r1 / r0
        if ratio > th.decay_ratio:
            run_issues.append(_issue(IssueType.DECAY_WITH_DEPTH, Status.WARNING, None,
                                     f"{what}relative gradient falls {ratio:.3g}x from "
                                     f"{last.layer!r} back to {first.layer!r}",
                                     ratio=ratio,
                                     profile={x.layer: r for x, r in with_rel}))  # fmt: skip
    ur = [(lh, r) for lh in out if (r := _upr(lh)) is not None and r > 0]
    if len(ur) >= 2:
        hi_l, hi = max(ur, key=lambda x: x[1])
        lo_l, lo = min(ur, key=lambda x: x[1])
        ratio = hi / lo
        if ratio > th.imbalance_ratio:
            run_issues.append(_issue(IssueType.LAYER_IMBALANCE, Status.WARNING, None,
                                     f"{what}update/param ratio ranges {ratio:.3g}x: "
                                     f"{hi_l.layer!r} {hi:.3g} vs {lo_l.layer!r} {lo:.3g}",
                                     ratio=ratio, fastest=hi_l.layer, slowest=lo_l.layer))  # fmt: skip
    return run_issues


def _worst(statuses: Iterable[Status]) -> Status:
    """The most severe of ``statuses`` (healthy when empty)."""
    sev = set(statuses)
    return (Status.CRITICAL if Status.CRITICAL in sev
            else Status.WARNING if Status.WARNING in sev else Status.HEALTHY)  # fmt: skip


def _score(
    out: list[LayerHealth], run_issues: list[Issue], th: HealthThresholds
) -> tuple[float, Status]:
    """Set each layer's score and status from its issues; return the run's (score
    rounded to 0.1, status)."""
    for lh in out:
        pen = sum(th.critical_penalty if i.severity == Status.CRITICAL else th.warning_penalty
                  for i in lh.issues)  # fmt: skip
        lh.score = float(max(0.0, 100.0 - pen))
        lh.status = _worst(i.severity for i in lh.issues)
    score = float(np.mean([lh.score for lh in out])) if out else 100.0
    score = max(0.0, score - th.warning_penalty / 5 * len(run_issues))
    status = _worst([*(i.severity for i in run_issues), *(lh.status for lh in out)])
    return round(score, 1), status


def health(
    run: Run,
    thresholds: HealthThresholds | None = None,
    *,
    progress: ProgressCallback | None = None,
    cache: StatsCache | None = None,
    checks: bool = True,
) -> HealthReport:
    """Gradient-flow health of every layer of ``run`` (see module docstring).

    Args:
        run: an open run (:func:`traintape.open_run`).
        thresholds: override the defaults of :class:`HealthThresholds`.
        progress: ``callback(stage, done, total)``; a unit is one row block of a stats
            array read (grad, param, update, activation), plus one for the analysis.
        cache: a shared stats cache (used by the report so that each array is read once).
        checks: run the registered user checks (:mod:`~traintape.analysis.registry`) into
            :attr:`HealthReport.checks`; a critical or warning issue of one sets the
            status at least that bad, a failed check is reported, never raised.
    """
    th = thresholds or HealthThresholds()
    if cache is None:
        cache = StatsCache(run, Tracker(progress))
    tracker = cache.tracker
    want_health(run, cache)
    tracker.add(cache.pending_blocks() + 1)
    cache.load()
    s = _load_series(run, cache)
    totals: GradTotalsRow | None = None
    if s.g_layers:
        nonfinite, zero_rows, recorded = cache.result(("grad_totals",))
        totals = (nonfinite[0], zero_rows[0], recorded[0])
    out, facts = _measure(s, slice(None), totals)
    tracker.stage("analysing layers")
    run_issues = _judge(out, facts, th)
    arch = architecture(run, th, cache=cache)
    by_layer = {lh.layer: lh for lh in out}
    for a in arch.issues:  # a layer's own issue, or run level (attention, block, stack)
        iss = Issue(type=IssueType(a.type), severity=Status(a.severity), layer=a.layer,
                    message=a.message, recommendation=a.recommendation, evidence=a.evidence)  # fmt: skip
        (by_layer[a.layer].issues if a.layer in by_layer else run_issues).append(iss)
    score, status = _score(out, run_issues, th)
    tracker.advance()
    user = run_checks(run) if checks else []
    status = _worst([status, *(Status(r.status) for r in user if r.status != "error")])
    return HealthReport(url=run.url, steps=len(s.steps), layers=out, run_issues=run_issues,
                        thresholds=th, score=score, status=status, checks=user,
                        frozen=[x for x in s.layers if x in s.frozen],
                        architecture=arch)  # fmt: skip
