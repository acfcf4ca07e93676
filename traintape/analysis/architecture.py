"""Architecture-aware health checks: where in a network's *structure* gradient or signal
flow breaks down.

:func:`architecture` reads the same per-layer stats as :func:`~traintape.analysis.health`
(and, for the head and gate checks, a few snapshots) and reports measures per structure
plus issues, each with a recommendation. :func:`~traintape.analysis.health` runs it and
merges its issues (an issue whose ``layer`` is a layer of the health table joins that
layer's issues, the others are run-level). Thresholds: :class:`ArchitectureThresholds`
(defaults in parentheses below).

**BOTTLENECK** (per layer; gradient stats). The *units* are the trainable layers in forward
order, except norm layers, embeddings and LoRA factors (whose gradient scale differs from a
weight matrix's by design), with the q/k/v/o projections of one attention merged into one
unit (the attention layer; their imbalance is ATTENTION_QKV_IMBALANCE's). A unit's measure
is its ``rel_grad``, the median over steps of ``‖g‖₂ / ‖θ‖₂`` (the gradient norm ``‖g‖₂``
unless every unit has a recorded param norm). A unit whose measure is below
``bottleneck_ratio`` (1e-2) times the *smaller* of its two neighbours' (the nearest units
before and after it) is a BOTTLENECK — a local collapse, not a decay with depth: gradient
reaches the layers on both sides but not this one (a saturated nonlinearity inside a
residual branch, a stray gradient scale or ``detach``). Critical below
``bottleneck_ratio_critical`` (1e-3). The first and last unit (one neighbour) and units with
exactly zero gradient (DEAD) are not judged.

**RESIDUAL_DECAY** (on the stack's prefix, ``blocks``; activation stats). A *stack* is the
activations ``<prefix>/<i>/output`` (integer ``i``: ``blocks/3``, ``layers/10``, ``h/0``)
of at least three blocks with one and the same per-example shape — the residual stream of a
transformer or ResNet stage is every block's output. Per block, ``rms`` is the median over
steps of the output's root mean square ``sqrt(mean² + std²)`` (scale-free in batch size);
``factor`` is ``exp(slope)`` of the least-squares line of ``ln rms`` over the block index
(the geometric growth per block) and ``total`` is ``rms_last / rms_first``. The stack is
RESIDUAL_DECAY when ``factor ≥ residual_factor`` (2) and ``total ≥ residual_total`` (10)
(the stream explodes) or ``factor ≤ 1/residual_factor`` and ``total ≤ 1/residual_total``
(it collapses); critical when ``total`` or its inverse reaches ``residual_total_critical``
(1e3). A healthy pre-norm stack grows about linearly with depth (each block adds an O(1)
update), far below a factor 2 per block.

**ATTENTION_FFN_IMBALANCE** (on the block; gradient stats). An attention's *block* is the
nearest layer enclosing it that also holds FFN layers — every trainable layer that is not an
attention projection, norm, embedding or LoRA factor: ``blocks/0`` for ``blocks/0/attn/q``
with ``blocks/0/mlp/fc1``; BERT's ``layer/0`` for ``layer/0/attention/self/query`` with
``layer/0/intermediate/dense`` and ``layer/0/output/dense``. A layer holding the
attentions of several blocks and one FFN is no block (noted). Per step,
``E_attn = Σ‖g‖²`` over the attention projections and ``E_ffn`` likewise; ``attn_share`` is
the median over steps of ``E_attn / (E_attn + E_ffn)`` and ``ratio`` the median of
``sqrt(E_attn / E_ffn)``. A block whose ``ratio`` is above ``attn_ffn_ratio`` (100) or
below its inverse is ATTENTION_FFN_IMBALANCE (one path of the block barely learns).

**ATTENTION_HEAD_IMBALANCE** (on the attention layer; grad snapshots). Heads are read from
the canonical layout: column ``h·head_dim + d`` of a q/k/v kernel (in, heads·head_dim) is
head ``h``, and so is row ``h·head_dim + d`` of the o kernel. The number of heads is not in
the store's layout for every framework; it is taken from, first match wins: the ``heads``
argument (an int, or a mapping from attention layer path or ``fnmatch`` pattern to int), the
manifest's ``user["attention_heads"]`` (same forms, e.g. ``Recorder(...,
user={"attention_heads": 8})``), or a three-axis ``source_shape`` ``(in, heads, head_dim)``
of the q kernel (Flax ``DenseGeneral``, Keras ``MultiHeadAttention``). Per projection and
head, the gradient norm over the last ``max_snapshots`` (3) gradient snapshots (root mean
square over them); an attention whose ``max / min`` head norm of any projection exceeds
``head_ratio`` (30) is ATTENTION_HEAD_IMBALANCE (a collapsed or dominating head). Fused
q/k/v projections (GPT-2's ``c_attn``) are not split.

**Recurrent layers** (layer kind ``lstm``/``gru``; snapshots). The gate blocks are the
``G`` blocks of ``hidden`` along the last axis of ``kernel_ih``, ``kernel_hh``, ``bias_ih``
and ``bias_hh`` in the canonical gate order (LSTM ``i, f, g, o``; GRU ``r, z, n``).

- *Per-gate gradient share* (:class:`GateShare`): per grad snapshot (the last
  ``max_snapshots``), ``Σ‖g_gate‖²`` over the four tensors divided by the layer's total;
  the median over snapshots.
- **GATE_SATURATION** (per layer): a gate whose gradient share is at most
  ``gate_share_ratio`` (1e-2) times the median share of the layer's other gates *and*
  whose bias ``b = bias_ih + bias_hh`` (median over units, last param snapshot) is at
  least ``gate_bias_saturated`` (3) in absolute value. The pre-activations themselves are
  not recorded (a recurrent layer's activation is its output ``h``), so two signals stand
  in for them: the bias is the cause — the pre-activation's offset; at ``|b| ≥ 3``
  ``σ'(b)`` is under 0.18 of its peak and ``tanh'(b)`` under 0.01 — and the gradient share
  is the effect — the gate's derivative ``σ(1−σ)`` (``1 − tanh²``) is ≈ 0 where the
  pre-activations sit, so the gradient reaching its kernel and bias blocks collapses
  relative to the other gates, which see the same inputs. Neither alone is enough: the
  kernels add ``x·W + h·U`` of unknown scale to the bias, and a gate's gradient can be
  small by design (GRU's reset gate only acts through ``h·U_n``, small while ``h`` and
  ``U`` are, and gets about 1% of its siblings' gradient early in healthy training).
  Without biases (no param snapshots, ``bias=False``) the rule is not applied.
- **FORGET_GATE_CLOSED** (per layer, LSTM): the median over units of the forget-gate bias
  ``b_f = bias_ih[f] + bias_hh[f]`` (last param snapshot) is at most ``forget_bias_closed``
  (−3: σ = 0.047) — critical at ``forget_bias_closed_critical`` (−6: σ = 0.0025). The
  forget gate is then ≈ 0 for inputs of ordinary scale and the cell state is wiped at every
  step: the layer has no memory beyond one step. Judged from the bias because the bias is
  the gate's offset that the optimiser must undo, and a closed forget gate also has
  vanishing gradient (so it stays closed); a forget gate reported closed is not also
  reported GATE_SATURATION.

Without snapshots of the needed kind the head and gate measures are not computed; each
such case is named in :attr:`ArchitectureReport.notes`. Snapshots are read one tensor at a
time, at most ``max_snapshot_bytes`` (1 GiB) of them in all (what the budget leaves out is
noted too), so that ``health`` on a large model stays cheap.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator

from traintape.analysis._common import (
    StatsCache,
    Tracker,
    column_median,
    finite_float,
    forward_rank,
    layer_norms,
    layer_of,
    natural_key,
    tensor_rank,
)
from traintape.analysis.change import attention_projection, component
from traintape.analysis.issues import Issue, IssueType, Severity
from traintape.schema import Kind, split_name
from traintape.schema.roles import (
    BIAS_HH,
    BIAS_IH,
    GRU,
    GRU_GATES,
    KERNEL_HH,
    KERNEL_IH,
    LSTM,
    LSTM_GATES,
)

if TYPE_CHECKING:
    from traintape.core.reader import Run

ArchIssueType = Literal[
    "BOTTLENECK",
    "RESIDUAL_DECAY",
    "ATTENTION_FFN_IMBALANCE",
    "ATTENTION_HEAD_IMBALANCE",
    "GATE_SATURATION",
    "FORGET_GATE_CLOSED",
]
"""The issue types of this module (members of :class:`~traintape.analysis.IssueType`)."""

RECOMMENDATIONS: dict[str, str] = {
    "BOTTLENECK": "gradient collapses at this layer while its neighbours get plenty: look "
    "for a saturated nonlinearity (large bias or pre-activation) inside it, a stray "
    "detach/stop-gradient or gradient scale, or a near-zero weight or norm scale; "
    "re-initialise the layer or normalise its input",
    "RESIDUAL_DECAY": "the residual stream's scale changes geometrically across blocks: use "
    "pre-norm blocks (LayerNorm/RMSNorm before each branch), scale the branch output "
    "projections down at init (e.g. std/sqrt(2·blocks)) or add LayerScale, and keep the "
    "skip connection an identity",
    "ATTENTION_FFN_IMBALANCE": "one path of the block barely learns: check the init scale "
    "of the attention (or FFN) projections, the attention scaling 1/sqrt(head_dim), masks "
    "that leave nothing to attend to, and per-parameter-group learning rates",
    "ATTENTION_HEAD_IMBALANCE": "some heads get almost no gradient (collapsed heads) or one "
    "dominates: check the q/k initialisation and the 1/sqrt(head_dim) scaling, add "
    "QK-normalisation, or prune the dead heads",
    "GATE_SATURATION": "this gate's pre-activations sit where sigmoid/tanh are flat, so it "
    "no longer learns: reset its bias to 0 (forget gate: 1), scale down the input or the "
    "recurrent kernel, normalise the layer's input, or clip gradients and lower the "
    "learning rate if the bias drifted there",
    "FORGET_GATE_CLOSED": "the forget gate is ≈ 0, so the cell state is wiped every step "
    "and the LSTM has no memory: initialise the forget-gate bias to +1 (the usual "
    "unit_forget_bias), and check for a sign error in a hand-written bias init",
}
"""One recommendation per issue type."""


class ArchitectureThresholds(BaseModel):
    """Thresholds of the architecture checks (the module docstring says how each is used).

    Ratios are plain factors; biases are in pre-activation units (the gate's logit)."""

    bottleneck_ratio: float = Field(
        1e-2, gt=0, lt=1, description="BOTTLENECK: measure / smaller neighbour's below this"
    )
    bottleneck_ratio_critical: float = Field(
        1e-3, gt=0, lt=1, description="BOTTLENECK is critical below this fraction"
    )
    residual_factor: float = Field(
        2.0, gt=1, description="RESIDUAL_DECAY: fitted growth per block ≥ this (or ≤ 1/this)"
    )
    residual_total: float = Field(
        10.0, gt=1, description="RESIDUAL_DECAY: and last/first block rms ≥ this (≤ 1/this)"
    )
    residual_total_critical: float = Field(
        1e3, gt=1, description="RESIDUAL_DECAY is critical at last/first ≥ this (≤ 1/this)"
    )
    attn_ffn_ratio: float = Field(
        100.0, gt=1, description="ATTENTION_FFN_IMBALANCE: ‖g_attn‖/‖g_ffn‖ > this or < 1/this"
    )
    head_ratio: float = Field(
        30.0, gt=1, description="ATTENTION_HEAD_IMBALANCE: max/min per-head grad norm > this"
    )
    gate_share_ratio: float = Field(
        1e-2, gt=0, lt=1, description="GATE_SATURATION: share ≤ this × other gates' median"
    )
    gate_bias_saturated: float = Field(
        3.0, gt=0, description="GATE_SATURATION: and |median gate bias| ≥ this"
    )
    forget_bias_closed: float = Field(
        -3.0, description="FORGET_GATE_CLOSED: median forget-gate bias ≤ this"
    )
    forget_bias_closed_critical: float = Field(
        -6.0, description="FORGET_GATE_CLOSED is critical at a median bias ≤ this"
    )
    max_snapshots: int = Field(3, ge=1, description="snapshots read per tensor (the last ones)")
    max_snapshot_bytes: int = Field(
        1 << 30, ge=0, description="at most this many bytes of snapshots read in all"
    )

    @model_validator(mode="after")
    def _ordered(self) -> ArchitectureThresholds:
        if self.bottleneck_ratio_critical > self.bottleneck_ratio:
            raise ValueError(
                f"bottleneck_ratio_critical ({self.bottleneck_ratio_critical:g}) must not "
                f"exceed bottleneck_ratio ({self.bottleneck_ratio:g})"
            )
        if self.forget_bias_closed_critical > self.forget_bias_closed:
            raise ValueError(
                f"forget_bias_closed_critical ({self.forget_bias_closed_critical:g}) must not "
                f"exceed forget_bias_closed ({self.forget_bias_closed:g})"
            )
        return self


ArchIssue = Issue
"""An architecture issue: the one :class:`~traintape.analysis.issues.Issue` model;
``layer`` is the layer, attention, block or stack it is about."""


class UnitGradient(BaseModel):
    """A unit of the BOTTLENECK rule (a layer, or an attention with its projections)."""

    unit: str
    layers: list[str]
    measure: float | None = Field(description="median ‖g‖/‖θ‖ (or ‖g‖, see measure_name)")


class BlockShare(BaseModel):
    """Attention vs FFN gradient of one block (medians over steps)."""

    block: str
    attention: list[str] = Field(description="attention projection layers")
    ffn: list[str] = Field(description="the block's other weight layers")
    attn_share: float | None = Field(None, description="median E_attn / (E_attn + E_ffn)")
    ratio: float | None = Field(None, description="median sqrt(E_attn / E_ffn)")


class ResidualProfile(BaseModel):
    """The output scale of one stack of same-shaped blocks, in forward order."""

    stack: str
    blocks: list[str]
    rms: list[float | None] = Field(description="median sqrt(mean² + std²) per block")
    factor: float | None = Field(None, description="geometric growth per block (fit)")
    total: float | None = Field(None, description="rms of the last / of the first block")


class HeadBalance(BaseModel):
    """Per-head gradient norms of one attention, from grad snapshots."""

    attention: str
    heads: int
    heads_source: str = Field(description="argument, user.attention_heads or source_shape")
    steps: list[int] = Field(description="snapshot steps used")
    grad_norm: dict[str, list[float]] = Field(
        description="projection → per-head gradient norm (RMS over the snapshots)"
    )
    ratio: dict[str, float | None] = Field(description="projection → max / min head norm")


class GateShare(BaseModel):
    """Per-gate gradient share and bias of one recurrent layer."""

    layer: str
    layer_kind: Literal["lstm", "gru"]
    gates: list[str]
    hidden: int
    grad_steps: list[int] = Field(default_factory=list, description="grad snapshot steps used")
    grad_share: list[float] | None = Field(
        None, description="per gate: median over snapshots of its share of Σ‖g‖²"
    )
    bias_step: int | None = Field(None, description="param snapshot step of the biases")
    bias_median: list[float] | None = Field(
        None, description="per gate: median over units of bias_ih + bias_hh"
    )


class ArchitectureReport(BaseModel):
    """What :func:`architecture` measured per structure, its issues, and what it skipped."""

    url: str
    thresholds: ArchitectureThresholds
    measure_name: Literal["rel_grad", "grad_norm"] | None = Field(
        None, description="what UnitGradient.measure is"
    )
    units: list[UnitGradient] = Field(default_factory=list)
    blocks: list[BlockShare] = Field(default_factory=list)
    residual: list[ResidualProfile] = Field(default_factory=list)
    heads: list[HeadBalance] = Field(default_factory=list)
    gates: list[GateShare] = Field(default_factory=list)
    issues: list[ArchIssue] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list, description="checks skipped, and why")


