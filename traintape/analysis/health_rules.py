"""The built-in health rules, registered exactly like user checks.

Each rule is a function ``fn(ctx: RuleContext) -> list[Issue]`` registered with
:func:`traintape.analysis.registry.rule` under its name, with the names of the
:class:`~traintape.analysis.health_model.HealthThresholds` fields it reads (overridable
with ``traintape health -t NAME=VALUE``) and its scope (the whole run, each window of
health over time, or both). :func:`judge` runs them in registration order; an issue
whose ``layer`` is in the health table joins that layer's issues as soon as its rule
returns (later rules see it), the others are run-level. A new rule is one more function
here (or anywhere, with ``@rule``): nothing else changes.

Each rule's docstring names the cases of the verdict corpus
(``benchmarks/verdict_corpus/health_cases.py``) and the tests that justify its
thresholds: the pathology that must fire it and the healthy trainings that must not.

**Roles.** Relative gradients (``‖g‖/‖θ‖``) and update ratios are compared only among
layers of one *role* (:func:`role_group`): norm scales, embeddings, attention q/k
projections, the A and the B factors of LoRA adapters, and everything else. A
LayerNorm/RMSNorm scale (all ones at init, ``‖θ‖ = √d``) and an embedding table (most rows
get no gradient from a batch) have grad/param ratios orders of magnitude below a dense
kernel's in healthy training, and q/k get almost no gradient while attention is still
uniform (at init the scores are ≈ 0, and ``∂L/∂W_q ∝ W_k``-scaled score gradients).

**Advice that knows the run.** Recommendations are written from :class:`RunContext`:
a run that already clips gradients is not told to add clipping, one with an adaptive
optimizer is not told to use Adam, one whose recorded activations are not bounded is
not told to replace sigmoid/tanh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from traintape.analysis.change import qkv_groups
from traintape.analysis.health_model import (
    HealthThresholds,
    LayerFacts,
    LayerHealth,
    RunContext,
)
from traintape.analysis.issues import Issue, IssueType, Severity, clean_evidence
from traintape.analysis.registry import rule, rules

CRIT, WARN, INFO = Severity.CRITICAL, Severity.WARNING, Severity.INFO


@dataclass
class RuleContext:
    """What a rule reads: the layers' measures (``layers``, forward order; issues of the
    rules run so far included), per-layer facts, thresholds, what the run already does,
    the span judged (``"the run"`` / ``"the window"``), and per window of health over
    time the window's dynamic measures per layer (``dynamics``: turbulence, max_pressure,
    velocity, acceleration, t_stat, span; empty over the whole run)."""

    layers: list[LayerHealth]
    facts: LayerFacts
    th: HealthThresholds
    run: RunContext
    span: str = "the run"
    window: bool = False
    dynamics: dict[str, dict[str, float]] = field(default_factory=dict)
    loss_rows: slice | None = None
    """The window's rows of ``run.loss`` (per window of health over time)."""

    def learning(self) -> bool:
        """Whether the loss falls calmly over the window: its last-third median at least
        ``window_loss_fall`` below its first-third median, and after the first third no
        value above ``window_loss_peak`` times the window's median (no loss spike; the
        first third may still be falling fast). False without a logged loss or outside a
        window."""
        if self.loss_rows is None or self.run.loss is None:
            return False
        x = np.asarray(self.run.loss, np.float64)[self.loss_rows]
        x = x[np.isfinite(x)]
        if len(x) < 6:
            return False
        q = len(x) // 3
        first, last, med = float(np.median(x[:q])), float(np.median(x[-q:])), float(np.median(x))
        if first <= 0 or med <= 0:
            return False
        calm = float(x[q:].max()) <= self.th.window_loss_peak * med
        return (first - last) / first >= self.th.window_loss_fall and calm


# ------------------------------------------------------------------ roles and measures
def role_group(lh: LayerHealth, roles: dict[str, str]) -> str:
    """Which layers ``lh`` is compared with: ``lora_A`` / ``lora_B`` (LoRA factors),
    ``norm``, ``embedding``, ``attention/qk`` (q and k projections), or ``other``."""
    if lh.lora is not None:
        return lh.lora.part
    role = roles.get(lh.layer, "mlp")
    if role in ("norm", "embedding"):
        return role
    if role in ("attention/q", "attention/k"):
        return "attention/qk"
    return "other"


def rel_grad(lh: LayerHealth) -> float | None:
    """The relative gradient the rules read: a LoRA factor's effective one."""
    return lh.rel_grad if lh.lora is None else lh.lora.rel_grad


def update_ratio(lh: LayerHealth) -> float | None:
    """The update ratio the rules read: a LoRA factor's effective one (None without a
    recorded base weight: a factor's own ratio is no measure)."""
    return lh.update_ratio if lh.lora is None else lh.lora.update_ratio


def grad_growth(lh: LayerHealth) -> float | None:
    return lh.grad_growth if lh.lora is None else lh.lora.grad_growth


def _top(ctx: RuleContext, measure: Callable[[LayerHealth], float | None]) -> dict[str, float]:
    """The largest positive finite ``measure`` per role group."""
    top: dict[str, float] = {}
    for lh in ctx.layers:
        v = measure(lh)
        if v is not None and v > 0 and np.isfinite(v):
            g = role_group(lh, ctx.run.roles)
            top[g] = max(v, top.get(g, 0.0))
    return top


