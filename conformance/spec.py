"""Framework-independent definition of the conformance models: canonical tensor names,
shapes, the seeded initial weights, the batches and the training hyper-parameters.

Everything here is numpy only. Each framework module (:mod:`conformance.models_torch`,
:mod:`conformance.models_tf`, :mod:`conformance.models_jax`) builds the *same* model from
these names and loads :func:`initial_weights` through its adapter's ``from_canonical``
(strict: every name and shape must match, or loading fails).

Shapes are canonical (docs/store-format.md): dense kernel (in, out); conv kernel (kh, kw, in, out);
activations channels-last; recurrent kernels (in, 3*hidden) in GRU gate order r, z, n.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SEED = 20261122
STEPS = 20
"""Optimizer steps per run (t = 0 .. STEPS-1)."""
FULL_EVERY = 10
"""Full snapshots (param, grad, update, probe activations) on steps 0 and 10."""
# Every hyper-parameter is a dyadic rational, exact in float32: frameworks differ in the
# dtype they hold constants in (Keras casts SGD ``momentum`` through float32 even in a
# float64 model, which alone puts 1e-8 relative error into every float64 update).
LR = 0.0625
MOMENTUM = 0.875
LN_EPS = 2.0**-17
"""LayerNorm epsilon (≈ 7.6e-6), set explicitly in every framework."""
BN_EPS = 2.0**-10
"""BatchNorm epsilon (≈ 9.8e-4), set explicitly in every framework."""
BN_MOMENTUM_TORCH = 0.125
"""torch ``momentum`` m (new = (1-m) old + m batch) ⇔ Keras/Flax ``momentum`` 1 - m."""
BN_MOMENTUM_KERAS = 1.0 - BN_MOMENTUM_TORCH
ADAM_LR = 2.0**-7
ADAM_B1 = 0.875
ADAM_B2 = 1.0 - 2.0**-7
ADAM_EPS = 2.0**-10
"""Adam (torch ``Adam`` ⇔ ``optax.adam``: θ −= lr·m̂/(√v̂ + ε) in both). Keras Adam adds ε
to the *uncorrected* √v; its conformance optimizer takes ε_K(t) = ε·√(1−β₂ᵗ) at step t
(:func:`keras_adam_epsilon`, README). For a gradient element |g| ≪ ε the update is
≈ lr·g/ε: Adam amplifies the gradient's rounding noise by lr/ε (8192 with ε = 2⁻²⁰,
which put float32 update errors at 1e-6); ε = 2⁻¹⁰ keeps it at 8."""

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
"""GELU, tanh approximation, written out with these Python-float constants in every
framework: ``0.5·x·(1 + tanh(GELU_C·(x + GELU_A·x³)))``. The built-ins differ in the
precision of their constants (in float64, torch's and TF's tanh-GELU disagree by 1e-10)."""

# tiny sizes: the whole matrix must run in a few minutes on 2 CPU cores
BATCH = 8
MLP_IN, MLP_HIDDEN, MLP_OUT = 8, 16, 4
CNN_HW, CNN_C, CNN_F1, CNN_OUT = 8, 3, 4, 3
TF_VOCAB, TF_T, TF_D, TF_HEADS, TF_FF, TF_OUT = 16, 6, 8, 2, 16, 3
GRU_T, GRU_IN, GRU_H, GRU_OUT = 5, 3, 6, 2
LLM_VOCAB, LLM_T, LLM_D, LLM_HEADS, LLM_FF = 16, 6, 8, 2, 16
RMS_EPS = 2.0**-17
"""RMSNorm epsilon of the ``llm`` block, set explicitly in every framework."""
ROPE_THETA = 10000.0
"""Rotary position embedding base of the ``llm`` block (Llama's default)."""


@dataclass(frozen=True)
class ModelSpec:
    """One conformance model: canonical parameter shapes, input/target shapes."""

    name: str
    params: dict[str, tuple[int, ...]]
    input_shape: tuple[int, ...]
    """Per-batch input shape (batch first, channels-last)."""
    target_shape: tuple[int, ...]
    int_input: int | None = None
    """Vocabulary size when the input is token ids (int32), else None (float)."""
    buffers: tuple[str, ...] = field(default=())
    """Non-trainable recorded tensors (BatchNorm running statistics)."""


def _dense(name: str, i: int, o: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}/kernel": (i, o), f"{name}/bias": (o,)}


def _norm(name: str, d: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}/scale": (d,), f"{name}/bias": (d,)}


MLP = ModelSpec(
    "mlp",
    {**_dense("fc1", MLP_IN, MLP_HIDDEN), **_dense("head", MLP_HIDDEN, MLP_OUT)},
    (BATCH, MLP_IN),
    (BATCH, MLP_OUT),
)

CNN = ModelSpec(
    "cnn",
    {
        "conv1/kernel": (3, 3, CNN_C, CNN_F1),  # no bias: BatchNorm follows
        **_norm("bn1", CNN_F1),
        "bn1/running_mean": (CNN_F1,),
        "bn1/running_var": (CNN_F1,),
        **_dense("head", CNN_F1, CNN_OUT),
    },
    (BATCH, CNN_HW, CNN_HW, CNN_C),
    (BATCH, CNN_OUT),
    buffers=("bn1/running_mean", "bn1/running_var"),
)

TRANSFORMER = ModelSpec(
    "transformer",
    {
        "emb/embedding": (TF_VOCAB, TF_D),
        **_norm("ln1", TF_D),
        # bias-free attention: the key bias has an identically zero gradient (softmax is
        # shift-invariant), so its recorded grad is pure rounding noise
        **{f"attn/{p}/kernel": (TF_D, TF_D) for p in "qkvo"},
        **_norm("ln2", TF_D),
        **_dense("fc1", TF_D, TF_FF),
        **_dense("fc2", TF_FF, TF_D),
        **_dense("head", TF_D, TF_OUT),
    },
    (BATCH, TF_T),
    (BATCH, TF_OUT),
    int_input=TF_VOCAB,
)

GRU = ModelSpec(
    "gru",
    {
        "gru/kernel_ih": (GRU_IN, 3 * GRU_H),
        "gru/kernel_hh": (GRU_H, 3 * GRU_H),
        "gru/bias_ih": (3 * GRU_H,),
        "gru/bias_hh": (3 * GRU_H,),
        **_dense("head", GRU_H, GRU_OUT),
    },
    (BATCH, GRU_T, GRU_IN),
    (BATCH, GRU_OUT),
)

LLM = ModelSpec(
    "llm",
    {
        "embed/embedding": (LLM_VOCAB, LLM_D),
        "attn_norm/scale": (LLM_D,),
        # Llama-style: separate bias-free q/k/v/o projections, causal self-attention
        **{f"attn/{p}/kernel": (LLM_D, LLM_D) for p in "qkvo"},
        "mlp_norm/scale": (LLM_D,),
        # SwiGLU: down(silu(gate(x)) * up(x)), bias-free
        "mlp/gate/kernel": (LLM_D, LLM_FF),
        "mlp/up/kernel": (LLM_D, LLM_FF),
        "mlp/down/kernel": (LLM_FF, LLM_D),
        "norm/scale": (LLM_D,),
        "lm_head/kernel": (LLM_D, LLM_VOCAB),
    },
    (BATCH, LLM_T),
    (BATCH, LLM_T, LLM_VOCAB),
    int_input=LLM_VOCAB,
)
"""A Llama decoder block: embed → RMSNorm → causal self-attention with rotary position
embeddings on q and k (:func:`rope_tables`) → residual → RMSNorm → SwiGLU MLP →
residual → RMSNorm → lm_head, logits per token (MSE against random targets, like every
conformance model)."""

MODELS: dict[str, ModelSpec] = {m.name: m for m in (MLP, CNN, TRANSFORMER, GRU, LLM)}

_HF_LLAMA = (
    (r"^model/embed_tokens/", "embed/"),
    (r"^model/layers/(\d+)/input_layernorm/", r"layers/\1/attn_norm/"),
    (r"^model/layers/(\d+)/self_attn/([qkvo])_proj/", r"layers/\1/attn/\2/"),
    (r"^model/layers/(\d+)/post_attention_layernorm/", r"layers/\1/mlp_norm/"),
    (r"^model/layers/(\d+)/mlp/(gate|up|down)_proj/", r"layers/\1/mlp/\2/"),
    (r"^model/norm/", "norm/"),
)


def hf_llama_name_map(one_block: bool = False) -> Any:
    """A ``name_map`` preset: Hugging Face Llama-family names (``LlamaForCausalLM``,
    recorded by ``traintape.torch.watch`` as ``model/layers/0/self_attn/q_proj/kernel``
    ...) → the ``llm`` block's names: ``embed_tokens`` → ``embed``, ``input_layernorm`` →
    ``attn_norm``, ``self_attn/{q,k,v,o}_proj`` → ``attn/{q,k,v,o}``,
    ``post_attention_layernorm`` → ``mlp_norm``, ``mlp/{gate,up,down}_proj`` →
    ``mlp/{gate,up,down}``, ``model/norm`` → ``norm``, ``lm_head`` kept; block i under
    ``layers/<i>/``. ``one_block``: a one-block model (the conformance ``llm``) has no
    ``layers/0/`` prefix. Activations map the same way (``<layer>/output``)."""
    import re

    def name_map(name: str) -> str:
        for pattern, repl in _HF_LLAMA:
            name = re.sub(pattern, repl, name)
        if one_block:
            name = re.sub(r"^layers/0/", "", name)
        return name

    return name_map


FORWARD_ORDER: dict[str, list[str]] = {
    "mlp": ["fc1", "head"],
    "cnn": ["conv1", "bn1", "head"],
    "transformer": ["emb", "ln1", "attn/q", "attn/k", "attn/v", "attn/o", "attn", "ln2",
                    "fc1", "fc2", "head"],
    "gru": ["gru", "head"],
    "llm": ["embed", "attn_norm", "attn/q", "attn/k", "attn/v", "attn/o", "mlp_norm",
            "mlp/gate", "mlp/up", "mlp/down", "norm", "lm_head"],
}  # fmt: skip
"""Layer paths in forward order, written to every store's ``manifest.user['forward_order']``
so ``compare`` can name the *first* layer that diverged (no adapter records it yet)."""


def rope_tables(dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """The ``llm`` block's rotary embedding tables ``(cos, sin)``, each (T, head_dim):
    Llama's (Hugging Face's) convention — inverse frequencies θ^(−2i/d), angles
    position × frequency with the d/2 frequencies repeated (``cat(freqs, freqs)``), and
    ``x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = cat(−x[d/2:], x[:d/2])`` on
    every head of q and k. Computed once here in float64 and cast, so every framework
    uses the same constants (HF computes them in float32: ~1 ulp apart)."""
    dh = LLM_D // LLM_HEADS
    inv = 1.0 / ROPE_THETA ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    freqs = np.outer(np.arange(LLM_T, dtype=np.float64), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(dtype), np.sin(emb).astype(dtype)


def dtype_of(config: str) -> str:
    """``'float64+adam'`` → ``'float64'`` (a config is a dtype, optionally ``+adam``)."""
    return config.partition("+")[0]


def optimizer_of(config: str) -> str:
    """``'float64+adam'`` → ``'adam'``; a bare dtype → ``'sgd'`` (SGD with momentum)."""
    return config.partition("+")[2] or "sgd"


def keras_adam_epsilon(t: Any, ops: Any = None) -> Any:
    """The ε Keras's Adam must add to its uncorrected √v at step ``t`` (1, 2, ...) to
    apply torch/optax's update: lr·√(1−β₂ᵗ)/(1−β₁ᵗ)·m/(√v + ε_K) = lr·m̂/(√v̂ + ε) exactly
    when ε_K = ε·√(1−β₂ᵗ). ``ops``: ``keras.ops`` for a tensor ``t`` (else numpy)."""
    xp = np if ops is None else ops
    return ADAM_EPS * xp.sqrt(1.0 - xp.power(ADAM_B2, t))


def _rng(*keys: str | int) -> np.random.Generator:
    ints = [k if isinstance(k, int) else zlib.crc32(k.encode()) for k in keys]
    return np.random.default_rng([SEED, *ints])


def initial_weights(model: str, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Canonical initial weights of ``model``: a pure function of (SEED, model, name).

    Kernels ~ N(0, 1/fan_in) (fan_in = product of all but the last axis), embeddings
    N(0, 1), norm scales 1 + N(0, 0.1²), biases N(0, 0.1²), running mean 0, var 1.
    """
    spec = MODELS[model]
    out: dict[str, np.ndarray] = {}
    for name, shape in spec.params.items():
        role = name.rpartition("/")[2]
        r = _rng(model, name)
        if role in ("kernel", "kernel_ih", "kernel_hh"):
            fan_in = int(np.prod(shape[:-1]))
            x = r.normal(0.0, 1.0 / np.sqrt(fan_in), shape)
        elif role == "embedding":
            x = r.normal(0.0, 1.0, shape)
        elif role == "scale":
            x = 1.0 + r.normal(0.0, 0.1, shape)
        elif role == "running_mean":
            x = np.zeros(shape)
        elif role == "running_var":
            x = np.ones(shape)
        else:
            x = r.normal(0.0, 0.1, shape)
        out[name] = x.astype(dtype)
    return out


def batches(model: str, dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """Inputs [STEPS, *input_shape] and targets [STEPS, *target_shape] (batch t = row t)."""
    spec = MODELS[model]
    r = _rng(model, "data")
    if spec.int_input is not None:
        x = r.integers(0, spec.int_input, (STEPS, *spec.input_shape)).astype(np.int32)
    else:
        x = r.normal(0.0, 1.0, (STEPS, *spec.input_shape)).astype(dtype)
    y = r.normal(0.0, 1.0, (STEPS, *spec.target_shape)).astype(dtype)
    return x, y


def probe(model: str, dtype: str = "float32") -> np.ndarray:
    """The fixed input whose activations are snapshotted on full-capture steps."""
    return batches(model, dtype)[0][0]