HeadsSpec = int | Mapping[str, int]
"""Number of attention heads: one int for every attention, or ``{attention layer path or
fnmatch pattern: int}``."""


def _issue(t: ArchIssueType, severity: str, layer: str | None, msg: str, **ev: Any) -> ArchIssue:
    clean = {
        k: (finite_float(v) if isinstance(v, float | np.floating) else v) for k, v in ev.items()
    }
    return Issue(type=IssueType(t), severity=Severity(severity), layer=layer, message=msg,
                 recommendation=RECOMMENDATIONS[t], evidence=clean)  # fmt: skip


def _median(series: np.ndarray) -> float | None:
    """Median over rows of a ``[rows]`` series, ignoring NaN/Inf (None if none is finite)."""
    return finite_float(float(column_median(np.asarray(series, np.float64)[:, None])[0]))


def want_architecture(run: Run, cache: StatsCache) -> None:
    """Declare the stats :func:`architecture` reads (a subset of what health reads)."""
    for kind in (Kind.GRAD, Kind.PARAM):
        cache.want(kind, "l2", "norm")
    for stat in ("mean", "std"):
        cache.want(Kind.ACTIVATION, stat, "mean")


def _layer_components(run: Run, kind: Kind) -> dict[str, str]:
    """Layer → component class (:func:`~traintape.analysis.change.component`) of its
    tensors of ``kind``: ``attention`` (any projection), ``lora``, ``norm``, ``embedding``
    or ``mlp``."""
    out: dict[str, set[str]] = {}
    for spec in run.manifest.specs(kind):
        c = component(spec.name, spec.role, spec.layer_kind).split("/")[0]
        out.setdefault(layer_of(spec.name), set()).add(c)
    order = ("lora", "attention", "embedding", "norm")
    return {layer: next((c for c in order if c in cs), "mlp") for layer, cs in out.items()}