def learns(lh: LayerHealth, ctx: RuleContext, top_update: dict[str, float], frac: float) -> bool:
    """Whether ``lh``'s recorded update ratio is at least ``frac`` of the largest of its
    role: the layer learns at a normal pace whatever its gradient's size (an adaptive
    optimizer — Adam — rescales small gradients; corpus ``bert_from_init``: encoder
    gradients 1e-4 of the head's, update ratios alike). False without a recorded update
    (then the gradient alone is judged); under plain SGD the update ratio is ``lr·rel_grad``
    and both agree."""
    u = update_ratio(lh)
    best = top_update.get(role_group(lh, ctx.run.roles))
    return u is not None and best is not None and u >= frac * best


def _has(lh: LayerHealth, t: IssueType) -> bool:
    return any(i.type == t for i in lh.issues)


# ------------------------------------------------------------------ advice
def advice(t: IssueType, run: RunContext) -> str:
    """The recommendation for issue type ``t``, written for what ``run`` already does."""
    clips = run.clipping is not None
    clip = "" if clips else ", add gradient clipping (e.g. clip the global norm to 1.0)"
    if t == IssueType.VANISHING:
        act = ("" if run.bounded_activations is False
               else "use ReLU/GELU instead of sigmoid/tanh, ")  # fmt: skip
        return (f"gradients barely reach this layer: {act}He/Xavier initialisation, "
                "residual connections or normalisation layers; check for a stray "
                "detach/stop-gradient or a near-zero scale on the path")  # fmt: skip
    if t == IssueType.EXPLODING:
        already = (f" (the run already clips gradients, at {run.clip_frac:.0%} of steps: "
                   "clipping is not holding them)" if clips else "")  # fmt: skip
        return (
            f"lower the learning rate{clip} or lengthen learning-rate warm-up; check "
            f"the loss scale{already}"
        )
    if t == IssueType.LAYER_IMBALANCE:
        opt = "" if run.adaptive else "use an adaptive optimizer (Adam), "
        return (f"layers learn at very different speeds: {opt}per-layer learning rates, "
                "or normalise layer scales")  # fmt: skip
    if t == IssueType.TURBULENT:
        return ("the gradient norm swings widely from step to step: lower the learning "
                f"rate, increase the batch size (or accumulate gradients){clip}, or "
                "raise Adam's epsilon")  # fmt: skip
    if t == IssueType.PRESSURE_SPIKE:
        c = "" if clips else "clip gradients (global or per-layer norm), "
        return (f"a few steps push this layer's weights far harder than the rest: {c}look "
                "for outlier batches at those steps, or lower the learning rate (with "
                "warm-up, if the spikes come first thing)")  # fmt: skip
    if t == IssueType.ACCELERATING:
        return ("the gradient norm grows faster and faster, heading for divergence: lower "
                f"the (peak) learning rate or lengthen warm-up{clip}, and check the loss "
                "scale")  # fmt: skip
    return _FIXED[t]


_FIXED: dict[IssueType, str] = {
    IssueType.DEAD: "the layer outputs (or receives) only zeros: check bias initialisation, "
    "use LeakyReLU/GELU, lower the learning rate, or re-initialise the layer",
    IssueType.SATURATED: "activations sit at the bounds of sigmoid/tanh: normalise inputs, "
    "add LayerNorm/BatchNorm before the nonlinearity, or scale down initial weights",
    IssueType.DECAY_WITH_DEPTH: "gradient size decays towards the input layers: add residual "
    "connections or normalisation, or use per-layer learning rates",
    IssueType.ATTENTION_QKV_IMBALANCE: "q/k/v projections get very different gradients: "
    "check the attention scaling (1/sqrt(d)), initialisation of q/k, and QK-normalisation",
    IssueType.ACCUMULATING_GRAD: "gradients add up from step to step: call "
    "optimizer.zero_grad() (or set_to_none) every step — or, when accumulating on purpose, "
    "step the optimizer and zero the gradients every N micro-batches and divide the loss by N",
    IssueType.PERIODIC_LOSS: "the loss cycles with the order of the data: shuffle the "
    "training set every epoch (DataLoader(shuffle=True), dataset.shuffle(buffer) before "
    "batching), and check that no sampler reads it class by class",
    IssueType.LR_TOO_SMALL: "the weights barely move and the loss does not fall: raise the "
    "learning rate (by 10x steps; check the schedule's warm-up and its peak value, and that "
    "the optimizer got the intended lr)",
    IssueType.NORM_STATS_FROZEN: "the normalisation layer's running statistics never update: "
    "the model is trained in eval() mode — call model.train() after each evaluation (or "
    "pass training=True / use_running_average=False while training)",
    IssueType.NOT_UPDATED: "this layer's weights never change: check that its parameters are in "
    "the optimizer's parameter groups and have requires_grad=True (or that freezing it "
    "is intended)",
}


def issue(
    ctx: RuleContext, t: IssueType, sev: Severity, layer: str | None, msg: str, **evidence: Any
) -> Issue:
    """An issue of type ``t`` with the run-aware recommendation."""
    return Issue(type=t, severity=sev, layer=layer, message=msg,
                 recommendation=advice(t, ctx.run), evidence=clean_evidence(evidence))  # fmt: skip


