"""Where PyTorch names and layouts are normalised to the canonical ones.

Every recorded torch tensor is described by a :class:`ParamEntry`: its canonical name
(``/``-separated module path + role leaf), the torch tensor it comes from, an optional
row slice of that tensor (``MultiheadAttention.in_proj_weight`` holds q, k and v) and
the axis permutation to the canonical layout (``canonical = source.permute(perm)``).

Module path: ``named_modules`` paths with ``.`` → ``/``; ``ModuleList``/``Sequential``
indices are their own integer segment (``blocks.0.fc`` → ``blocks/0/fc``).

Roles are decided by module type, never by the string ``weight``:

===================================  ==============================================
torch module                         canonical tensors
===================================  ==============================================
Linear                               ``kernel`` (in, out) = weight.T; ``bias``
HF ``transformers`` Conv1D (GPT-2)   ``kernel`` (in, out) = weight (stored (in, out));
                                     ``bias``; a ``dense`` layer
Conv1d/2d/3d                         ``kernel`` (*K, in/groups, out) from (O, I/g, *K)
Embedding                            ``embedding`` (V, D)
LayerNorm, GroupNorm                 ``scale``, ``bias``
RMSNorm, a library's ``*RMSNorm``     ``scale`` (a class named ``*RMSNorm`` with one
(``LlamaRMSNorm``, ...)              1-D ``weight``; stored value, also for Gemma's
                                     ``1 + weight`` norms)
BatchNorm1d/2d/3d, SyncBatchNorm     ``scale``, ``bias``, ``running_mean``,
                                     ``running_var`` (``num_batches_tracked`` dropped)
MultiheadAttention                   ``q/kernel``, ``k/kernel``, ``v/kernel`` (in, out)
                                     = row blocks of ``in_proj_weight`` transposed (or
                                     ``{q,k,v}_proj_weight``.T), ``{q,k,v}/bias`` = blocks
                                     of ``in_proj_bias``; ``out_proj`` → ``o/kernel``,
                                     ``o/bias``; ``bias_k``/``bias_v`` kept generic.
                                     The q/k/v/o sub-layers are ``dense`` layers;
                                     ``<attn>/output`` has layer kind ``attention``
LSTM, GRU                            per layer ``kernel_ih`` (in, G*hidden) =
                                     weight_ih_l{k}.T, ``kernel_hh`` (hidden, G*hidden),
                                     ``bias_ih``, ``bias_hh`` (G*hidden,); gate order is
                                     torch's (LSTM i,f,g,o; GRU r,z,n), which *is* the
                                     canonical one. ``num_layers > 1`` adds the layer
                                     index segment (``lstm/0/kernel_ih``); the reverse
                                     direction adds ``reverse`` (``lstm/0/reverse/...``);
                                     ``proj_size`` weights are ``kernel_hr`` (H, P)
PEFT LoRA layer (``peft.tuners.lora``  ``lora_A/kernel`` (in, r), ``lora_B/kernel``
``Linear``, ``Embedding``, ``Conv*``)  (r, out) in their module's layout (conv: conv
                                     layout); embedding LoRA ``lora_A/embedding``
                                     (vocab, r) = ``lora_embedding_A``.T and
                                     ``lora_B/kernel`` (r, dim) = ``lora_embedding_B``.T;
                                     DoRA ``lora_magnitude/magnitude`` (out,); layer
                                     kind ``lora``. The wrapped ``base_layer`` keeps
                                     its own rules: ``<layer>/base_layer/kernel``
===================================  ==============================================

Any other module with parameters of its own keeps generic names (``path/<param name>``,
identity layout, ``layer_kind`` None) and triggers one warning naming its type.
Integer and bool buffers (position ids, token type ids, causal masks) and non-persistent
buffers (absent from ``state_dict``) are constants and are never recorded.

Split tensors (MultiheadAttention q/k/v) record ``source_name`` as
``attn.in_proj_weight[0:E]`` and ``source_shape`` as the shape of that row block, so
``permutation`` maps ``source_shape`` onto ``shape`` exactly as the schema requires.

Tied (shared) parameters are recorded once, under the first name ``named_modules``
reaches them by; later names become ``aliases`` in the spec.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from traintape.core.naming import NameMap, canonical_name
from traintape.schema import roles as R
from traintape.schema.names import split_name

_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_RMS_NORM = getattr(nn, "RMSNorm", None)


@dataclass
class ParamEntry:
    """One canonical tensor read from a torch parameter or buffer.

    ``tensor()`` returns the live torch tensor (parameter or buffer); ``part(t)`` the
    slice of ``t`` this entry covers (source layout); ``canonical(t)`` that slice
    permuted to the canonical layout (a view; no copy).
    """

    name: str
    role: str
    layer: str
    layer_kind: str | None
    module: nn.Module
    attr: str
    source_name: str
    source_shape: tuple[int, ...]
    permutation: tuple[int, ...] | None
    rows: tuple[int, int] | None = None
    is_buffer: bool = False
    aliases: list[str] = field(default_factory=list)

    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    @property
    def trainable(self) -> bool:
        t = self.tensor()
        return not self.is_buffer and isinstance(t, nn.Parameter) and t.requires_grad

    @property
    def shape(self) -> tuple[int, ...]:
        """Canonical shape."""
        if self.permutation is None:
            return self.source_shape
        return tuple(self.source_shape[i] for i in self.permutation)

    def part(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.rows is None else t[self.rows[0] : self.rows[1]]

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        p = self.part(t)
        return p if self.permutation is None else p.permute(self.permutation)

    def inverse(self, canon: torch.Tensor) -> torch.Tensor:
        """Canonical-layout tensor → this entry's source layout (inverse permutation)."""
        if self.permutation is None:
            return canon
        inv = [0] * len(self.permutation)
        for i, p in enumerate(self.permutation):
            inv[p] = i
        return canon.permute(inv)