def _attention_parent(layer: str) -> str | None:
    """The attention layer holding projection ``layer`` (None if it is not a projection)."""
    p = attention_projection(layer)
    return split_name(layer)[0] if p is not None else None


# ----------------------------------------------------------------------------- stats
def _units(run: Run, layers: list[str], comp: dict[str, str]) -> list[tuple[str, list[str]]]:
    """BOTTLENECK units in forward order: ``(unit, member layers)``; ``layers`` in forward
    order. An attention unit takes the place of the attention layer (its projections may
    have no forward position of their own: torch records the attention's output only)."""
    units: dict[str, list[str]] = {}
    for layer in layers:
        c = comp.get(layer, "mlp")
        if c in ("norm", "embedding", "lora"):
            continue
        parent = _attention_parent(layer) if c == "attention" else None
        key = layer if parent is None else parent
        units.setdefault(key, []).append(layer)
    rank = forward_rank(run)
    order = {u: i for i, u in enumerate(units)}
    return sorted(units.items(), key=lambda kv: (tensor_rank(rank, kv[0] + "/_"), order[kv[0]]))


def _bottlenecks(
    run: Run, cache: StatsCache, th: ArchitectureThresholds, rep: ArchitectureReport
) -> None:
    if Kind.GRAD not in run.kinds() or not run.tensor_names(Kind.GRAD) or not run.rows:
        return
    _, g_layers, g = layer_norms(run, Kind.GRAD, cache)
    p_layers: list[str] = []
    p = None
    if Kind.PARAM in run.kinds() and run.tensor_names(Kind.PARAM):
        _, p_layers, p = layer_norms(run, Kind.PARAM, cache)
    gcol = {x: i for i, x in enumerate(g_layers)}
    pcol = {x: i for i, x in enumerate(p_layers)}
    units = _units(run, g_layers, _layer_components(run, Kind.GRAD))
    if len(units) < 3:
        return
    g64 = np.asarray(g, dtype=np.float64)
    use_rel = p is not None and all(x in pcol for _, members in units for x in members)
    measures: list[float | None] = []
    for _, members in units:
        gn = np.sqrt(np.sum(g64[:, [gcol[x] for x in members]] ** 2, axis=1))
        if use_rel:
            assert p is not None
            pn = np.sqrt(
                np.sum(np.asarray(p, np.float64)[:, [pcol[x] for x in members]] ** 2, axis=1)
            )
            with np.errstate(all="ignore"):
                series = gn / pn
        else:
            series = gn
        measures.append(_median(series))
    rep.measure_name = "rel_grad" if use_rel else "grad_norm"
    rep.units = [UnitGradient(unit=u, layers=m, measure=v)
                 for (u, m), v in zip(units, measures, strict=True)]  # fmt: skip
    what = "relative gradient ‖g‖/‖θ‖" if use_rel else "gradient norm"
    for i in range(1, len(units) - 1):
        v, prev, nxt = measures[i], measures[i - 1], measures[i + 1]
        if v is None or v <= 0 or not prev or not nxt:
            continue
        frac = v / min(prev, nxt)
        if frac >= th.bottleneck_ratio:
            continue
        sev = "critical" if frac < th.bottleneck_ratio_critical else "warning"
        rep.issues.append(_issue(
            "BOTTLENECK", sev, units[i][0],
            f"{what} {v:.3g} is {frac:.2g}x its neighbours' ({units[i - 1][0]!r} {prev:.3g}, "
            f"{units[i + 1][0]!r} {nxt:.3g})",
            measure=rep.measure_name, value=v, previous=units[i - 1][0], previous_value=prev,
            next=units[i + 1][0], next_value=nxt, fraction=frac,
        ))  # fmt: skip


