"""The models of :func:`~traintape.analysis.health`: thresholds, per-layer measures, the
report. The rules that judge them are in :mod:`~traintape.analysis.health_rules`, the
measuring in :mod:`~traintape.analysis.health`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from traintape.analysis.architecture import ArchitectureReport, ArchitectureThresholds
from traintape.analysis.issues import Issue, IssueType, Recommendation, Status, recommendations
from traintape.analysis.registry import CheckResult


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

    Context (:mod:`~traintape.analysis.health_rules` says which rule reads which):

    - relative gradients are compared within a layer's *role* (norm scales, embeddings,
      attention q/k projections, LoRA A / B factors, everything else): what is normal
      differs by role (a LayerNorm scale's or an embedding's grad/param ratio is
      naturally far below a dense kernel's; q/k get almost no gradient while attention is
      still uniform at init).
    - ``early_steps`` (20): a run of fewer recorded steps is all *early phase*: relative
      VANISHING there is at most info unless critical (``vanishing_rel_critical``).
    - ``turbulence_update`` (1e-2): TURBULENT / PRESSURE_SPIKE are warnings only when the
      layer's largest update/param ratio in the window reaches this (the swings move the
      weights); below it, or without a recorded ``update``, they are info (a converged
      run's gradient is noise: its std exceeds its mean, and nothing moves).
    - ``window_loss_fall`` (0.02) / ``window_loss_peak`` (3): a window whose loss falls
      calmly — last-third median ≥ 2% below the first third's, and after the first third
      no value above 3× the window's median — is *learning*: its TURBULENT,
      PRESSURE_SPIKE and ACCELERATING are info (a model learning a new feature moves fast
      and its gradient swings and grows).
    - ``trend_min_rows`` (10): windows of health over time hold at least this many
      recorded steps (the whole run when shorter); TURBULENT / PRESSURE_SPIKE /
      ACCELERATING are not judged on fewer.
    - ``accumulating_growth`` (3) / ``accumulating_jitter`` (0.05) /
      ``accumulating_min_steps`` (8): ACCUMULATING_GRAD (warning): a layer's grad norm
      grows that many times from the first to the last quarter of the run while changing
      less than ``accumulating_jitter`` of itself from step to step — gradients summed
      over steps (``zero_grad`` forgotten, or parameters outside the optimizer).
    - ``lr_small_ratio`` (1e-5) / ``lr_small_loss_drop`` (0.05): LR_TOO_SMALL (warning):
      the median over trained layers of the median update/param ratio is below
      ``lr_small_ratio`` and the loss fell by less than ``lr_small_loss_drop`` (relative)
      from the first to the last quarter of the run (or is not logged).
    - ``periodic_acf`` (0.5) / ``periodic_smooth`` (0.5): PERIODIC_LOSS: the log-loss's
      step-to-step changes repeat with a period P (autocorrelation at lag P ≥
      ``periodic_acf``, ≥ 3 periods): the loss follows the data order. A warning when
      the loss profile over one period is smooth (lag-1 autocorrelation ≥
      ``periodic_smooth``: the data is read in sorted stretches), info otherwise (a
      fixed batch order). A Keras loss (a running mean over the epoch) is turned into
      per-batch losses first.
    - NORM_STATS_FROZEN (warning, no threshold): a normalisation layer's recorded running
      statistics never change over ≥ 3 recorded steps while its scale trains (BatchNorm
      in ``eval()`` mode during training).
    - ``clip_capped_frac`` (0.2): the run clips gradients when it logs
      ``grad/clip_factor`` below 1 at some step, or when its global gradient norm sits at
      its maximum (within 0.1%) at this fraction of steps (an adapter that records the
      clipped gradient); advice then does not tell it to add clipping.
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
    early_steps: int = 20
    turbulence_update: float = 1e-2
    window_loss_fall: float = 0.02
    window_loss_peak: float = 3.0
    trend_min_rows: int = 10
    accumulating_growth: float = 3.0
    accumulating_jitter: float = 0.05
    accumulating_min_steps: int = 8
    clip_capped_frac: float = 0.2
    periodic_acf: float = 0.5
    periodic_smooth: float = 0.5
    lr_small_ratio: float = 1e-5
    lr_small_loss_drop: float = 0.05
    critical_penalty: float = 60.0
    warning_penalty: float = 25.0


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
    clipping: str | None = Field(
        None,
        description="gradient clipping seen: 'metric' (grad/clip_factor < 1), "
        "'capped' (the global grad norm sits at its maximum), None: not seen",
    )
    clip_frac: float = Field(0.0, description="fraction of steps clipped")
    adaptive_optimizer: bool | None = Field(
        None, description="the optimizer keeps a second moment (Adam-like); None: unknown"
    )

    def issues(self) -> list[Issue]:
        """All issues, run-level first then per layer in forward order."""
        return [*self.run_issues, *(i for lh in self.layers for i in lh.issues)]

    def has(self, type: IssueType | str, layer: str | None = None, *, info: bool = False) -> bool:
        """Whether an issue of ``type`` (on ``layer``, if given) was raised; ``info``
        issues count only with ``info=True``."""
        return any(
            i.type == type and (layer is None or i.layer == layer)
            and (info or i.severity != "info")
            for i in self.issues()
        )  # fmt: skip

    def recommendations(self) -> list[Recommendation]:
        """Each recommendation once, with the layers it applies to (user checks'
        included)."""
        return recommendations([*self.issues(), *(i for c in self.checks for i in c.issues)])


@dataclass
class RunContext:
    """What the run already does, read once from the store (the advice rules read it).

    ``clipping``: None (no sign of it), ``"metric"`` (``grad/clip_factor`` below 1 at some
    step) or ``"capped"`` (the global grad norm sits at its maximum at many steps);
    ``clip_frac``: fraction of steps clipped; ``adaptive``: the optimizer keeps a second
    moment (an ``opt_state`` tensor named like Adam's ``exp_avg_sq``/``nu``/``v``); None:
    unknown; ``bounded_activations``: some recorded activation is bounded (sigmoid/tanh
    like); None: no activation recorded; ``steps``: recorded steps of the run;
    ``loss``: the loss metric per row (None when not logged)."""

    clipping: str | None = None
    clip_frac: float = 0.0
    adaptive: bool | None = None
    bounded_activations: bool | None = None
    steps: int = 0
    loss: list[float] | None = None
    loss_is_epoch_mean: bool = False
    """The logged loss is a running mean over the epoch (Keras's ``logs``)."""
    roles: dict[str, str] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)
    """Each layer's position in forward order."""


@dataclass
class LayerFacts:
    """What the rules read per layer besides :class:`LayerHealth`'s fields: non-finite
    gradient values, fraction of rows with all-zero gradients, activation summary
    (median zero_frac, abs_mean, mean, std; min of min, max of max), max grad norm, the
    largest update/param ratio, whether every recorded update is exactly zero, and the
    run's global gradient norm per row (``global_grad``) with its steps."""

    nonfinite: dict[str, float] = field(default_factory=dict)
    zero_steps: dict[str, float] = field(default_factory=dict)
    act: dict[str, dict[str, float | None]] = field(default_factory=dict)
    gmax: dict[str, float] = field(default_factory=dict)
    umax: dict[str, float] = field(default_factory=dict)
    update_zero: dict[str, bool] = field(default_factory=dict)
    global_grad: list[float] = field(default_factory=list)
    grad_steps: list[int] = field(default_factory=list)
    running_frozen: dict[str, bool] = field(default_factory=dict)
    """Per normalisation layer with recorded running statistics: whether they never change."""
    grad_series: dict[str, Any] = field(default_factory=dict)
    """Each layer's grad norm per row ``[rows]`` (numpy), for rules that read the series."""
