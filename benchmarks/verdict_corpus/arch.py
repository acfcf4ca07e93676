"""Framework-free definition of the compare corpus: sizes, data, initial weights and the
training recipes every port follows (numpy only).

The ten architectures (:data:`ARCHS`) are written once in PyTorch
(:mod:`verdict_corpus.ports_torch`) and once in Flax NNX (:mod:`verdict_corpus.ports_jax`,
the LLaMA block also in Linen), with the same canonical parameter names
(docs/store-format.md): dense kernel (in, out), conv kernel (*K, in, out), recurrent
kernels (in, G·hidden) in torch's gate order. Initial weights are a pure function of
(SEED, arch, name) in canonical layout; torch loads them with
``traintape.torch.from_canonical``, Flax by attribute path. Inputs are channels-last.

Every recipe (:data:`RECIPES`) is written in both frameworks the way a user writes it:
``torch.optim`` + ``clip_grad_norm_`` + ``LambdaLR`` and ``optax`` chains.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

SEED = 20261126
STEPS = 4
"""Optimizer steps per run (t = 0 .. STEPS-1)."""
FULL_EVERY = 2
"""Full snapshots of param, grad and update on steps 0 and 2 (activations: stats only)."""

BATCH = 4
VOCAB, SEQ, D, HEADS, FF = 32, 8, 16, 2, 32
"""Token models: vocabulary, sequence length, width, heads, MLP width."""
N_LAYERS = 2
N_CLASSES = 3
IMG, IMG_C, PATCH = 8, 3, 4
"""ViT/ResNet images: 8x8x3, ViT patches 4x4 (4 patches + a class token)."""
RES_C = 8
CONV_L, CONV_C, CONV_H = 16, 4, 8
RNN_T, RNN_IN, RNN_H = 5, 4, 8
MOE_IN, MOE_EXPERTS, MOE_TOPK = 6, 4, 2
MLP_IN, MLP_HIDDEN = 10, 32
LN_EPS = 1e-5
RMS_EPS = 1e-6
BN_EPS = 1e-5
BN_MOMENTUM_TORCH = 0.1
"""torch ``momentum`` m (new = (1-m)·old + m·batch) ⇔ Flax ``momentum`` 1 - m = 0.9."""
ROPE_THETA = 10000.0

ARCHS = ("gpt", "gpt_tied", "bert", "llama", "vit", "resnet", "conv1d", "lstm", "gru", "moe",
         "mlp")  # fmt: skip
"""gpt: 2 pre-LN blocks, biases everywhere (key bias included), untied head with bias;
gpt_tied: the same with the head tied to the token embedding; bert: post-LN encoder,
CLS pooler and classifier; llama: 2 blocks of RMSNorm, rotary causal attention and
SwiGLU, no biases; vit: patch embedding (conv 4x4 stride 4), class token, learned
positions, one pre-LN block; resnet: conv stem + BatchNorm + one basic block; conv1d:
two 1-D convolutions; lstm/gru: one recurrent layer and a head on the last step; moe: a
top-2 router over 4 expert MLPs; mlp: two hidden layers with dropout (rate 0)."""

TASK = {
    "gpt": "lm", "gpt_tied": "lm", "llama": "lm", "bert": "cls_tokens", "vit": "cls_image",
    "resnet": "cls_image", "conv1d": "regress_seq", "lstm": "cls_seq", "gru": "cls_seq",
    "moe": "regress_tokens", "mlp": "cls_vec",
}  # fmt: skip
"""lm: next-token cross-entropy (logits[:, :-1] vs tokens[:, 1:]); cls_*: cross-entropy
over N_CLASSES; regress_*: mean squared error against random targets."""


@dataclass(frozen=True)
class Recipe:
    """A training recipe, written in both frameworks.

    ``optimizer``: 'sgd' (momentum 0.9), 'adam' or 'adamw' (weight decay 0.1 on
    kernels and embeddings, none on biases and norm scales: the usual no-decay group).
    ``clip``: global gradient-norm clipping threshold (``clip_grad_norm_`` ⇔
    ``optax.clip_by_global_norm``). ``schedule``: linear warmup over 2 steps then
    linear decay (:func:`lr_factor`; ``LambdaLR`` ⇔ an optax schedule).
    """

    optimizer: str
    lr: float
    clip: float | None = None
    schedule: bool = False

    @property
    def records_opt_state(self) -> bool:
        return self.optimizer in ("adam", "adamw")


RECIPES = {
    "sgd": Recipe("sgd", 0.05),
    "sgd_clip": Recipe("sgd", 0.05, clip=0.5),
    "adam": Recipe("adam", 1e-3),
    "adamw": Recipe("adamw", 3e-3, clip=1.0, schedule=True),
}
MOMENTUM = 0.9
WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def lr_factor(t: Any, xp: Any = np) -> Any:
    """Schedule factor at optimizer step t (0-based): warmup (t+1)/2 for t < 2, then
    linear decay to 0.25 at t = STEPS. ``xp``: numpy or ``jax.numpy`` (traced step)."""
    warm = xp.minimum(1.0, (t + 1) / 2.0)
    decay = xp.maximum(0.25, 1.0 - 0.75 * (t - 1) / STEPS)
    return warm * xp.minimum(1.0, decay)


def no_decay(name: str) -> bool:
    """The no-decay group: biases and norm scales (canonical names)."""
    return name.endswith("/bias") or name.endswith("/scale")


def _rng(*keys: str | int) -> np.random.Generator:
    ints = [k if isinstance(k, int) else zlib.crc32(k.encode()) for k in keys]
    return np.random.default_rng([SEED, *ints])


def init_weight(arch: str, name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Canonical initial value of one tensor: GPT-2's N(0, 0.02²) for embeddings, the
    learned class token and positions, and biases; N(0, 1/fan_in) for kernels (at these
    small widths GPT-2's 0.02 would leave every pre-activation ~0.1 and the attention
    uniform; a 768-wide model's pre-activations are O(1), as these are); norm scales
    1 + N(0, 0.05²), running mean 0, var 1."""
    role = name.rpartition("/")[2]
    r = _rng(arch, name)
    if role == "running_mean":
        x = np.zeros(shape)
    elif role == "running_var":
        x = np.ones(shape)
    elif role == "scale":
        x = 1.0 + r.normal(0.0, 0.05, shape)
    elif role.startswith("bias") or role == "embedding" or name in ("cls_token", "pos_embed"):
        x = r.normal(0.0, 0.02, shape)
    else:
        fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else shape[0]
        x = r.normal(0.0, 1.0 / np.sqrt(fan_in), shape)
    return x.astype(dtype)