def _blocks(
    run: Run, cache: StatsCache, th: ArchitectureThresholds, rep: ArchitectureReport
) -> None:
    if Kind.GRAD not in run.kinds() or not run.tensor_names(Kind.GRAD) or not run.rows:
        return
    _, g_layers, g = layer_norms(run, Kind.GRAD, cache)
    comp = _layer_components(run, Kind.GRAD)
    gcol = {x: i for i, x in enumerate(g_layers)}
    attn_layers = [x for x in g_layers if comp.get(x) == "attention" and _attention_parent(x)]
    parents = {_attention_parent(x) for x in attn_layers}
    ffn_layers = [x for x in g_layers if comp.get(x) == "mlp" and x not in parents]

    def ffn_under(b: str) -> list[str]:  # an attention's own tensors (bias_k) are not FFN
        return [x for x in ffn_layers if x.startswith(b + "/")]

    attn: dict[str, list[str]] = {}
    homes: dict[str, set[str]] = {}
    for layer in attn_layers:
        home = layer_of(_attention_parent(layer) or "")
        block = home  # the nearest enclosing layer with an FFN (BERT: attention/self → layer/i)
        while block and not ffn_under(block):
            block = layer_of(block)
        if block:
            attn.setdefault(block, []).append(layer)
            homes.setdefault(block, set()).add(home)
    g64 = np.asarray(g, dtype=np.float64)
    for block, a_layers in attn.items():
        if len(homes[block]) > 1:  # attentions of several blocks share one FFN: no block
            rep.notes.append(f"attention/FFN share: {block!r} holds the attentions of "
                             f"{sorted(homes[block])} and one FFN; not compared")  # fmt: skip
            continue
        ffn = ffn_under(block)
        ea = np.sum(g64[:, [gcol[x] for x in a_layers]] ** 2, axis=1)
        ef = np.sum(g64[:, [gcol[x] for x in ffn]] ** 2, axis=1)
        with np.errstate(all="ignore"):
            share = _median(ea / (ea + ef))
            ratio = _median(np.sqrt(ea / ef))
        rep.blocks.append(BlockShare(block=block, attention=a_layers, ffn=ffn,
                                     attn_share=share, ratio=ratio))  # fmt: skip
        if ratio is None or ratio <= 0:
            continue
        if ratio > th.attn_ffn_ratio or ratio < 1 / th.attn_ffn_ratio:
            weak = "attention" if ratio < 1 else "FFN"
            rep.issues.append(_issue(
                "ATTENTION_FFN_IMBALANCE", "warning", block,
                f"attention/FFN gradient norm ratio {ratio:.3g} (attention share "
                f"{share or 0:.3g} of the block's gradient energy): the {weak} barely learns",
                attn_share=share, ratio=ratio, attention=a_layers, ffn=ffn,
            ))  # fmt: skip


