"""Parameter change between steps: how much, where, and how sparse.

From **snapshots**: for every pair of consecutive param snapshots ``(s0, s1)``,
``Δ = θ_{s1} − θ_{s0}`` per tensor, aggregated per layer, per component and globally:
``l1 = Σ|Δ|``, ``l2 = ‖Δ‖₂``, ``max = max|Δ|``, ``sparsity[thr]`` = fraction of entries with
``|Δ| <= thr`` for each threshold (default 1e-8, 1e-6, 1e-4), and ``relative = ‖Δ‖₂ / ‖θ_{s0}‖₂``.
Snapshots are read one tensor at a time.

From **stats** (always available): per step ``t`` and layer, ``‖update_t‖₂ / ‖θ_t‖₂`` —
the single-step relative change — in :func:`change_from_stats`.

Components (:func:`component`, the rule every analysis shares), first match wins:

- ``attention/q|k|v|o`` — a tensor of an attention projection layer, named by the last
  segment of its layer path (:func:`attention_projection`): the canonical sub-layers
  ``q``/``k``/``v``/``o`` (torch ``MultiheadAttention``, Flax, Keras) and the Hugging Face
  names ``q_proj``/``k_proj``/``v_proj``/``o_proj``/``out_proj`` (Llama, Mistral, OPT,
  BART, ...) and DistilBERT's ``q_lin``/``k_lin``/``v_lin``/``out_lin``, wherever they
  are; BERT's ``query``/``key``/``value`` (``attention/self/query``), ``c_proj`` (GPT-2)
  and ``dense`` (Falcon, Bloom) only in context: under a layer (``query``/``key``/
  ``value``: one of the two above) whose name contains ``attn`` or ``attention``, so
  an RL ``value`` head or GPT-2's ``mlp/c_proj`` stays ``mlp``; BERT's
  ``attention/output/dense`` is ``o`` too;
- ``attention/qkv`` — a fused q/k/v projection: GPT-2's ``c_attn``, ``qkv``,
  ``qkv_proj`` (Phi-3), ``query_key_value`` (GPT-NeoX, Falcon), ``Wqkv`` (MPT);
- ``embedding`` (role embedding), ``norm`` (layer kinds *norm*, roles scale/running_*,
  or a layer path segment containing "norm" or named ln/ln1/ln2/ln_1/ln_2/ln_f);
- ``mlp`` — everything else (dense, conv, recurrent): ``gate_proj``/``up_proj``/
  ``down_proj``, GPT-2's ``c_fc`` and ``mlp/c_proj``, BERT's ``intermediate``/``output``
  ``dense``.

LoRA (PEFT, layer kind ``lora``): a tensor under ``<layer>/lora_A``, ``lora_B`` or
``lora_magnitude`` is ``lora/<component of <layer>>`` (``lora/attention/q``); the
frozen ``<layer>/base_layer`` tensors count as ``<layer>``'s component
(``attention/q``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
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
from traintape.schema import Kind, split_name
from traintape.schema.roles import LORA, LORA_PARTS

if TYPE_CHECKING:
    from traintape.core.reader import Run
    from traintape.schema import TensorSpec

DEFAULT_THRESHOLDS: tuple[float, ...] = (1e-8, 1e-6, 1e-4)


PROJECTION_NAMES: dict[str, str] = {
    **{p: p for p in ("q", "k", "v", "o")},
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "out_proj": "o",
    "q_lin": "q", "k_lin": "k", "v_lin": "v", "out_lin": "o",
    "c_attn": "qkv", "qkv": "qkv", "qkv_proj": "qkv", "query_key_value": "qkv", "Wqkv": "qkv",
}  # fmt: skip
"""Last layer segment → attention projection (``q``, ``k``, ``v``, ``o``; ``qkv`` fused),
wherever the segment occurs; see :func:`attention_projection` for the contextual ones."""

_QKV_WORDS = {"query": "q", "key": "k", "value": "v"}
_PEFT_PARTS = frozenset((*LORA_PARTS, "base_layer"))
_NORM_SEGMENTS = frozenset(("ln", "ln1", "ln2", "ln_1", "ln_2", "ln_f"))


def _attention_like(segment: str) -> bool:
    s = segment.lower()
    return "attn" in s or "attention" in s


def attention_projection(layer: str) -> str | None:
    """The attention projection canonical layer path ``layer`` is: ``q``, ``k``, ``v``,
    ``o``, ``qkv`` (a fused q/k/v projection), or None (see the module docstring).

    ``blocks/0/attn/q`` → ``q``; ``model/layers/0/self_attn/k_proj`` → ``k``;
    ``transformer/h/0/attn/c_attn`` → ``qkv``; ``transformer/h/0/attn/c_proj`` → ``o``
    but ``transformer/h/0/mlp/c_proj`` → None; ``.../attention/output/dense`` → ``o``.
    A LoRA sub-layer (``.../q_proj/lora_A``) is not a projection itself.
    """
    segs = layer.split("/") if layer else []
    if not segs:
        return None
    leaf = segs[-1]
    if leaf in PROJECTION_NAMES:
        return PROJECTION_NAMES[leaf]
    parent = segs[-2] if len(segs) >= 2 else ""
    if leaf in _QKV_WORDS and any(_attention_like(s) for s in segs[-3:-1]):
        return _QKV_WORDS[leaf]
    if leaf in ("c_proj", "dense") and _attention_like(parent):
        return "o"
    if leaf == "dense" and parent == "output" and len(segs) >= 3 and _attention_like(segs[-3]):
        return "o"
    return None


def qkv_groups(layers: Iterable[str]) -> dict[str, dict[str, str]]:
    """Separate q/k/v projection layers grouped by the layer they sit in:
    ``{parent layer: {"q": layer, "k": layer, "v": layer}}`` (those present).

    The attention-imbalance check compares the grad norms of one group. Fused
    projections (``attention/qkv``: GPT-2's ``c_attn``) form no group: their q, k and v
    share one tensor, whose stats do not tell them apart.
    """
    out: dict[str, dict[str, str]] = {}
    for layer in layers:
        p = attention_projection(layer)
        if p in ("q", "k", "v"):
            out.setdefault(split_name(layer)[0], {})[p] = layer
    return {k: {p: v[p] for p in "qkv" if p in v} for k, v in sorted(out.items())}


def _is_norm(segs: list[str], role: str, layer_kind: str | None) -> bool:
    if "norm" in (layer_kind or "") or role in ("scale", "running_mean", "running_var"):
        return True
    return any("norm" in s.lower() or s.lower() in _NORM_SEGMENTS for s in segs)


def component(name: str, role: str | None = None, layer_kind: str | None = None) -> str:
    """Component class of the parameter with canonical ``name`` (see the module
    docstring); ``role`` defaults to the name's leaf."""
    layer, leaf = split_name(name)
    role = role or leaf
    segs = layer.split("/") if layer else []
    lora = layer_kind == LORA or any(s in LORA_PARTS for s in segs)
    for i in range(len(segs) - 1, -1, -1):
        if segs[i] in _PEFT_PARTS:  # the component of the layer PEFT wraps
            layer_kind = None if segs[i] in LORA_PARTS else layer_kind
            segs = segs[:i]
            break
    p = attention_projection("/".join(segs))
    if p is not None:
        base = f"attention/{p}"
    elif role == "embedding" or layer_kind == "embedding":
        base = "embedding"
    elif _is_norm(segs, role, layer_kind):
        base = "norm"
    else:
        base = "mlp"
    return f"lora/{base}" if lora else base


def component_of(spec: TensorSpec) -> str:
    """Component class of a parameter (:func:`component` of its name, role and kind)."""
    return component(spec.name, spec.role, spec.layer_kind)


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
