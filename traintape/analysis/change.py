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

**LoRA's effective update** ΔW (:func:`lora_delta`, and the ``lora`` fields of
:func:`parameter_change`): an adapted layer's weight is ``W_base + ΔW`` with
``ΔW = s · A · B`` in canonical layout — ``A = <layer>/lora_A/kernel`` (in, r) (an
embedding's ``lora_A/embedding`` (vocab, r); a conv's ``(*K, in, r)`` is flattened to
``(K·in, r)``), ``B = <layer>/lora_B/kernel`` (r, out) and ``s`` PEFT's ``scaling``
(``lora_alpha / r``, ``lora_alpha / √r`` with rsLoRA). The store does not hold ``s``
(see :func:`lora_scale` for where it is taken from; unknown, ``s = 1`` and every ΔW value
is reported *up to the scale*, ``scale_source`` None). From **snapshots** (full-capture
steps): ``‖ΔW‖_F``, the singular values of ``s·A·B`` — from the r×r problem (QR of ``A``
and of ``Bᵀ``, SVD of ``R_A R_Bᵀ``; the in×out matrix is never formed) —, their energy
(cumulative ``σ²`` fraction), the effective rank ``exp(−Σ p_k ln p_k)``, ``p_k = σ_k / Σσ``
(Roy & Vetterli; 1 for a rank-one ΔW, r for a flat spectrum), ``‖ΔW‖_F / ‖W_base‖_F``, and
between two snapshots ``‖ΔW_new − ΔW_old‖_F`` (the rank-2r product
``s·[A_new, A_old]·[B_new; −B_old]``, the same way). From **stats** alone (every recorded
step): ``s·‖A‖_F·‖B‖_F ≥ ‖ΔW‖_F`` (Frobenius norms are submultiplicative), an upper bound
(:func:`lora_norm_bounds`). DoRA's magnitude vector is not part of ΔW.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import (
    LayerGroups,
    ProgressCallback,
    StatsCache,
    TensorSeries,
    Tracker,
    finite_float,
    layer_norms,
    layer_of,
    stat_index,
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


# ------------------------------------------------------------------ LoRA adapters
ScaleSpec = float | Mapping[str, float]
"""A LoRA scale: one number for every adapter, or ``{key: number}`` where a key is an
adapter's :attr:`LoraPair.key`, its adapted layer path, or an ``fnmatch`` pattern of
either (``"*q_proj"``)."""


@dataclass(frozen=True)
class LoraPair:
    """One LoRA adapter (a ``lora_A``/``lora_B`` pair) of one layer, as the store names it."""

    key: str
    """The adapted layer path; ``<layer>:<adapter>`` for an adapter other than PEFT's
    ``default`` (``:`` is not in the canonical name grammar, so keys never clash)."""
    layer: str
    """The adapted (PEFT-wrapped) layer."""
    adapter: str
    """PEFT's adapter name (``default`` unless the store names one)."""
    a: str
    """The ``lora_A`` param tensor (``kernel`` (in, r) or ``embedding`` (vocab, r))."""
    b: str
    """The ``lora_B`` param tensor (``kernel`` (r, out))."""
    base: str | None
    """The base weight ΔW adds to (``<layer>/base_layer/kernel``), when recorded."""
    rank: int
    shape: tuple[int, int]
    """ΔW as a matrix: (rows of A flattened, out)."""
    component: str
    """The adapter's component (``lora/attention/q``)."""

    @property
    def a_layer(self) -> str:
        return layer_of(self.a)

    @property
    def b_layer(self) -> str:
        return layer_of(self.b)

    @property
    def base_layer(self) -> str | None:
        return None if self.base is None else layer_of(self.base)