# ------------------------------------------------------------------ per-layer rules
@rule("nonfinite_gradients")
def nonfinite_gradients(ctx: RuleContext) -> list[Issue]:
    """EXPLODING (critical): a layer with NaN/Inf gradient values. No threshold: any
    non-finite gradient is an error. Corpus: ``loss_nan`` (a NaN feature at step 60),
    ``exploding_lr`` (overflow)."""
    out = []
    for lh in ctx.layers:
        n = ctx.facts.nonfinite.get(lh.layer, 0.0)
        if n > 0:
            out.append(issue(ctx, IssueType.EXPLODING, CRIT, lh.layer,
                             f"{int(n)} non-finite gradient values", nonfinite_values=int(n)))  # fmt: skip
    return out


@rule("gradient_norm_limit", thresholds=("exploding_norm",))
def gradient_norm_limit(ctx: RuleContext) -> list[Issue]:
    """EXPLODING (critical): median or max gradient norm above ``exploding_norm`` (1e3).
    Corpus: ``exploding_lr`` fires it; healthy trainings' largest layer grad norms
    (HF BERT/GPT-2 from config, fine-tuning, the demo) stay below 1e2."""
    out = []
    for lh in ctx.layers:
        if lh.grad_norm is None or _has(lh, IssueType.EXPLODING):
            continue
        gmax = ctx.facts.gmax.get(lh.layer, lh.grad_norm)
        if max(lh.grad_norm, gmax) > ctx.th.exploding_norm:
            out.append(issue(ctx, IssueType.EXPLODING, CRIT, lh.layer,
                             f"gradient norm up to {gmax:.3g} (> {ctx.th.exploding_norm:g})",
                             grad_norm_median=lh.grad_norm, grad_norm_max=gmax))  # fmt: skip
    return out


@rule("update_ratio_limit", thresholds=("update_ratio_high",))
def update_ratio_limit(ctx: RuleContext) -> list[Issue]:
    """EXPLODING (critical): median update/param ratio (a LoRA factor: its effective
    ratio) above ``update_ratio_high`` (0.1: every step rewrites 10% of the weights).
    Corpus: ``exploding_lr``; healthy Adam trainings at lr ≤ 1e-3 stay below 1e-2."""
    out = []
    for lh in ctx.layers:
        ratio = update_ratio(lh)
        if lh.grad_norm is None or ratio is None or _has(lh, IssueType.EXPLODING):
            continue
        if ratio > ctx.th.update_ratio_high:
            what = ("effective update ratio (of the adapted layer's weight)"
                    if lh.lora is not None else "update/param ratio")  # fmt: skip
            out.append(issue(ctx, IssueType.EXPLODING, CRIT, lh.layer,
                             f"{what} {ratio:.3g} (> {ctx.th.update_ratio_high:g}): steps "
                             "too large", update_ratio=ratio, grad_growth=grad_growth(lh)))  # fmt: skip
    return out


@rule("gradient_growth", thresholds=("exploding_growth",))
def gradient_growth(ctx: RuleContext) -> list[Issue]:
    """EXPLODING (warning): the grad norm grew more than ``exploding_growth`` (100x) from
    the first to the last quarter of the span. Corpus: ``exploding_lr`` (when the norm has
    not yet crossed ``exploding_norm``); healthy: every corpus training (growth < 2)."""
    out = []
    for lh in ctx.layers:
        g = grad_growth(lh)
        if lh.grad_norm is None or g is None or _has(lh, IssueType.EXPLODING):
            continue
        if g > ctx.th.exploding_growth:
            out.append(issue(ctx, IssueType.EXPLODING, WARN, lh.layer,
                             f"gradient norm grew {g:.3g}x over {ctx.span}", grad_growth=g))  # fmt: skip
    return out


@rule("dead", thresholds=("dead_zero_frac", "dead_steps_frac"))
def dead(ctx: RuleContext) -> list[Issue]:
    """DEAD (critical): an activation zero for ``dead_zero_frac`` (99%) of values, or
    gradients exactly zero at ``dead_steps_frac`` (90%) of steps (a frozen layer — no
    gradient recorded — is not dead). Corpus: ``dead_relu``, ``dead_relu_keras`` (bias −10 before a ReLU);
    healthy ReLU nets (the demo, converged MLPs) stay below 60% zeros."""
    out = []
    th = ctx.th
    for lh in ctx.layers:
        zero_act = lh.act_zero_frac is not None and lh.act_zero_frac >= th.dead_zero_frac
        dead_act = zero_act and not lh.frozen
        zsteps = ctx.facts.zero_steps.get(lh.layer, 0.0)
        dead_grad = zsteps >= th.dead_steps_frac
        if not (dead_act or dead_grad):
            continue
        msg = (f"activation is zero for {100 * (lh.act_zero_frac or 0):.1f}% of values"
               if dead_act else "gradients are exactly zero")  # fmt: skip
        if dead_act and dead_grad:
            msg += " and gradients are all-zero"
        out.append(issue(ctx, IssueType.DEAD, CRIT, lh.layer, msg,
                         act_zero_frac=lh.act_zero_frac, grad_zero_steps_frac=zsteps))  # fmt: skip
    return out


@rule("vanishing", thresholds=("vanishing_rel", "vanishing_rel_critical", "vanishing_abs",
                               "early_steps"))  # fmt: skip