def _residual(
    run: Run, cache: StatsCache, th: ArchitectureThresholds, rep: ArchitectureReport
) -> None:
    if Kind.ACTIVATION not in run.kinds() or not run.tensor_names(Kind.ACTIVATION):
        return
    if not run.rows:
        return
    groups: dict[tuple[str, tuple], list[tuple[int, str]]] = {}
    for spec in run.manifest.specs(Kind.ACTIVATION):
        layer = layer_of(spec.name)
        parent, _, idx = layer.rpartition("/")
        if not idx.isdigit():
            continue
        shape = tuple(spec.shape[1:])
        groups.setdefault((parent, shape), []).append((int(idx), layer))
    if not any(len(v) >= 3 for v in groups.values()):
        return
    a_layers = cache.groups(Kind.ACTIVATION).layers
    col = {x: i for i, x in enumerate(a_layers)}
    mean = np.asarray(cache.series(Kind.ACTIVATION, "mean", "mean"), np.float64)
    std = np.asarray(cache.series(Kind.ACTIVATION, "std", "mean"), np.float64)
    rms_all = column_median(np.sqrt(mean**2 + std**2))
    for (stack, _), members in sorted(groups.items(), key=lambda kv: natural_key(kv[0][0])):
        if len(members) < 3:
            continue
        members.sort()
        blocks = [x for _, x in members]
        rms = [finite_float(rms_all[col[x]]) for x in blocks]
        prof = ResidualProfile(stack=stack or "<root>", blocks=blocks, rms=rms)
        rep.residual.append(prof)
        if any(r is None or r <= 0 for r in rms):
            continue
        y = np.log(np.asarray(rms, dtype=np.float64))
        slope = float(np.polyfit(np.arange(len(y), dtype=np.float64), y, 1)[0])
        prof.factor, prof.total = math.exp(slope), rms[-1] / rms[0]  # type: ignore[operator]
        f, tot = prof.factor, prof.total
        grows = f >= th.residual_factor and tot >= th.residual_total
        shrinks = f <= 1 / th.residual_factor and tot <= 1 / th.residual_total
        if not (grows or shrinks):
            continue
        extreme = max(tot, 1 / tot) >= th.residual_total_critical
        verb = "grows" if grows else "decays"
        rep.issues.append(_issue(
            "RESIDUAL_DECAY", "critical" if extreme else "warning", prof.stack,
            f"block output scale {verb} {f:.3g}x per block over {len(blocks)} blocks "
            f"({tot:.3g}x from {blocks[0]!r} to {blocks[-1]!r})",
            factor=f, total=tot, profile=dict(zip(blocks, rms, strict=True)),
        ))  # fmt: skip