def lora_pairs(run: Run) -> list[LoraPair]:
    """Every LoRA adapter with both factors recorded as ``param``: a tensor
    ``<layer>/lora_A[/<adapter>]/kernel|embedding`` whose ``lora_B`` partner
    (``<layer>/lora_B[/<adapter>]/kernel``) has shape ``(…1, r, out)``, in store order.
    A conv's 1×1 ``lora_B`` is taken as (r, out); anything else is left out."""
    specs = {s.name: s for s in run.manifest.specs(Kind.PARAM)}
    out: list[LoraPair] = []
    for name, spec in specs.items():
        layer, role = split_name(name)
        segs = layer.split("/") if layer else []
        if "lora_A" not in segs or role not in ("kernel", "embedding"):
            continue
        i = len(segs) - 1 - segs[::-1].index("lora_A")
        b_name = "/".join([*segs[:i], "lora_B", *segs[i + 1 :], "kernel"])
        bspec = specs.get(b_name)
        if bspec is None or None in spec.shape or None in bspec.shape:
            continue
        ash = [int(d or 0) for d in spec.shape]
        bsh = [int(d or 0) for d in bspec.shape]
        if len(ash) < 2 or len(bsh) < 2 or bsh[-2] != ash[-1] or any(d != 1 for d in bsh[:-2]):
            continue
        adapted, adapter = "/".join(segs[:i]), "/".join(segs[i + 1 :]) or "default"
        pre = f"{adapted}/" if adapted else ""
        base = next((c for c in (f"{pre}base_layer/{role}", f"{pre}{role}") if c in specs), None)
        out.append(LoraPair(
            key=adapted if adapter == "default" else f"{adapted}:{adapter}", layer=adapted,
            adapter=adapter, a=name, b=b_name, base=base, rank=int(ash[-1]),
            shape=(math.prod(ash[:-1]), bsh[-1]),
            component=component_of(spec),
        ))  # fmt: skip
    return out


def _scale_entry(spec: Any, pair: LoraPair) -> float | None:
    """``spec`` (a number, or a mapping as in :data:`ScaleSpec`) for ``pair``."""
    if isinstance(spec, bool):
        return None
    if isinstance(spec, int | float):
        return float(spec)
    if isinstance(spec, Mapping):
        for k in (pair.key, pair.layer):
            if k in spec and isinstance(spec[k], int | float) and not isinstance(spec[k], bool):
                return float(spec[k])
        for pat, v in spec.items():
            if (
                isinstance(v, int | float) and not isinstance(v, bool)
                and (fnmatch.fnmatchcase(pair.key, str(pat))
                     or fnmatch.fnmatchcase(pair.layer, str(pat)))
            ):  # fmt: skip
                return float(v)
    return None


def lora_scale(
    run: Run, pair: LoraPair, scale: ScaleSpec | None = None
) -> tuple[float, str | None]:
    """PEFT's scaling ``s`` of one adapter (ΔW = s·A·B) and where it came from.

    The store does not record ``s``; the first of these that gives one wins:

    1. ``scale`` (:data:`ScaleSpec`) → source ``"argument"``;
    2. the manifest's ``user["lora_scaling"]`` (same forms: PEFT's ``module.scaling``
       values, e.g. ``Recorder(..., user={"lora_scaling": 2.0})``) → ``"user.lora_scaling"``;
    3. ``user["lora_alpha"]`` (a number or mapping likewise; PEFT's ``lora_alpha``) →
       ``alpha / r``, or ``alpha / √r`` when ``user["use_rslora"]`` is true, with ``r`` the
       adapter's rank from the store → ``"user.lora_alpha"``.

    Otherwise ``(1.0, None)``: ΔW is reported up to the scale.
    """
    v = _scale_entry(scale, pair) if scale is not None else None
    if v is not None:
        return v, "argument"
    user = run.manifest.user or {}
    v = _scale_entry(user.get("lora_scaling"), pair)
    if v is not None:
        return v, "user.lora_scaling"
    alpha = _scale_entry(user.get("lora_alpha"), pair)
    if alpha is not None and pair.rank > 0:
        r = math.sqrt(pair.rank) if user.get("use_rslora") is True else pair.rank
        return alpha / r, "user.lora_alpha"
    return 1.0, None