def vanishing(ctx: RuleContext) -> list[Issue]:
    """VANISHING: a layer whose median grad norm is below ``vanishing_abs`` (1e-8;
    critical), or whose relative gradient is below ``vanishing_rel`` (1e-2; warning) /
    ``vanishing_rel_critical`` (1e-3; critical) of the largest one *of its role*
    (:func:`role_group`). In a run shorter than ``early_steps`` (20) a relative warning
    is info: at init q/k, zero-initialised projections and norm scales legitimately get
    little gradient. Corpus: ``vanishing_deep_sigmoid``, ``vanishing_linen_sigmoid`` (first layers
    1e-4 of the last);
    healthy: HF BERT/GPT-2 from config (LayerNorm, q/k, embeddings: each judged in its
    role), LoRA fine-tuning (A with A, B with B)."""
    th, roles = ctx.th, ctx.run.roles
    top: dict[str, float] = {}
    for lh in ctx.layers:
        r = rel_grad(lh)
        if r is not None and r > 0 and np.isfinite(r):
            g = role_group(lh, roles)
            top[g] = max(r, top.get(g, 0.0))
    early = ctx.run.steps < th.early_steps and not ctx.window
    top_upd = _top(ctx, update_ratio)
    out = []
    for lh in ctx.layers:
        if learns(lh, ctx, top_upd, th.vanishing_rel):
            continue
        if (lh.grad_norm is None or _has(lh, IssueType.DEAD)
                or ctx.facts.nonfinite.get(lh.layer, 0.0) > 0):  # fmt: skip
            continue
        r, grp = rel_grad(lh), role_group(lh, roles)
        best = top.get(grp)
        absolute = lh.grad_norm < th.vanishing_abs
        relative = best is not None and best > 0 and r is not None and r < th.vanishing_rel * best
        if not (absolute or relative):
            continue
        frac = (r / best) if (best and r is not None) else 0.0
        crit = absolute or frac < th.vanishing_rel_critical
        sev = CRIT if crit else (INFO if early else WARN)
        of = "the largest layer's" if grp == "other" else f"the largest {grp} layer's"
        out.append(issue(ctx, IssueType.VANISHING, sev, lh.layer,
                         f"relative gradient {r or 0:.3g} is {frac:.2g}x {of} ({best or 0:.3g})",
                         grad_norm=lh.grad_norm, rel_grad=r, fraction_of_max=frac,
                         role=grp))  # fmt: skip
    return out


@rule("saturated", thresholds=("saturated_frac", "saturated_std", "dead_zero_frac"))
def saturated(ctx: RuleContext) -> list[Issue]:
    """SATURATED (warning): a bounded activation (all values in [-1, 1]) whose
    ``abs_mean`` is above ``saturated_frac`` (0.9), or a [0, 1] activation whose mean is
    within ``1 − saturated_frac`` of a bound with std below ``saturated_std`` (0.05).
    Corpus: ``saturated_tanh`` (tanh on inputs ×30); healthy: GRU/LSTM and sigmoid
    nets of the corpus."""
    th, out = ctx.th, []
    for lh in ctx.layers:
        a = ctx.facts.act.get(lh.layer)
        if not a or a["min"] is None or a["max"] is None or a["abs_mean"] is None:
            continue
        lo, hi = a["min"], a["max"]
        zero_act = lh.act_zero_frac is not None and lh.act_zero_frac >= th.dead_zero_frac
        sat = lo >= -1.0 and hi <= 1.0 and lo < 0 and a["abs_mean"] > th.saturated_frac
        if (lo >= 0.0 and hi <= 1.0 and a["mean"] is not None and a["std"] is not None
                and a["std"] < th.saturated_std and not zero_act
                and (a["mean"] < 1 - th.saturated_frac or a["mean"] > th.saturated_frac)):  # fmt: skip
            sat = True
        if sat:
            out.append(issue(ctx, IssueType.SATURATED, WARN, lh.layer,
                             f"bounded activation saturated (mean {a['mean']:.3g}, "
                             f"|mean| {a['abs_mean']:.3g}, std {a['std']:.3g})",
                             **{k: v for k, v in a.items() if v is not None}))  # fmt: skip
    return out


# ------------------------------------------------------------------ run-level rules
def _groups(ctx: RuleContext) -> dict[str, list[LayerHealth]]:
    out: dict[str, list[LayerHealth]] = {}
    for lh in ctx.layers:
        out.setdefault(role_group(lh, ctx.run.roles), []).append(lh)
    return out


def _what(grp: str) -> str:
    return "" if grp == "other" else f"{grp} "


@rule("decay_with_depth", thresholds=("decay_ratio",))
def decay_with_depth(ctx: RuleContext) -> list[Issue]:
    """DECAY_WITH_DEPTH (warning, run level): within one role, the last layer's relative
    gradient above ``decay_ratio`` (100) times the first layer's (at least 3 layers).
    Corpus: ``vanishing_deep_sigmoid``; healthy: every corpus training (an embedding or
    norm scale is never compared with a dense kernel)."""
    out = []
    for grp, members in _groups(ctx).items():
        with_rel = [(lh, r) for lh in members if (r := rel_grad(lh)) is not None and r > 0]
        if len(with_rel) < 3:
            continue
        (first, r0), (last, r1) = with_rel[0], with_rel[-1]
        u0, u1 = update_ratio(first), update_ratio(last)
        if u0 is not None and u1 is not None and u0 > 0 and u1 / u0 <= ctx.th.decay_ratio:
            continue  # the first layer still learns as fast: an adaptive optimizer
        if r1 / r0 > ctx.th.decay_ratio:
            out.append(issue(ctx, IssueType.DECAY_WITH_DEPTH, WARN, None,
                             f"{_what(grp)}relative gradient falls {r1 / r0:.3g}x from "
                             f"{last.layer!r} back to {first.layer!r}", ratio=r1 / r0,
                             profile={x.layer: r for x, r in with_rel}))  # fmt: skip
    return out