# ------------------------------------------------------------------------- snapshots
def _last_steps(run: Run, names: list[str], kind: Kind, n: int) -> list[int]:
    """The last ``n`` snapshot steps that every tensor of ``names`` has."""
    common: set[int] | None = None
    for name in names:
        s = {int(x) for x in run.snapshot_steps(name, kind)}
        common = s if common is None else common & s
    return sorted(common or ())[-n:]


def _heads_of(
    run: Run, attn: str, q_name: str, width: int, heads: HeadsSpec | None
) -> tuple[int, str] | None:
    """Number of heads of attention ``attn`` and where it came from (module docstring)."""

    def pick(spec: Any, source: str) -> tuple[int, str] | None:
        v: Any = None
        if isinstance(spec, int) and not isinstance(spec, bool):
            v = spec
        elif isinstance(spec, Mapping):
            v = spec.get(attn)
            if v is None:
                v = next(
                    (x for pat, x in spec.items() if fnmatch.fnmatchcase(attn, str(pat))), None
                )
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or width % v:
            raise ValueError(
                f"{source}: {v!r} attention heads for {attn!r}, whose q kernel has "
                f"{width} columns; give a positive integer that divides {width}"
            )
        return v, source

    got = pick(heads, "argument") if heads is not None else None
    if got is None:
        got = pick((run.manifest.user or {}).get("attention_heads"), "user.attention_heads")
    if got is None:
        src = run.spec(q_name, Kind.GRAD).source_shape
        if src is not None and len(src) == 3 and src[1] and src[2] and src[1] * src[2] == width:
            got = (int(src[1]), "source_shape")
    return got


class _Budget:
    """The bytes of snapshots left to read (``max_snapshot_bytes``)."""

    def __init__(self, run: Run, nbytes: int) -> None:
        self.run, self.left = run, nbytes

    def take(self, kind: Kind, names: list[str], steps: list[int]) -> bool:
        """Reserve the bytes of ``names`` at ``steps``; False (nothing reserved) if over."""
        size = 0
        for n in names:
            spec = self.run.spec(n, kind)
            try:
                item = np.dtype(spec.dtype).itemsize
            except TypeError:  # bfloat16 and other dtypes numpy does not name: stored widened
                item = 4
            size += item * math.prod(int(d or 0) for d in spec.shape) * len(steps)
        if size > self.left:
            return False
        self.left -= size
        return True


_OVER_BUDGET = "snapshot read budget (max_snapshot_bytes) spent"