def initial_weights(arch: str, shapes: dict[str, tuple[int, ...]], dtype: str) -> dict[str, Any]:
    """Canonical initial weights for the canonical ``shapes`` of a model (read from the
    torch model with ``traintape.torch.to_canonical``)."""
    return {n: init_weight(arch, n, s, dtype) for n, s in shapes.items()}


def batches(arch: str, dtype: str, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Inputs [steps, BATCH, ...] (token ids int32, or floats channels-last) and targets
    (class ids int32, token ids for lm, floats for regression); batch t = row t."""
    r = _rng(arch, "data")
    task = TASK[arch]
    if task in ("lm", "cls_tokens"):
        x = r.integers(0, VOCAB, (steps, BATCH, SEQ)).astype(np.int32)
    elif task == "cls_image":
        x = r.normal(0.0, 1.0, (steps, BATCH, IMG, IMG, IMG_C))
    elif task == "regress_seq":
        x = r.normal(0.0, 1.0, (steps, BATCH, CONV_L, CONV_C))
    elif task == "cls_seq":
        x = r.normal(0.0, 1.0, (steps, BATCH, RNN_T, RNN_IN))
    elif task == "regress_tokens":
        x = r.normal(0.0, 1.0, (steps, BATCH, SEQ, MOE_IN))
    else:
        x = r.normal(0.0, 1.0, (steps, BATCH, MLP_IN))
    if x.dtype != np.int32:
        x = x.astype(dtype)
    if task == "lm":
        y = x
    elif task.startswith("cls"):
        y = r.integers(0, N_CLASSES, (steps, BATCH)).astype(np.int32)
    elif task == "regress_seq":
        y = r.normal(0.0, 1.0, (steps, BATCH, 2)).astype(dtype)
    else:
        y = r.normal(0.0, 1.0, (steps, BATCH, 2)).astype(dtype)
    return x, y


def rope_tables(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Rotary tables (cos, sin), each (SEQ, head_dim), Llama's rotate_half convention
    (frequencies repeated: ``cat(freqs, freqs)``), computed in float64 and cast."""
    dh = D // HEADS
    inv = 1.0 / ROPE_THETA ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    freqs = np.outer(np.arange(SEQ, dtype=np.float64), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(dtype), np.sin(emb).astype(dtype)