@rule("layer_imbalance", thresholds=("imbalance_ratio",))
def layer_imbalance(ctx: RuleContext) -> list[Issue]:
    """LAYER_IMBALANCE (warning, run level): within one role, max / min median update
    ratio above ``imbalance_ratio`` (1e3). Corpus: fires on ``vanishing_deep_sigmoid`` (under SGD
    the update ratios follow the vanishing gradients); healthy: Adam trainings where norm scales (θ ≈ 1) move 1e-2 as fast as
    kernels — judged in their own role."""
    out = []
    for grp, members in _groups(ctx).items():
        ur = [(lh, r) for lh in members if (r := update_ratio(lh)) is not None and r > 0]
        if len(ur) < 2:
            continue
        hi_l, hi = max(ur, key=lambda x: x[1])
        lo_l, lo = min(ur, key=lambda x: x[1])
        if hi / lo > ctx.th.imbalance_ratio:
            out.append(issue(ctx, IssueType.LAYER_IMBALANCE, WARN, None,
                             f"{_what(grp)}update/param ratio ranges {hi / lo:.3g}x: "
                             f"{hi_l.layer!r} {hi:.3g} vs {lo_l.layer!r} {lo:.3g}",
                             ratio=hi / lo, fastest=hi_l.layer, slowest=lo_l.layer))  # fmt: skip
    return out


@rule("qkv_imbalance", thresholds=("qkv_ratio", "early_steps"))
def qkv_imbalance(ctx: RuleContext) -> list[Issue]:
    """ATTENTION_QKV_IMBALANCE (warning; info in a run shorter than ``early_steps``):
    max / min of one attention's q, k, v grad norms above ``qkv_ratio`` (10). At init
    q/k get little gradient (uniform attention) while v gets the full signal, so an
    early ratio is expected. Corpus: no pathology case yet (tests/test_analysis_health.py plants one);
    healthy: ``bert_from_init``, ``bert_finetune`` (q/k gradients 10-20x below v's under
    AdamW, update ratios alike: not raised)."""
    by_layer = {lh.layer: lh for lh in ctx.layers}
    early = ctx.run.steps < ctx.th.early_steps and not ctx.window
    out = []
    for parent, group in qkv_groups(by_layer).items():
        gn = {s: by_layer[layer].grad_norm for s, layer in group.items()}
        vals = [v for v in gn.values() if v is not None and v > 0]
        ups = [u for x in group.values() if (u := update_ratio(by_layer[x])) is not None and u > 0]
        if len(ups) == len(group) >= 2 and max(ups) / min(ups) <= ctx.th.qkv_ratio:
            continue  # q, k and v learn at a like pace (an adaptive optimizer)
        if len(vals) >= 2 and max(vals) / min(vals) > ctx.th.qkv_ratio:
            out.append(issue(ctx, IssueType.ATTENTION_QKV_IMBALANCE, INFO if early else WARN,
                             parent, f"q/k/v gradient norms differ {max(vals) / min(vals):.3g}x",
                             **{f"grad_norm_{k}": v for k, v in gn.items()}))  # fmt: skip
    return out