@dataclass
class ActivationSite:
    """A parametrised module whose output is recorded as ``<layer>/output``."""

    name: str
    layer: str
    layer_kind: str | None
    module: nn.Module
    source_name: str


@dataclass
class ModelLayout:
    """Canonical description of a torch model: tensors and activation sites."""

    entries: list[ParamEntry]
    activations: list[ActivationSite]

    def by_name(self) -> dict[str, ParamEntry]:
        return {e.name: e for e in self.entries}


def module_segments(path: str) -> list[str]:
    """``blocks.0.fc`` → ``['blocks', '0', 'fc']`` (root module: ``[]``)."""
    return [s for s in path.split(".") if s] if path else []


def _transpose(ndim: int) -> tuple[int, ...]:
    return tuple(reversed(range(ndim)))


def _conv_perm(ndim: int) -> tuple[int, ...]:
    # (O, I/g, *K) -> (*K, I/g, O)
    return (*range(2, ndim), 1, 0)


def _is_hf_conv1d(mod: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (a dense layer, weight (in, out)), matched
    by type path so transformers is never imported here."""
    t = type(mod)
    return t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils"


def _is_hf_rms_norm(mod: nn.Module) -> bool:
    """A model library's own RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...: a class
    named ``*RMSNorm`` whose only parameter is a 1-D ``weight``), matched by name."""
    if not type(mod).__name__.endswith("RMSNorm"):
        return False
    own = dict(mod.named_parameters(recurse=False))
    return set(own) == {"weight"} and own["weight"].ndim == 1


def _is_peft_lora(mod: nn.Module) -> bool:
    """A PEFT LoRA layer (``peft.tuners.lora.layer.Linear``, ``Embedding``, ``Conv2d``,
    ...): ``lora_A``/``lora_B`` ModuleDicts keyed by adapter name. Matched by type path
    and attributes, so peft is never imported here."""
    return (
        type(mod).__module__.startswith("peft.")
        and isinstance(getattr(mod, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(mod, "lora_B", None), nn.ModuleDict)
    )


def _plain_rules(mod: nn.Module) -> tuple[str | None, dict[str, tuple[str, str]]] | None:
    """(layer_kind, {torch attr: (role, layout)}) for simple module types, else None.

    layout: 'id' (identity), 'T' (transpose a 2-D weight), 'conv'.
    """
    if isinstance(mod, nn.Linear):
        return R.DENSE, {"weight": (R.KERNEL, "T"), "bias": (R.BIAS, "id")}
    if _is_hf_conv1d(mod):  # GPT-2's Conv1D stores weight (in, out): already canonical
        return R.DENSE, {"weight": (R.KERNEL, "id"), "bias": (R.BIAS, "id")}
    if isinstance(mod, _CONVS):
        return R.CONV, {"weight": (R.KERNEL, "conv"), "bias": (R.BIAS, "id")}
    if isinstance(mod, nn.Embedding):
        return R.EMBED, {"weight": (R.EMBEDDING, "id")}
    if isinstance(mod, nn.LayerNorm):
        return R.LAYER_NORM, {"weight": (R.SCALE, "id"), "bias": (R.BIAS, "id")}
    if (_RMS_NORM is not None and isinstance(mod, _RMS_NORM)) or _is_hf_rms_norm(mod):
        return R.RMS_NORM, {"weight": (R.SCALE, "id")}
    if isinstance(mod, nn.GroupNorm):
        return R.GROUP_NORM, {"weight": (R.SCALE, "id"), "bias": (R.BIAS, "id")}
    if isinstance(mod, _BATCH_NORMS):
        return R.BATCH_NORM, {
            "weight": (R.SCALE, "id"),
            "bias": (R.BIAS, "id"),
            "running_mean": (R.RUNNING_MEAN, "id"),
            "running_var": (R.RUNNING_VAR, "id"),
        }
    return None


def _layout_perm(layout: str, ndim: int) -> tuple[int, ...] | None:
    if layout == "T" and ndim == 2:
        return (1, 0)
    if layout == "conv":
        return _conv_perm(ndim)
    return None


class _Builder:
    def __init__(self, name_map: NameMap, warn: bool) -> None:
        self.name_map = name_map
        self.warn = warn
        self.entries: list[ParamEntry] = []
        self.sites: list[ActivationSite] = []
        self.seen: dict[tuple[int, tuple[int, int] | None], ParamEntry] = {}
        self.warned: set[str] = set()

    def add(
        self,
        segs: Sequence[str | int],
        role: str,
        layer_kind: str | None,
        mod: nn.Module,
        attr: str,
        source_name: str,
        perm: tuple[int, ...] | None,
        rows: tuple[int, int] | None = None,
        is_buffer: bool = False,
    ) -> None:
        t = getattr(mod, attr, None)
        if t is None:
            return
        name = canonical_name([*segs, role], self.name_map, source_name)
        key = (id(t), rows)
        prev = self.seen.get(key)
        if prev is not None:
            if name != prev.name and name not in prev.aliases:
                prev.aliases.append(name)
            return
        shape = tuple(t.shape) if rows is None else (rows[1] - rows[0], *t.shape[1:])
        if rows is not None:
            source_name = f"{source_name}[{rows[0]}:{rows[1]}]"
        e = ParamEntry(
            name=name,
            role=role,
            layer=split_name(name)[0],
            layer_kind=layer_kind,
            module=mod,
            attr=attr,
            source_name=source_name,
            source_shape=shape,
            permutation=perm,
            rows=rows,
            is_buffer=is_buffer,
        )
        self.seen[key] = e
        self.entries.append(e)

    def site(self, segs: list[str], layer_kind: str | None, mod: nn.Module, path: str) -> None:
        if any(s.module is mod for s in self.sites):
            return
        name = canonical_name([*segs, R.OUTPUT], self.name_map, f"{path}:output")
        layer = split_name(name)[0]
        self.sites.append(ActivationSite(name, layer, layer_kind, mod, path or "<root>"))


def _own_tensors(mod: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    out: list[tuple[str, torch.Tensor, bool]]
    out = [(n, p, False) for n, p in mod.named_parameters(recurse=False)]
    # integer/bool buffers (BERT's position_ids/token_type_ids, causal masks) and
    # non-persistent buffers (not in state_dict: GPT-2's masked_bias) are constants,
    # not state: never recorded as ``param``
    skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
    out += [
        (n, b, True)
        for n, b in mod.named_buffers(recurse=False)
        if b is not None and n not in skip and (b.is_floating_point() or b.is_complex())
    ]
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """Strip ``torch.compile``, (Distributed)DataParallel and PEFT wrappers.

    PEFT: a ``peft.PeftModel`` is replaced by the model it wraps
    (``model.base_model.model``), so names drop ``base_model/model/`` (the names of the
    model PEFT wrapped). LoRA layers keep PEFT's module structure: the frozen base
    weight is ``<layer>/base_layer/kernel`` and the adapters are ``<layer>/lora_A/kernel``
    (in, r) and ``<layer>/lora_B/kernel`` (r, out), layer kind ``lora``. The adapter
    name is a segment only when it is not PEFT's ``default``
    (``<layer>/lora_A/<adapter>/kernel``), as in the keys of PEFT's saved adapter files,
    which drop it too.
    """
    while True:
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif type(model).__module__.startswith("peft.") and isinstance(
            getattr(getattr(model, "base_model", None), "model", None), nn.Module
        ):
            model = model.base_model.model  # type: ignore[union-attr,assignment]
        else:
            return model


def model_layout(model: nn.Module, name_map: NameMap = None, warn: bool = True) -> ModelLayout:
    """Canonical names, layouts and activation sites of every tensor in ``model``.

    Args:
        model: any ``nn.Module``; ``torch.compile``, ``DataParallel`` and
            ``DistributedDataParallel`` wrappers are unwrapped (no ``module/`` prefix).
        name_map: mapping or callable from default canonical name (or torch source name)
            to the wanted canonical name (:func:`traintape.core.naming.apply_name_map`).
        warn: warn once per module type that has no canonical layout.
    """
    model = unwrap(model)
    b = _Builder(name_map, warn)
    consumed: set[int] = set()  # submodules handled by their parent (MHA.out_proj)
    for path, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in consumed:
            continue
        segs = module_segments(path)
        pre = f"{path}." if path else ""
        if isinstance(mod, nn.MultiheadAttention):
            _attention(b, mod, segs, pre)
            consumed.add(id(mod.out_proj))
            b.site(segs, R.ATTENTION, mod, path)
            continue
        if _is_peft_lora(mod):
            _lora(b, mod, segs, pre, consumed)  # then its base_layer as any module
            continue
        if isinstance(mod, (nn.LSTM, nn.GRU)):
            _recurrent(b, mod, segs, pre)
            b.site(segs, R.LSTM if isinstance(mod, nn.LSTM) else R.GRU, mod, path)
            continue
        own = _own_tensors(mod)
        if not own:
            continue
        rules = _plain_rules(mod)
        if rules is None:
            tname = f"{type(mod).__module__}.{type(mod).__qualname__}"
            if warn and tname not in b.warned:
                b.warned.add(tname)
                warnings.warn(
                    f"traintape.torch: no canonical layout for module type {tname} "
                    f"(at {path or '<root>'!r}); recording its tensors "
                    f"{[n for n, _, _ in own]} under generic names in torch layout",
                    stacklevel=3,
                )
            for n, _t, is_buf in own:
                b.add(segs, n, None, mod, n, pre + n, None, is_buffer=is_buf)
            if any(not is_buf for _, _, is_buf in own):
                b.site(segs, None, mod, path)
            continue
        kind, table = rules
        for n, t, is_buf in own:
            if n not in table:
                if n != "num_batches_tracked":
                    b.add(segs, n, kind, mod, n, pre + n, None, is_buffer=is_buf)
                continue
            role, layout = table[n]
            b.add(segs, role, kind, mod, n, pre + n, _layout_perm(layout, t.ndim), None, is_buf)
        b.site(segs, kind, mod, path)
    return ModelLayout(b.entries, b.sites)


def _attention(b: _Builder, mod: nn.MultiheadAttention, segs: list[str], pre: str) -> None:
    e = mod.embed_dim
    if mod._qkv_same_embed_dim:
        for i, p in enumerate(R.ATTENTION_PROJECTIONS[:3]):
            rows = (i * e, (i + 1) * e)
            b.add([*segs, p], R.KERNEL, R.DENSE, mod, "in_proj_weight",
                  pre + "in_proj_weight", (1, 0), rows)  # fmt: skip
    else:
        for p in R.ATTENTION_PROJECTIONS[:3]:
            attr = f"{p}_proj_weight"
            b.add([*segs, p], R.KERNEL, R.DENSE, mod, attr, pre + attr, (1, 0))
    if mod.in_proj_bias is not None:
        for i, p in enumerate(R.ATTENTION_PROJECTIONS[:3]):
            rows = (i * e, (i + 1) * e)
            b.add([*segs, p], R.BIAS, R.DENSE, mod, "in_proj_bias",
                  pre + "in_proj_bias", None, rows)  # fmt: skip
    o = mod.out_proj
    b.add([*segs, "o"], R.KERNEL, R.DENSE, o, "weight", pre + "out_proj.weight", (1, 0))
    b.add([*segs, "o"], R.BIAS, R.DENSE, o, "bias", pre + "out_proj.bias", None)
    for extra in ("bias_k", "bias_v"):
        b.add(segs, extra, R.ATTENTION, mod, extra, pre + extra, None)


def _adapter_segs(segs: list[str], part: str, adapter: str) -> list[str]:
    """``<layer>/lora_A`` for PEFT's ``default`` adapter, else ``<layer>/lora_A/<adapter>``."""
    return [*segs, part] if adapter == "default" else [*segs, part, adapter]