def lowrank_singular_values(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Singular values (descending, ``min(m, n, k)`` of them) of ``x @ y`` for ``x`` (m, k)
    and ``y`` (k, n), without forming the m×n product: with ``x = Q_x R_x`` and
    ``yᵀ = Q_y R_y`` (reduced QR), ``x @ y = Q_x (R_x R_yᵀ) Q_yᵀ`` has the singular values of
    the small ``R_x R_yᵀ``. float64."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.size == 0 or y.size == 0:
        return np.zeros(0)
    rx = np.asarray(np.linalg.qr(x, mode="r"))
    ry = np.asarray(np.linalg.qr(y.T, mode="r"))
    return np.asarray(np.linalg.svd(rx @ ry.T, compute_uv=False), dtype=np.float64)


def effective_rank(sv: np.ndarray) -> float | None:
    """``exp(−Σ p_k ln p_k)`` with ``p_k = σ_k / Σσ`` (Roy & Vetterli's effective rank):
    1 for one non-zero singular value, k for k equal ones; None when all are 0."""
    sv = np.asarray(sv, dtype=np.float64)
    total = float(sv.sum())
    if not total > 0 or not np.isfinite(total):
        return None
    p = sv[sv > 0] / total
    return float(np.exp(-(p * np.log(p)).sum()))


def _factors(pair: LoraPair, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A and B snapshots as the matrices (K·in, r) and (r, out) of ΔW = s·A·B."""
    return (np.asarray(a, dtype=np.float64).reshape(pair.shape[0], pair.rank),
            np.asarray(b, dtype=np.float64).reshape(pair.rank, pair.shape[1]))  # fmt: skip


class LoraLayerDelta(BaseModel):
    """The effective update ``ΔW = s·A·B`` of one adapter at one step."""

    layer: str = Field(description="the adapted layer")
    adapter: str
    component: str
    a: str = Field(description="lora_A tensor")
    b: str = Field(description="lora_B tensor")
    rank: int
    shape: list[int] = Field(description="ΔW as a matrix: (rows of A, columns of B)")
    scale: float = Field(description="s (1.0 when unknown)")
    scale_source: str | None = Field(
        description="where s came from (see lora_scale); None: unknown, ΔW up to the scale"
    )
    norm: float | None = Field(None, description="‖ΔW‖_F from snapshots")
    relative: float | None = Field(None, description="‖ΔW‖_F / ‖W_base‖_F")
    singular_values: list[float] = Field(default_factory=list, description="of ΔW, descending")
    energy: list[float] = Field(
        default_factory=list, description="cumulative σ² fraction of the first k singular values"
    )
    effective_rank: float | None = Field(None, description="exp(entropy of σ/Σσ)")
    norm_bound: float | None = Field(
        None, description="s·‖A‖_F·‖B‖_F from stats at the step (an upper bound of ‖ΔW‖_F)"
    )


class LoraComponentDelta(BaseModel):
    """ΔW of the adapters of one component (root-sum-square over adapters)."""

    adapters: int
    norm: float | None = Field(None, description="sqrt(Σ ‖ΔW‖_F²), from snapshots")
    relative: float | None = Field(None, description="sqrt(Σ ‖ΔW‖_F²) / sqrt(Σ ‖W_base‖_F²)")
    norm_bound: float | None = Field(None, description="sqrt(Σ bound²), from stats")


class LoraDelta(BaseModel):
    """LoRA's effective update per adapted layer at one step (see the module docstring)."""

    url: str
    step: int | None = Field(description="the step (θ at its start, as snapshots hold it)")
    from_snapshots: bool = Field(description="norms and spectra from snapshots at ``step``")
    scale_known: bool = Field(description="every adapter's s was found (see lora_scale)")
    per_layer: dict[str, LoraLayerDelta] = Field(description="by LoraPair.key")
    per_component: dict[str, LoraComponentDelta]


class LoraChange(BaseModel):
    """An adapter's ΔW between two snapshots (a component's: root-sum-square)."""

    norm_old: float = Field(description="‖ΔW_old‖_F")
    norm: float = Field(description="‖ΔW_new‖_F")
    change: float = Field(description="‖ΔW_new − ΔW_old‖_F: how far the effective weight moved")
    relative: float | None = Field(None, description="change / ‖W_base‖_F")
    effective_rank: float | None = Field(None, description="of ΔW_new (adapters only)")


class ChangeStats(BaseModel):
    """Change of a group of tensors between two steps."""

    numel: int
    l1: float
    l2: float
    max: float
    relative: float | None = Field(None, description="‖Δ‖₂ / ‖θ_old‖₂")
    mean: float | None = Field(None, description="mean of Δ (the drift)")
    std: float | None = Field(None, description="standard deviation of Δ's entries")
    mean_shift: float | None = Field(None, description="mean(θ_new) − mean(θ_old)")
    std_shift: float | None = Field(None, description="std(θ_new) − std(θ_old)")
    sparsity: dict[str, float] = Field(description="threshold → fraction with |Δ| <= threshold")


class StepPairChange(BaseModel):
    step_old: int
    step_new: int
    total: ChangeStats
    per_layer: dict[str, ChangeStats]
    per_component: dict[str, ChangeStats]
    per_tensor: dict[str, ChangeStats]
    lora: dict[str, LoraChange] = Field(
        default_factory=dict, description="ΔW = s·A·B of each LoRA adapter, by LoraPair.key"
    )
    lora_per_component: dict[str, LoraChange] = Field(default_factory=dict)


class ParameterChange(BaseModel):
    url: str
    thresholds: list[float]
    pairs: list[StepPairChange]
    lora: LoraDelta | None = Field(
        None, description="LoRA runs: lora_delta at the newest snapshot step (spectra, bounds)"
    )


class _Moments:
    """Count, mean and sum of squared deviations, merged exactly over parts (Chan et al.)."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: np.ndarray) -> None:
        if not x.size:
            return
        n, mean = x.size, float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        tot = self.n + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.n * n / tot
        self.mean += delta * n / tot
        self.n = tot

    @property
    def std(self) -> float | None:
        return float(np.sqrt(max(self.m2, 0.0) / self.n)) if self.n else None


class _Agg:
    def __init__(self, thresholds: tuple[float, ...]) -> None:
        self.n = 0
        self.l1 = 0.0
        self.sq = 0.0
        self.mx = 0.0
        self.old_sq = 0.0
        self.below = np.zeros(len(thresholds))
        self.thr = thresholds
        self.d, self.old, self.new = _Moments(), _Moments(), _Moments()

    def add(self, d: np.ndarray, old: np.ndarray, new: np.ndarray | None = None) -> None:
        a = np.abs(d)
        self.n += a.size
        self.l1 += float(a.sum())
        self.sq += float((a * a).sum())
        self.mx = max(self.mx, float(a.max()) if a.size else 0.0)
        self.old_sq += float((old * old).sum())
        for i, t in enumerate(self.thr):
            self.below[i] += float((a <= t).sum())
        self.d.add(d)
        self.old.add(old)
        self.new.add(old + d if new is None else new)

    def result(self) -> ChangeStats:
        o, w = self.old, self.new
        std_shift = None
        if w.std is not None and o.std is not None:
            std_shift = finite_float(w.std - o.std)
        return ChangeStats(
            numel=self.n,
            l1=self.l1,
            l2=float(np.sqrt(self.sq)),
            max=self.mx,
            relative=float(np.sqrt(self.sq / self.old_sq)) if self.old_sq > 0 else None,
            mean=finite_float(self.d.mean) if self.n else None,
            std=finite_float(self.d.std) if self.d.std is not None else None,
            mean_shift=finite_float(w.mean - o.mean) if self.n else None,
            std_shift=std_shift,
            sparsity={
                f"{t:g}": float(b / max(self.n, 1))
                for t, b in zip(self.thr, self.below, strict=True)
            },
        )


def param_snapshot_steps(run: Run) -> list[int]:
    """The steps at which any param tensor has a full snapshot (ascending)."""
    if not run.manifest.commit.snapshots.get(Kind.PARAM):
        return []
    return sorted(
        {int(x) for n in run.tensor_names(Kind.PARAM) for x in run.snapshot_steps(n, Kind.PARAM)}
    )


def parameter_change(
    run: Run,
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS,
    *,
    max_pairs: int | None = None,
    progress: ProgressCallback | None = None,
    scale: ScaleSpec | None = None,
    cache: StatsCache | None = None,
    steps: tuple[int, int] | None = None,
) -> ParameterChange:
    """Change between consecutive param snapshots (all tensors with snapshots), or
    between the two snapshot steps ``steps``.

    In a LoRA run each pair also gets ``lora`` / ``lora_per_component``: the adapters'
    effective update ΔW = s·A·B at both steps and how far it moved (:class:`LoraChange`),
    and :attr:`ParameterChange.lora` is :func:`lora_delta` at the newest snapshot step.

    Args:
        run: an open run (:func:`traintape.open_run`).
        thresholds: ``|Δ|`` thresholds of the sparsity fractions.
        max_pairs: only the last ``max_pairs`` snapshot pairs.
        progress: ``callback(stage, done, total)``; a unit is one tensor of one step pair
            (and one LoRA adapter).
        scale: LoRA scale ``s`` (see :func:`lora_scale`; default: from the manifest).
        cache: a shared stats cache (LoRA runs read the factors' param norms from it).
        steps: ``(old, new)``: only the change from snapshot step ``old`` to ``new``
            (any two snapshot steps, ``max_pairs`` then ignored); the tensors with
            snapshots at both are compared.

    Raises:
        KeyError: a step of ``steps`` has no param snapshot (the message lists them).
    """
    specs = run.manifest.specs(Kind.PARAM)
    steps_by: dict[str, np.ndarray] = {}
    if Kind.PARAM in run.manifest.commit.snapshots:
        steps_by = {s.name: run.snapshot_steps(s.name, Kind.PARAM) for s in specs}
    all_steps = sorted({int(x) for v in steps_by.values() for x in v})
    pairs = list(itertools.pairwise(all_steps))
    if steps is not None:
        missing = [s for s in steps if s not in all_steps]
        if missing:
            shown = ", ".join(map(str, all_steps[:20])) + (" ..." if len(all_steps) > 20 else "")
            raise KeyError(
                f"{run.url}: no param snapshot at step {missing[0]} "
                f"(snapshot steps: {shown or 'none'})"
            )
        pairs = [(int(steps[0]), int(steps[1]))]
    elif max_pairs is not None:
        pairs = pairs[-max_pairs:]
    adapters = lora_pairs(run)
    keep = {n for p in adapters for n in (p.a, p.b, p.base) if n is not None}
    scales = {p.key: lora_scale(run, p, scale)[0] for p in adapters}
    tracker = Tracker(progress)
    tracker.add(len(pairs) * len(steps_by))
    out = []
    for s0, s1 in pairs:
        tracker.stage(f"parameter change {s0}→{s1}")
        total = _Agg(thresholds)
        layers: dict[str, _Agg] = {}
        comps: dict[str, _Agg] = {}
        tens: dict[str, ChangeStats] = {}
        kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for spec in specs:
            st = steps_by.get(spec.name)
            if st is None:
                continue
            tracker.advance()
            if s0 not in st or s1 not in st:
                continue
            old = run.snapshot(spec.name, Kind.PARAM, s0).astype(np.float64)
            new = run.snapshot(spec.name, Kind.PARAM, s1).astype(np.float64)
            if spec.name in keep:
                kept[spec.name] = (old, new)
            d = new - old
            t = _Agg(thresholds)
            t.add(d, old, new)
            tens[spec.name] = t.result()
            for agg in (
                total,
                layers.setdefault(layer_of(spec.name), _Agg(thresholds)),
                comps.setdefault(component_of(spec), _Agg(thresholds)),
            ):
                agg.add(d, old, new)
        lora, lora_comps = _lora_pair_change(adapters, scales, kept)
        out.append(
            StepPairChange(
                step_old=s0,
                step_new=s1,
                total=total.result(),
                per_layer={k: v.result() for k, v in layers.items()},
                per_component={k: v.result() for k, v in sorted(comps.items())},
                per_tensor=tens,
                lora=lora,
                lora_per_component=lora_comps,
            )
        )
    delta = None
    if adapters:
        at = None if steps is None else int(steps[1])
        delta = lora_delta(run, at, scale=scale, cache=cache, progress=tracker.child())
    tracker.finish()
    return ParameterChange(url=run.url, thresholds=list(thresholds), pairs=out, lora=delta)


def _lora_pair_change(
    adapters: list[LoraPair],
    scales: dict[str, float],
    kept: dict[str, tuple[np.ndarray, np.ndarray]],
) -> tuple[dict[str, LoraChange], dict[str, LoraChange]]:
    """Per adapter with both factors in ``kept`` (``{name: (old, new)}`` snapshots), and
    per component (root-sum-square), ΔW at both steps and its change."""
    per: dict[str, LoraChange] = {}
    sq: dict[str, np.ndarray] = {}  # component → Σ [norm_old², norm², change², base²]
    for p in adapters:
        if p.a not in kept or p.b not in kept:
            continue
        s = abs(scales[p.key])
        (a0, a1), (b0, b1) = kept[p.a], kept[p.b]
        x0, y0 = _factors(p, a0, b0)
        x1, y1 = _factors(p, a1, b1)
        sv1 = s * lowrank_singular_values(x1, y1)
        n0 = s * float(np.sqrt((lowrank_singular_values(x0, y0) ** 2).sum()))
        n1 = float(np.sqrt((sv1**2).sum()))
        # ΔW_new − ΔW_old = s·[A_new, A_old]·[B_new; −B_old] (rank ≤ 2r)
        dsv = lowrank_singular_values(np.hstack([x1, x0]), np.vstack([y1, -y0]))
        ch = s * float(np.sqrt((dsv**2).sum()))
        base = float(np.sqrt((kept[p.base][0] ** 2).sum())) if p.base in kept else None
        per[p.key] = LoraChange(norm_old=n0, norm=n1, change=ch,
                                relative=ch / base if base else None,
                                effective_rank=effective_rank(sv1))  # fmt: skip
        acc = sq.setdefault(p.component, np.zeros(4))
        acc += (n0 * n0, n1 * n1, ch * ch, np.nan if base is None else base * base)
    comps = {
        c: LoraChange(norm_old=float(np.sqrt(v[0])), norm=float(np.sqrt(v[1])),
                      change=float(np.sqrt(v[2])),
                      relative=float(np.sqrt(v[2] / v[3])) if v[3] > 0 else None)
        for c, v in sorted(sq.items())
    }  # fmt: skip
    return per, comps


def _lora_l2(run: Run, names: list[str], cache: StatsCache | None) -> dict[str, np.ndarray]:
    """The param ``l2`` of each of ``names`` over all rows (NaN: not recorded)."""
    if not names or run.rows == 0 or Kind.PARAM not in run.kinds():
        return {n: np.full(run.rows, np.nan) for n in names}
    cache = cache or StatsCache(run)
    v = cache.result(("lora_l2", tuple(names)), TensorSeries(Kind.PARAM, names, ["l2"]))
    return {n: v[:, i, 0] for i, n in enumerate(names)}


def _at_or_median(x: np.ndarray, row: int | None) -> float | None:
    """``x[row]`` if finite, else the median of ``x``'s finite values (a frozen base
    weight is read only at some rows and does not change), else None."""
    if row is not None and np.isfinite(x[row]):
        return float(x[row])
    f = x[np.isfinite(x)]
    return float(np.median(f)) if len(f) else None


def _rss(x: list[float]) -> float | None:
    """Root-sum-square of ``x`` (None when empty)."""
    return float(np.sqrt(np.sum(np.square(x)))) if x else None


def lora_norm_bounds(
    run: Run, scale: ScaleSpec | None = None, cache: StatsCache | None = None
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """From stats alone, every recorded step: ``s·‖A_t‖_F·‖B_t‖_F`` per adapter, an upper
    bound of ``‖ΔW_t‖_F`` (Frobenius norms are submultiplicative): ``(steps, adapter keys,
    bounds [rows, adapter])``, NaN where a factor was not recorded."""
    adapters = lora_pairs(run)
    l2 = _lora_l2(run, sorted({n for p in adapters for n in (p.a, p.b)}), cache)
    out = np.full((run.rows, len(adapters)), np.nan)
    for c, p in enumerate(adapters):
        out[:, c] = abs(lora_scale(run, p, scale)[0]) * l2[p.a] * l2[p.b]
    return run.steps, [p.key for p in adapters], out


def lora_delta(
    run: Run,
    step: int | None = None,
    *,
    scale: ScaleSpec | None = None,
    cache: StatsCache | None = None,
    progress: ProgressCallback | None = None,
) -> LoraDelta:
    """LoRA's effective update ``ΔW = s·A·B`` of every adapter at ``step`` (see the
    module docstring): from snapshots ``‖ΔW‖_F``, its singular values, energy and effective
    rank, ``‖ΔW‖_F / ‖W_base‖_F``; from stats the bound ``s·‖A‖_F·‖B‖_F``.

    Args:
        run: an open run (:func:`traintape.open_run`).
        step: the step (θ at its start); default the newest step with snapshots of both
            factors of an adapter, else the last recorded step (stats only: norms and
            spectra are None, the bounds remain).
        scale: LoRA scale ``s`` (see :func:`lora_scale`; default: from the manifest).
        cache: a shared stats cache.
        progress: ``callback(stage, done, total)``; a unit is one adapter.

    Raises:
        KeyError: ``step`` is neither a recorded step nor a snapshot step.
    """
    adapters = lora_pairs(run)
    snaps = Kind.PARAM in run.manifest.commit.snapshots
    both: dict[str, set[int]] = {}
    for p in adapters:
        sa = run.snapshot_steps(p.a, Kind.PARAM) if snaps else np.zeros(0, np.int64)
        sb = run.snapshot_steps(p.b, Kind.PARAM) if snaps else np.zeros(0, np.int64)
        both[p.key] = {int(x) for x in sa} & {int(x) for x in sb}
    steps = run.steps
    if step is None:
        cands = set().union(*both.values()) if both else set()
        step = max(cands) if cands else (int(steps[-1]) if len(steps) else None)
    elif step not in set(steps.tolist()) and not any(step in v for v in both.values()):
        raise KeyError(f"{run.url}: step {step} is neither recorded nor a snapshot step")
    hit = np.flatnonzero(steps == step) if step is not None else np.zeros(0, np.intp)
    row = int(hit[0]) if len(hit) else None
    names = sorted({n for p in adapters for n in (p.a, p.b, p.base) if n is not None})
    l2 = _lora_l2(run, names, cache)
    tracker = Tracker(progress)
    tracker.add(len(adapters))
    tracker.stage("LoRA ΔW")
    per: dict[str, LoraLayerDelta] = {}
    bases: dict[str, float] = {}  # ‖W_base‖ of the adapters with snapshots
    known = True
    for p in adapters:
        s, src = lora_scale(run, p, scale)
        known &= src is not None
        s = abs(s)
        bound = None
        if row is not None:
            bound = finite_float(s * l2[p.a][row] * l2[p.b][row])
        d = LoraLayerDelta(layer=p.layer, adapter=p.adapter, component=p.component, a=p.a,
                           b=p.b, rank=p.rank, shape=list(p.shape), scale=s,
                           scale_source=src, norm_bound=bound)  # fmt: skip
        if step is not None and step in both[p.key]:
            x, y = _factors(p, run.snapshot(p.a, Kind.PARAM, step),
                            run.snapshot(p.b, Kind.PARAM, step))  # fmt: skip
            sv = s * lowrank_singular_values(x, y)
            e2 = np.cumsum(sv**2)
            d.norm = float(np.sqrt(e2[-1])) if len(e2) else 0.0
            d.singular_values = sv.tolist()
            d.energy = (e2 / e2[-1]).tolist() if len(e2) and e2[-1] > 0 else []
            d.effective_rank = effective_rank(sv)
            base = _at_or_median(l2[p.base], row) if p.base is not None else None
            d.relative = d.norm / base if base else None
            if base:
                bases[p.key] = base
        per[p.key] = d
        tracker.advance()
    comps: dict[str, LoraComponentDelta] = {}
    for c in sorted({p.component for p in adapters}):
        ds = [p.key for p in adapters if p.component == c]
        norms = [n for k in ds if (n := per[k].norm) is not None]
        bounds = [b for k in ds if (b := per[k].norm_bound) is not None]
        bsq = [bases[k] for k in ds if per[k].norm is not None and k in bases]
        nn, nb = _rss(norms), _rss(bsq) if len(bsq) == len(norms) else None
        comps[c] = LoraComponentDelta(
            adapters=len(ds),
            norm=nn,
            norm_bound=_rss(bounds),
            relative=nn / nb if nn is not None and nb else None,
        )
    tracker.finish()
    return LoraDelta(url=run.url, step=step, scale_known=known, per_layer=per,
                     from_snapshots=any(d.norm is not None for d in per.values()),
                     per_component=comps)  # fmt: skip


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


def last_row_change(run: Run) -> list[tuple[str, float | None, float | None]]:
    """The last recorded row's ``(layer, grad norm, ‖update‖/‖param‖)`` per layer (grad's
    layers first, forward order; None where a kind or value is missing), the layer norms
    combined as every analysis combines them (:class:`~traintape.analysis._common.LayerGroups`).
    What ``traintape monitor`` shows while a run is written."""
    if not run.rows:
        return []
    last = slice(run.rows - 1, run.rows)
    norms: dict[Kind, dict[str, float]] = {}
    layers: dict[str, None] = {}
    for kind in (Kind.GRAD, Kind.UPDATE, Kind.PARAM):
        if kind not in run.kinds():
            continue
        groups = LayerGroups(run, kind)
        l2 = run.stats_array(kind, rows=last)[:, :, stat_index(run, "l2")]
        norms[kind] = dict(zip(groups.layers, groups.reduce(l2, "norm")[0], strict=True))
        layers.update(dict.fromkeys(groups.layers))
    out = []
    for layer in layers:
        g = norms.get(Kind.GRAD, {}).get(layer)
        u, p = norms.get(Kind.UPDATE, {}).get(layer), norms.get(Kind.PARAM, {}).get(layer)
        ratio = float(u / p) if u is not None and p is not None and p > 0 else None
        out.append((layer, finite_float(g) if g is not None else None,
                    finite_float(ratio) if ratio is not None else None))  # fmt: skip
    return out