def accumulation_signature(g: np.ndarray) -> tuple[float, float]:
    """``(growth, jitter)`` of a gradient-norm series ``g [rows]`` (finite positive
    values only): last-quarter / first-quarter median, and the median over the rows
    after the first quarter of ``|‖g_t‖ − ‖g_{t−1}‖| / ‖g_t‖``. A summed gradient
    ``S_t = S_{t−1} + δ_t`` changes by one step's gradient while its norm grows with t, so
    its jitter falls like 1/t; a per-step minibatch gradient's norm jumps 10-70% between
    steps (NaN with fewer than 8 values)."""
    g = np.asarray(g, np.float64)
    g = g[np.isfinite(g) & (g > 0)]
    if len(g) < 8:
        return math.nan, math.nan
    q = max(1, len(g) // 4)
    growth = float(np.median(g[-q:]) / np.median(g[:q]))
    jitter = float(np.median((np.abs(np.diff(g)) / g[1:])[q - 1 :]))
    return growth, jitter


@rule("accumulating_gradients", scope="run",
      thresholds=("accumulating_growth", "accumulating_jitter", "accumulating_min_steps"))  # fmt: skip
def accumulating_gradients(ctx: RuleContext) -> list[Issue]:
    """ACCUMULATING_GRAD (warning): gradients summed over steps instead of reset — the
    layer's grad norm grows ``accumulating_growth`` (3) times or more from the first to
    the last quarter of the run while changing from step to step by less than
    ``accumulating_jitter`` (5%) of itself (median; :func:`accumulation_signature`), over
    ``accumulating_min_steps`` (8) steps or more. Causes: ``opt.zero_grad()`` forgotten,
    or parameters left out of the optimizer (``opt.zero_grad()`` resets only its own).
    Corpus: ``zero_grad_forgotten`` (jitter 5e-4, growth 29x),
    ``frozen_left_out_of_optimizer`` (layer 2: jitter 7e-3, growth 12x); healthy: every
    corpus training has jitter ≥ 0.04 (GPT-2 via HF Trainer, the lowest) or a falling
    norm (no healthy layer grows 3x); growing but jumping norms: ``exploding_lr`` (jitter
    ≈ 1), ``batchnorm_eval`` (0.45), ``unshuffled`` (0.11). Not
    separable by this rule: full-batch training whose gradient grows smoothly 3x."""
    th, out = ctx.th, []
    series = ctx.facts.grad_series
    for lh in ctx.layers:
        x = series.get(lh.layer)
        if x is None or np.isfinite(x).sum() < th.accumulating_min_steps:
            continue
        growth, jitter = accumulation_signature(x)
        if growth >= th.accumulating_growth and jitter < th.accumulating_jitter:
            out.append(issue(ctx, IssueType.ACCUMULATING_GRAD, WARN, lh.layer,
                             f"gradient norm grows {growth:.3g}x over {ctx.span} but changes "
                             f"only {jitter:.2%} from step to step: gradients are summed over "
                             "steps, not reset", growth=growth, jitter=jitter))  # fmt: skip
    return out


@rule("frozen_by_mistake", scope="run")
def frozen_by_mistake(ctx: RuleContext) -> list[Issue]:
    """NOT_UPDATED (warning): a layer the optimizer does not train although it should —
    (a) it gets a non-zero gradient at most steps but every recorded update is exactly
    zero (its parameters are missing from the optimizer, or its learning rate is 0), or
    (b) in a run without LoRA adapters, no gradient is recorded for it
    (``requires_grad=False``) while a layer *before* it in forward order trains: freezing
    on purpose freezes a prefix (embeddings, a pretrained encoder) or a LoRA base, not a
    layer in the middle. No threshold. Corpus: ``frozen_left_out_of_optimizer`` (a), ``frozen_requires_grad`` (b); healthy:
    LoRA fine-tuning (base frozen), fine-tuning with a frozen encoder prefix."""
    out = []
    lora = any(lh.lora is not None for lh in ctx.layers)
    trained_before = False
    order = ctx.run.order
    for lh in sorted(ctx.layers, key=lambda x: order.get(x.layer, x.depth)):
        if lh.frozen and not lora and trained_before:
            out.append(issue(ctx, IssueType.NOT_UPDATED, WARN, lh.layer,
                             "no gradient recorded (requires_grad=False) although earlier "
                             "layers train"))  # fmt: skip
        elif (ctx.facts.update_zero.get(lh.layer) and lh.grad_norm
              and ctx.facts.zero_steps.get(lh.layer, 0.0) < 0.5):  # fmt: skip
            out.append(issue(ctx, IssueType.NOT_UPDATED, WARN, lh.layer,
                             f"gradient norm {lh.grad_norm:.3g} but every recorded update is "
                             "exactly 0: the optimizer does not update this layer",
                             grad_norm=lh.grad_norm))  # fmt: skip
        trained_before = trained_before or (lh.grad_norm is not None and not lh.frozen)
    return out


@rule("lr_too_small", scope="run", thresholds=("lr_small_ratio", "lr_small_loss_drop"))
def lr_too_small(ctx: RuleContext) -> list[Issue]:
    """LR_TOO_SMALL (warning, run level): the median over trained layers of their median
    update/param ratio is below ``lr_small_ratio`` (1e-5) and the loss fell by less than
    ``lr_small_loss_drop`` (5%, relative) from the first to the last quarter of the run
    (or no loss is logged). Corpus: ``lr_too_small`` (Adam lr 3e-7: 2.4e-6, loss flat);
    healthy: the lowest median of the healthy corpus is 6.8e-5 (``mha_classifier``,
    AdamW 1e-3 with clipping), fine-tuning BERT 4e-3."""
    th = ctx.th
    ups = [u for lh in ctx.layers if lh.grad_norm is not None and not lh.frozen
           and (u := update_ratio(lh)) is not None and u > 0]  # fmt: skip
    if not ups:
        return []
    med = float(np.median(ups))
    if med >= th.lr_small_ratio:
        return []
    drop = None
    if ctx.run.loss is not None:
        loss = np.asarray(ctx.run.loss, np.float64)
        loss = loss[np.isfinite(loss)]
        if len(loss) >= 4:
            q = max(1, len(loss) // 4)
            first, last = float(np.median(loss[:q])), float(np.median(loss[-q:]))
            drop = (first - last) / abs(first) if first else 0.0
            if drop >= th.lr_small_loss_drop:
                return []
    return [issue(ctx, IssueType.LR_TOO_SMALL, WARN, None,
                  f"median update/param ratio {med:.3g} (< {th.lr_small_ratio:g})"
                  + ("" if drop is None else f" and the loss fell only {drop:.1%}"),
                  median_update_ratio=med, loss_drop=drop)]  # fmt: skip


def loss_period(loss: np.ndarray, min_periods: int = 3) -> tuple[int, float]:
    """``(P, acf)``: the lag ``P`` ≥ 4 (at most a ``1/min_periods`` of the series) at which
    the autocorrelation of the log-loss's step-to-step changes is largest, and that
    autocorrelation (``(0, 0.0)`` for fewer than 24 values). Differences remove the
    loss's downward trend; a periodic data order repeats them."""
    x = np.log(np.maximum(np.asarray(loss, np.float64), 1e-30))
    d = np.diff(x)
    d = d - d.mean() if len(d) else d
    var = float((d * d).sum())
    if len(d) < 24 or var == 0:
        return 0, 0.0
    best = (0, 0.0)
    for lag in range(4, len(d) // min_periods + 1):
        a = float((d[:-lag] * d[lag:]).sum()) / var
        if a > best[1]:
            best = (lag, a)
    return best


@rule("periodic_loss", scope="run", thresholds=("periodic_acf", "periodic_smooth"))
def periodic_loss(ctx: RuleContext) -> list[Issue]:
    """PERIODIC_LOSS (run level): the loss repeats with the data order
    (:func:`loss_period`: autocorrelation of the log-loss's step-to-step changes ≥
    ``periodic_acf`` (0.5) at a lag P, over ≥ 3 periods). A warning when the period's
    loss profile is smooth (:func:`period_profile_smoothness` ≥ ``periodic_smooth``
    (0.5): the data comes in sorted stretches, e.g. class by class, and the model forgets
    what it learnt a stretch ago); info when it is not (the same random batches in the
    same order every epoch: benign). A Keras run's logged loss is a running mean over the
    epoch — a sawtooth with the epoch's period whatever the data order — so its
    per-batch losses are recovered first (:func:`batch_losses`). Corpus: ``unshuffled``
    (acf 0.76, smoothness 0.68); healthy: ``keras_mlp`` (0.87 but smoothness −0.01: a
    fixed batch order, info), ``keras_cnn_bn`` (0.25), ``saturated_tanh`` (−0.04); every
    other corpus run has acf ≤ 0.34."""
    if ctx.run.loss is None:
        return []
    loss = np.asarray(ctx.run.loss, np.float64)
    loss = loss[np.isfinite(loss) & (loss > 0)]
    if ctx.run.loss_is_epoch_mean:
        loss = batch_losses(loss)
    period, acf = loss_period(loss)
    if period == 0 or acf < ctx.th.periodic_acf:
        return []
    smooth = period_profile_smoothness(loss, period)
    sorted_data = smooth >= ctx.th.periodic_smooth
    what = ("it follows the order of the data, which comes in sorted stretches"
            if sorted_data else "the batches come in the same order every epoch")  # fmt: skip
    return [issue(ctx, IssueType.PERIODIC_LOSS, WARN if sorted_data else INFO, None,
                  f"the loss repeats every {period} steps (autocorrelation {acf:.2f} of its "
                  f"step-to-step changes; profile smoothness {smooth:.2f}): {what}",
                  period=period, acf=acf, smoothness=smooth)]  # fmt: skip


def period_profile_smoothness(loss: np.ndarray, period: int) -> float:
    """Lag-1 autocorrelation of the loss's mean profile over one period (log-loss of the
    second half of the run, each period's own mean removed): near 1 when neighbouring
    positions hold like data (a dataset read class by class), near 0 when each position
    is its own random batch (a fixed batch order)."""
    half = np.log(np.asarray(loss, np.float64)[len(loss) // 2 :])
    cycles = len(half) // period
    if cycles < 2:
        return 0.0
    fold = half[: cycles * period].reshape(cycles, period)
    m = (fold - fold.mean(axis=1, keepdims=True)).mean(axis=0)
    m = m - m.mean()
    var = float((m * m).sum())
    return float((m[:-1] * m[1:]).sum()) / var if var > 0 else 0.0


def batch_losses(mean: np.ndarray) -> np.ndarray:
    """Per-batch losses from a running mean over each epoch (Keras's ``logs["loss"]``):
    the epoch restarts where the mean drops most in the fold of the period
    :func:`loss_period` finds; within an epoch ``l_k = k·m_k − (k−1)·m_{k−1}``. The
    input unchanged when no period is found."""
    period, _ = loss_period(mean)
    if period == 0:
        return mean
    d = np.diff(mean)
    cycles = len(d) // period
    phase = int(np.argmin(d[: cycles * period].reshape(cycles, period).mean(axis=0)))
    start = (phase + 1) % period  # the first batch of an epoch
    k = (np.arange(len(mean)) - start) % period + 1
    prev = np.concatenate([[mean[0]], mean[:-1]])
    out = k * mean - (k - 1) * prev
    out = np.where(k == 1, mean, out)
    return np.asarray(out[np.isfinite(out) & (out > 0)], np.float64)


@rule("norm_stats_frozen", scope="run")
def norm_stats_frozen(ctx: RuleContext) -> list[Issue]:
    """NORM_STATS_FROZEN (warning): a normalisation layer whose recorded running
    statistics (BatchNorm ``running_mean``/``running_var``) never change over the run
    while the layer itself trains (a gradient is recorded). No threshold: in training
    mode every forward pass moves them. Corpus: ``batchnorm_eval``; healthy:
    ``cnn_bn_sgd`` (they move every step)."""
    out = []
    for lh in ctx.layers:
        if ctx.facts.running_frozen.get(lh.layer) and lh.grad_norm is not None:
            out.append(issue(ctx, IssueType.NORM_STATS_FROZEN, WARN, lh.layer,
                             "running statistics never change while the layer trains: "
                             "trained in eval mode"))  # fmt: skip
    return out


# ------------------------------------------------------------------ per-window rules
def _swing_severity(ctx: RuleContext, layer: str) -> Severity:
    """Warning when the swings move the weights (largest update ratio of the window at
    least ``turbulence_update``) and the loss does not fall calmly over the window
    (:meth:`RuleContext.learning`: a model learning a new feature moves fast and its
    gradient swings — corpus ``bert_from_init``, ``bert_finetune``); info otherwise or
    without a recorded update."""
    umax = ctx.facts.umax.get(layer)
    moved = umax is not None and umax >= ctx.th.turbulence_update
    return WARN if moved and not ctx.learning() else INFO


def _judged_window(ctx: RuleContext, lh: LayerHealth) -> dict[str, float] | None:
    d = ctx.dynamics.get(lh.layer)
    if d is None or d.get("rows", 0) < ctx.th.trend_min_rows or _has(lh, IssueType.EXPLODING):
        return None
    return d


@rule("turbulent", scope="window", thresholds=("turbulence", "turbulence_update",
                                               "trend_min_rows", "window_loss_fall",
                                               "window_loss_peak"))  # fmt: skip
def turbulent(ctx: RuleContext) -> list[Issue]:
    """TURBULENT: the grad norm's std/mean within a window above ``turbulence`` (1.0);
    a warning only when the window's largest update ratio reaches ``turbulence_update``
    (1e-2), else info; windows of fewer than ``trend_min_rows`` (10) steps are not judged.
    Corpus (and tests/test_health_trend.py, outlier batches under SGD); healthy: the demo (a converged run's
    gradient is noise, std > mean, update ratio ~1e-3), HF BERT fine-tuning."""
    out = []
    for lh in ctx.layers:
        d = _judged_window(ctx, lh)
        cv = lh.grad_norm_cv
        if d is not None and cv is not None and cv > ctx.th.turbulence:
            out.append(issue(ctx, IssueType.TURBULENT, _swing_severity(ctx, lh.layer), lh.layer,
                             f"gradient norm's std is {cv:.3g}x its mean within the window "
                             f"(> {ctx.th.turbulence:g})", turbulence=cv,
                             grad_norm=lh.grad_norm,
                             max_update_ratio=ctx.facts.umax.get(lh.layer)))  # fmt: skip
    return out


@rule("pressure_spike", scope="window", thresholds=("pressure_spike", "turbulence_update",
                                                    "window_loss_fall", "window_loss_peak",
                                                    "trend_min_rows"))  # fmt: skip
def pressure_spike(ctx: RuleContext) -> list[Issue]:
    """PRESSURE_SPIKE: the largest per-step grad/param ratio of a window above
    ``pressure_spike`` (10) times its median; warning / info as TURBULENT. Corpus: no
    pathology case yet (tests/test_health_trend.py, outlier batches); healthy: the demo,
    converged nets."""
    out = []
    for lh in ctx.layers:
        d = _judged_window(ctx, lh)
        if d is None:
            continue
        mp, rel = d.get("max_pressure", math.nan), lh.rel_grad
        if np.isfinite(mp) and rel and mp > ctx.th.pressure_spike * rel:
            out.append(issue(ctx, IssueType.PRESSURE_SPIKE, _swing_severity(ctx, lh.layer),
                             lh.layer, f"max grad/param ratio {mp:.3g} is {mp / rel:.3g}x the "
                             f"window's median ({rel:.3g})", max_pressure=mp, rel_grad=rel,
                             max_update_ratio=ctx.facts.umax.get(lh.layer)))  # fmt: skip
    return out


def _rate(v: float) -> str:
    """A growth rate ``d ln x / d step`` as the change per step it means."""
    return f"{math.expm1(v):+.1%}" if abs(v) < 0.7 else f"×{math.exp(v):.3g}"


@rule("accelerating", scope="window", thresholds=("accelerating_growth", "accelerating_t",
                                                  "window_loss_fall", "window_loss_peak",
                                                  "trend_min_rows"))  # fmt: skip
def accelerating(ctx: RuleContext) -> list[Issue]:
    """ACCELERATING (warning): a growing grad norm whose growth rate rises within the
    window so much that at its end the norm grows ``accelerating_growth`` (10) times more
    per window than at its start, curvature ≥ ``accelerating_t`` (3) standard errors.
    Info when the loss falls calmly over the window (:meth:`RuleContext.learning`:
    the gradient grows as a new feature is learnt — corpus ``bert_from_init``). Corpus:
    no pathology case yet (tests/test_health_trend.py, a second-half explosion);
    healthy: warm-up phases of the HF runs (``gpt2_trainer``)."""
    out = []
    log_growth = math.log(ctx.th.accelerating_growth)
    for lh in ctx.layers:
        d = _judged_window(ctx, lh)
        if d is None:
            continue
        a, v, span = d.get("acceleration", math.nan), d.get("velocity", math.nan), d["span"]
        if (np.isfinite(a) and a > 0 and v > 0 and d.get("t_stat", 0) >= ctx.th.accelerating_t
                and a * span * span >= log_growth):  # fmt: skip
            v0, v1 = v - a * span / 2, v + a * span / 2
            out.append(issue(ctx, IssueType.ACCELERATING, INFO if ctx.learning() else WARN,
                             lh.layer,
                             f"gradient norm accelerating: its growth rate rose from "
                             f"{_rate(v0)} to {_rate(v1)} per step", velocity=v,
                             acceleration=a, velocity_start=v0, velocity_end=v1,
                             t_stat=d.get("t_stat")))  # fmt: skip
    return out


# ------------------------------------------------------------------ the driver
def judge(ctx: RuleContext, only: Callable[[str], bool] | None = None) -> list[Issue]:
    """Run every registered rule whose scope fits ``ctx`` (run or window) in registration
    order; each layer's issues join its :class:`LayerHealth` at once, the others are
    returned (run level)."""
    by_layer = {lh.layer: lh for lh in ctx.layers}
    run_issues: list[Issue] = []
    want = "window" if ctx.window else "run"
    for name, r in rules().items():
        if r.scope not in (want, "both") or (only is not None and not only(name)):
            continue
        for i in r.fn(ctx):
            (by_layer[i.layer].issues if i.layer in by_layer else run_issues).append(i)
    return run_issues


__all__ = ["RuleContext", "advice", "issue", "judge", "role_group"]