def _lora(b: _Builder, mod: nn.Module, segs: list[str], pre: str, consumed: set[int]) -> None:
    """The adapters of a PEFT LoRA layer (layer kind ``lora``, see :func:`unwrap`).

    ``lora_A``/``lora_B`` modules (Linear, Conv) get their type's layout; an embedding's
    ``lora_embedding_A`` (r, vocab) is ``lora_A/embedding`` (vocab, r) and its
    ``lora_embedding_B`` (dim, r) is ``lora_B/kernel`` (r, dim); DoRA's
    ``lora_magnitude_vector`` is ``lora_magnitude/magnitude`` (channels-last). An adapter
    module of a type without rules is left to the generic path (and its warning).
    """
    for part in ("lora_A", "lora_B"):
        for adapter, sub in getattr(mod, part).items():
            rules = _plain_rules(sub)
            if rules is None:
                continue
            consumed.add(id(sub))
            asegs = _adapter_segs(segs, part, adapter)
            src = f"{pre}{part}.{adapter}"
            for n, t, is_buf in _own_tensors(sub):
                role, layout = rules[1].get(n, (n, "id"))
                perm = _layout_perm(layout, t.ndim)
                b.add(asegs, role, R.LORA, sub, n, f"{src}.{n}", perm, None, is_buf)
            b.site(asegs, R.LORA, sub, src)
    for attr, part, role in (
        ("lora_embedding_A", "lora_A", R.EMBEDDING),
        ("lora_embedding_B", "lora_B", R.KERNEL),
    ):
        pd = getattr(mod, attr, None)
        if isinstance(pd, nn.ParameterDict) and len(pd):
            consumed.add(id(pd))
            for adapter in pd:
                b.add(_adapter_segs(segs, part, adapter), role, R.LORA, pd, adapter,
                      f"{pre}{attr}.{adapter}", (1, 0))  # fmt: skip
    mags = getattr(mod, "lora_magnitude_vector", None)
    if isinstance(mags, nn.ModuleDict):
        for adapter, sub in mags.items():
            own = dict(sub.named_parameters(recurse=False))
            if set(own) != {"weight"}:
                continue
            consumed.add(id(sub))
            nd = own["weight"].ndim
            perm = (0, *range(2, nd), 1) if nd >= 3 else None  # conv DoRA: (1, O, 1, 1)
            b.add(_adapter_segs(segs, "lora_magnitude", adapter), R.MAGNITUDE, R.LORA, sub,
                  "weight", f"{pre}lora_magnitude_vector.{adapter}.weight", perm)  # fmt: skip


