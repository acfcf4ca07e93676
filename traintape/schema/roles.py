"""Canonical roles, layer kinds and layouts shared by every adapter (docs/store-format.md, "Canonical names and layouts").

Adapters translate native names and layouts *to* these; nothing here is
framework-specific. The canonical layout is Flax/Keras's: channels-last, kernel-last.

==============  ==========================  =========================================
layer kind      roles                       canonical layout
==============  ==========================  =========================================
dense           kernel, bias                kernel (in, out)
conv            kernel, bias                kernel (*K, in/groups, out)
embedding       embedding                   (vocab, dim)
layer_norm      scale, bias                 (dim,)
rms_norm        scale                       (dim,)
group_norm      scale, bias                 (channels,)
batch_norm      scale, bias,                (channels,)
                running_mean, running_var
attention       q/k/v/o sub-layers, each a dense layer: ``<attn>/q/kernel`` (in, out)
lstm, gru       kernel_ih, kernel_hh,       kernel_ih (in, G*hidden), kernel_hh
                bias_ih, bias_hh            (hidden, G*hidden), bias_* (G*hidden,)
lora            kernel (bias), embedding,   a low-rank adapter of the layer it wraps
                magnitude                   (PEFT LoRA/DoRA): ``<layer>/lora_A/kernel``
                                            (in, r), ``<layer>/lora_B/kernel`` (r, out),
                                            ``<layer>/lora_A/embedding`` (vocab, r) of an
                                            embedding, ``<layer>/lora_magnitude/magnitude``
                                            (out,) (DoRA; channels-last for conv)
==============  ==========================  =========================================

Recurrent gate order along the last axis of ``kernel_*``/``bias_*`` (G blocks of
``hidden``): LSTM ``i, f, g, o`` (input, forget, cell candidate, output); GRU ``r, z, n``
(reset, update, new) with ``n = tanh(x W_in + b_in + r * (h W_hn + b_hn))`` — PyTorch's
order and formulation. Keras LSTM's order is also i, f, c, o; Keras GRU (reset_after=True)
is z, r, h and is permuted to r, z, n by its adapter.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

KERNEL: Final = "kernel"
BIAS: Final = "bias"
SCALE: Final = "scale"
EMBEDDING: Final = "embedding"
RUNNING_MEAN: Final = "running_mean"
RUNNING_VAR: Final = "running_var"
KERNEL_IH: Final = "kernel_ih"
KERNEL_HH: Final = "kernel_hh"
BIAS_IH: Final = "bias_ih"
BIAS_HH: Final = "bias_hh"
MAGNITUDE: Final = "magnitude"
"""DoRA's per-output magnitude vector (layer kind ``lora``)."""
OUTPUT: Final = "output"
"""Role leaf of an activation: ``<layer path>/output``."""

ROLES: Final[frozenset[str]] = frozenset(
    {KERNEL, BIAS, SCALE, EMBEDDING, RUNNING_MEAN, RUNNING_VAR, KERNEL_IH, KERNEL_HH, BIAS_IH,
     BIAS_HH, MAGNITUDE, OUTPUT}
)  # fmt: skip

DENSE: Final = "dense"
CONV: Final = "conv"
EMBED: Final = "embedding"
LAYER_NORM: Final = "layer_norm"
RMS_NORM: Final = "rms_norm"
GROUP_NORM: Final = "group_norm"
BATCH_NORM: Final = "batch_norm"
ATTENTION: Final = "attention"
LSTM: Final = "lstm"
GRU: Final = "gru"
LORA: Final = "lora"
"""A low-rank adapter (LoRA ``A``/``B`` factors, DoRA magnitude) of the layer it sits in."""

LayerKind = Literal[
    "dense", "conv", "embedding", "layer_norm", "rms_norm", "group_norm", "batch_norm",
    "attention", "lstm", "gru", "lora",
]  # fmt: skip
"""The closed set of canonical layer kinds (``TensorSpec.layer_kind``)."""

LAYER_KINDS: Final[frozenset[str]] = frozenset(get_args(LayerKind))
assert {
    DENSE,
    CONV,
    EMBED,
    LAYER_NORM,
    RMS_NORM,
    GROUP_NORM,
    BATCH_NORM,
    ATTENTION,
    LSTM,
    GRU,
    LORA,
} == LAYER_KINDS

LSTM_GATES: Final[tuple[str, ...]] = ("i", "f", "g", "o")
GRU_GATES: Final[tuple[str, ...]] = ("r", "z", "n")

ATTENTION_PROJECTIONS: Final[tuple[str, ...]] = ("q", "k", "v", "o")
"""Sub-layer names of an attention layer; each holds a dense ``kernel`` (in, out)."""

LORA_PARTS: Final[tuple[str, ...]] = ("lora_A", "lora_B", "lora_magnitude")
"""Sub-layer names of a LoRA adapter inside the layer it wraps (``<layer>/lora_A``; an
adapter other than PEFT's ``default`` adds its name: ``<layer>/lora_A/<adapter>``)."""

ROLE_ALIASES: Final[dict[str, str]] = {
    "kernel": KERNEL,
    "weight": KERNEL,
    "bias": BIAS,
    "beta": BIAS,
    "scale": SCALE,
    "gamma": SCALE,
    "embedding": EMBEDDING,
    "embeddings": EMBEDDING,
    "mean": RUNNING_MEAN,
    "moving_mean": RUNNING_MEAN,
    "running_mean": RUNNING_MEAN,
    "var": RUNNING_VAR,
    "moving_variance": RUNNING_VAR,
    "running_var": RUNNING_VAR,
}
"""Native leaf names → canonical role, where the leaf alone decides it. Adapters still
decide ``weight`` by module type (a Linear's weight is a transposed kernel, a LayerNorm's
is a scale, an Embedding's an embedding)."""


def canonical_role(leaf: str) -> str:
    """Map a native leaf name to its canonical role (unknown leaves pass through)."""
    return ROLE_ALIASES.get(leaf, leaf)