def _head_balance(
    run: Run,
    th: ArchitectureThresholds,
    rep: ArchitectureReport,
    heads: HeadsSpec | None,
    budget: _Budget,
) -> None:
    names = set(run.tensor_names(Kind.GRAD)) if Kind.GRAD in run.kinds() else set()
    by_attn: dict[str, dict[str, str]] = {}
    for name in sorted(names, key=natural_key):
        layer, role = split_name(name)
        p = attention_projection(layer)
        if p in ("q", "k", "v", "o") and role == "kernel":
            by_attn.setdefault(split_name(layer)[0], {})[p] = name
    for attn, proj in by_attn.items():
        if "q" not in proj:
            continue
        width = run.spec(proj["q"], Kind.GRAD).shape[-1]
        if width is None:
            continue
        got = _heads_of(run, attn, proj["q"], int(width), heads)
        if got is None:
            rep.notes.append(f"attention heads: number of heads of {attn!r} unknown (pass "
                             "heads= or record user={'attention_heads': N})")  # fmt: skip
            continue
        h, source = got
        if h < 2:
            continue
        tensors = [proj[p] for p in "qkvo" if p in proj]
        steps = _last_steps(run, tensors, Kind.GRAD, th.max_snapshots)
        if not steps:
            rep.notes.append(f"attention heads: no grad snapshots of {attn!r}")
            continue
        if not budget.take(Kind.GRAD, tensors, steps):
            rep.notes.append(f"attention heads: {attn!r} not measured: {_OVER_BUDGET}")
            continue
        norms: dict[str, list[float]] = {}
        ratios: dict[str, float | None] = {}
        raw: dict[str, float] = {}  # max/min, inf where a head's gradient is exactly 0
        for p in "qkvo":
            if p not in proj:
                continue
            acc = np.zeros(h)
            for step in steps:
                x = np.asarray(run.snapshot(proj[p], Kind.GRAD, step), dtype=np.float64)
                if p == "o":  # rows h·d + i
                    x = x.reshape(h, -1)
                    acc += np.sum(x * x, axis=1)
                else:  # columns h·d + i
                    x = x.reshape(-1, h, x.shape[-1] // h)
                    acc += np.sum(x * x, axis=(0, 2))
            per = np.sqrt(acc / len(steps))
            norms[p] = [float(v) for v in per]
            ratios[p] = finite_float(per.max() / per.min()) if per.min() > 0 else None
            if per.max() > 0:
                raw[p] = float(per.max() / per.min()) if per.min() > 0 else math.inf
        rep.heads.append(HeadBalance(attention=attn, heads=h, heads_source=source, steps=steps,
                                     grad_norm=norms, ratio=ratios))  # fmt: skip
        worst = max(raw.items(), key=lambda t: t[1], default=None)
        if worst is not None and worst[1] > th.head_ratio:
            p, r = worst
            weakest = int(np.argmin(norms[p]))
            differ = (f"differ {r:.3g}x" if math.isfinite(r)
                      else "differ: one is exactly 0, a head that never learns")  # fmt: skip
            rep.issues.append(_issue(
                "ATTENTION_HEAD_IMBALANCE", "warning", attn,
                f"{p} gradient norms of its {h} heads {differ} (weakest: head {weakest})",
                projection=p, ratio=r, weakest_head=weakest, heads=h, heads_source=source,
                head_grad_norms=norms[p], steps=steps,
            ))  # fmt: skip


def _gates(run: Run, th: ArchitectureThresholds, rep: ArchitectureReport, budget: _Budget) -> None:
    kinds = set(run.kinds())
    p_names = set(run.tensor_names(Kind.PARAM)) if Kind.PARAM in kinds else set()
    g_names_all = set(run.tensor_names(Kind.GRAD)) if Kind.GRAD in kinds else set()
    layers: dict[str, dict[str, str]] = {}
    lk: dict[str, str] = {}
    specs = {
        s.name: s for k in (Kind.GRAD, Kind.PARAM) if k in kinds for s in run.manifest.specs(k)
    }
    for name in sorted(specs, key=natural_key):
        spec = specs[name]
        if spec.layer_kind in (LSTM, GRU) and spec.role in (KERNEL_IH, KERNEL_HH, BIAS_IH, BIAS_HH):
            layers.setdefault(spec.layer, {})[spec.role] = name
            lk[spec.layer] = spec.layer_kind
    for layer in sorted(layers, key=natural_key):
        roles, kind_name = layers[layer], lk[layer]
        gates = LSTM_GATES if kind_name == LSTM else GRU_GATES
        any_name = next(iter(roles.values()))
        width = specs[any_name].shape[-1]
        if width is None or width % len(gates):
            rep.notes.append(f"gates: {layer!r}: last axis {width} is not {len(gates)} gates")
            continue
        hid = int(width) // len(gates)
        gs = GateShare(
            layer=layer,
            layer_kind=kind_name,
            gates=list(gates),
            hidden=hid,  # type: ignore[arg-type]
        )
        # per-gate gradient share from grad snapshots
        g_names = [n for n in roles.values() if n in g_names_all]
        steps = _last_steps(run, g_names, Kind.GRAD, th.max_snapshots) if g_names else []
        if steps and not budget.take(Kind.GRAD, g_names, steps):
            rep.notes.append(f"gates: {layer!r} gradient share not measured: {_OVER_BUDGET}")
        elif steps:
            shares = []
            for step in steps:
                e = np.zeros(len(gates))
                for n in g_names:
                    x = np.asarray(run.snapshot(n, Kind.GRAD, step), dtype=np.float64)
                    x = x.reshape(-1, len(gates), hid)
                    e += np.sum(x * x, axis=(0, 2))
                shares.append(e / e.sum() if e.sum() > 0 else np.full(len(gates), np.nan))
            med = column_median(np.asarray(shares))
            if np.isfinite(med).all():
                gs.grad_steps, gs.grad_share = steps, [float(v) for v in med]
        else:
            rep.notes.append(f"gates: no grad snapshots of {layer!r}: no per-gate gradient share")
        # biases from the last param snapshot
        b_names = [roles[r] for r in (BIAS_IH, BIAS_HH) if r in roles and roles[r] in p_names]
        bsteps = _last_steps(run, b_names, Kind.PARAM, 1) if b_names else []
        if bsteps and not budget.take(Kind.PARAM, b_names, bsteps):
            rep.notes.append(f"gates: {layer!r} biases not read: {_OVER_BUDGET}")
        elif bsteps:
            b = sum(np.asarray(run.snapshot(n, Kind.PARAM, bsteps[0]), np.float64) for n in b_names)
            gs.bias_step = bsteps[0]
            gs.bias_median = [float(v) for v in np.median(np.reshape(b, (len(gates), hid)), axis=1)]
        rep.gates.append(gs)
        closed = False
        if kind_name == LSTM and gs.bias_median is not None:
            bf = gs.bias_median[1]
            if bf <= th.forget_bias_closed:
                closed = True
                sev = "critical" if bf <= th.forget_bias_closed_critical else "warning"
                sig = 1 / (1 + math.exp(-bf))
                rep.issues.append(_issue(
                    "FORGET_GATE_CLOSED", sev, layer,
                    f"forget-gate bias {bf:.3g} (median over units): σ ≈ {sig:.2g}, the cell "
                    "state is forgotten every step",
                    forget_bias_median=bf, forget_gate=sig, bias_step=gs.bias_step,
                    forget_grad_share=None if gs.grad_share is None else gs.grad_share[1],
                ))  # fmt: skip
        if gs.grad_share is None or gs.bias_median is None:
            if gs.bias_median is None:
                rep.notes.append(f"gates: no bias snapshots of {layer!r}: GATE_SATURATION "
                                 "not judged")  # fmt: skip
            continue
        share = np.asarray(gs.grad_share)
        for j, gate in enumerate(gates):
            if (closed and gate == "f") or abs(gs.bias_median[j]) < th.gate_bias_saturated:
                continue
            others = float(np.median(np.delete(share, j)))
            if others > 0 and share[j] <= th.gate_share_ratio * others:
                rep.issues.append(_issue(
                    "GATE_SATURATION", "warning", layer,
                    f"gate {gate!r} gets {share[j]:.2g} of the layer's gradient energy, "
                    f"{share[j] / others:.2g}x the other gates' median, with bias "
                    f"{gs.bias_median[j]:.3g}: it is saturated",
                    gate=gate, grad_share=float(share[j]), others_median=others,
                    shares=dict(zip(gates, gs.grad_share, strict=True)),
                    bias_median=gs.bias_median[j],
                ))  # fmt: skip


def architecture(
    run: Run,
    thresholds: ArchitectureThresholds | None = None,
    *,
    heads: HeadsSpec | None = None,
    cache: StatsCache | None = None,
) -> ArchitectureReport:
    """Architecture-aware checks of ``run`` (see the module docstring).

    Args:
        run: an open run (:func:`traintape.open_run`).
        thresholds: override the defaults of :class:`ArchitectureThresholds` (a
            :class:`~traintape.analysis.HealthThresholds`, which has these fields, too).
        heads: number of attention heads (an int, or ``{attention path or pattern: int}``)
            where the store does not say (module docstring).
        cache: a shared stats cache (health passes its own: nothing is read twice).

    Raises:
        ValueError: a number of heads (argument or ``user["attention_heads"]``) that is
            not a positive integer dividing the q kernel's width.
    """
    th = ArchitectureThresholds()
    if thresholds is not None:  # HealthThresholds too: take the fields of this module
        th = ArchitectureThresholds.model_validate(
            {k: getattr(thresholds, k) for k in ArchitectureThresholds.model_fields}
        )
    if cache is None:
        cache = StatsCache(run, Tracker())
    want_architecture(run, cache)
    cache.load()
    rep = ArchitectureReport(url=run.url, thresholds=th)
    _bottlenecks(run, cache, th, rep)
    _residual(run, cache, th, rep)
    _blocks(run, cache, th, rep)
    budget = _Budget(run, th.max_snapshot_bytes)
    _head_balance(run, th, rep, heads, budget)
    _gates(run, th, rep, budget)
    return rep