def _recurrent(b: _Builder, mod: nn.RNNBase, segs: list[str], pre: str) -> None:
    kind = R.LSTM if isinstance(mod, nn.LSTM) else R.GRU
    dirs = ["", "_reverse"] if mod.bidirectional else [""]
    for layer in range(mod.num_layers):
        lsegs = [*segs, str(layer)] if mod.num_layers > 1 else list(segs)
        for sfx in dirs:
            dsegs = [*lsegs, "reverse"] if sfx else lsegs
            for attr, role, perm in (
                (f"weight_ih_l{layer}{sfx}", R.KERNEL_IH, (1, 0)),
                (f"weight_hh_l{layer}{sfx}", R.KERNEL_HH, (1, 0)),
                (f"bias_ih_l{layer}{sfx}", R.BIAS_IH, None),
                (f"bias_hh_l{layer}{sfx}", R.BIAS_HH, None),
                (f"weight_hr_l{layer}{sfx}", "kernel_hr", (1, 0)),
            ):
                b.add(dsegs, role, kind, mod, attr, pre + attr, perm)


def activation_tensor(out: object) -> torch.Tensor | None:
    """The recorded tensor of a module output: the tensor, or a tuple's first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def activation_permutation(mod: nn.Module, t: torch.Tensor) -> tuple[int, ...] | None:
    """Permutation making ``t`` (a module output) batch-first and channels-last.

    Channel-first outputs (conv, batch/group norm: ``(N, C, *S)``) → ``(N, *S, C)``;
    sequence-first outputs (LSTM/GRU/MultiheadAttention without ``batch_first``:
    ``(T, N, F)``) → ``(N, T, F)``. Others are already canonical (None).
    """
    channel_first = (*_CONVS, *_BATCH_NORMS, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
    if isinstance(mod, channel_first) and t.ndim >= 3:
        return (0, *range(2, t.ndim), 1)
    seq_first = isinstance(mod, (nn.RNNBase, nn.MultiheadAttention)) and t.ndim == 3
    if seq_first and not getattr(mod, "batch_first", False):
        return (1, 0, 2)
    return None
