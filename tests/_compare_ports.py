"""Ports of one model between frameworks, for the compare must-show cases of issue 24.

GPT: a decoder of 2 pre-LayerNorm blocks — causal self-attention with biases on every
projection (the key bias's gradient is zero in exact arithmetic: softmax is invariant to
a per-query constant, so each framework records its rounding noise), exact-erf GELU MLP
— token and position embeddings, a final LayerNorm and an lm head; next-token
cross-entropy on random tokens. Written in Flax NNX and in PyTorch, torch initialised
with ``traintape.torch.from_canonical`` from the same canonical weights the NNX model
loads; SGD; recorded every step (full snapshots every 3 steps).

LLaMA: one Llama block (RMSNorm, rotary q/k, SwiGLU, no biases) in Flax Linen and
PyTorch, AdamW with weight decay after global-norm clipping at 1.0.

``bug`` plants one porting mistake in the torch model: ``'no_mask'`` (causal mask
missing), ``'scale_1_over_d'`` (logits scaled by 1/d instead of 1/sqrt(d_head)),
``'transposed_q'`` (block 0's q kernel loaded transposed: square, so shapes cannot
tell),
``'decay_norms'`` (LLaMA: weight decay on the RMSNorm scales in torch only).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import traintape

VOCAB, T, D, HEADS, FF, BLOCKS, BATCH = 32, 8, 16, 2, 32, 2, 4
STEPS, LR = 6, 0.25
LN_EPS = 1e-5
SEED = 24


def gpt_weights() -> dict[str, np.ndarray]:
    """Canonical GPT weights (dense kernels (in, out)), float32, seeded."""
    rng = np.random.default_rng(SEED)
    w: dict[str, np.ndarray] = {
        "wte/embedding": rng.normal(0, 1.0, (VOCAB, D)),
        "wpe/embedding": rng.normal(0, 0.5, (T, D)),
    }

    def dense(name: str, i: int, o: int) -> None:
        w[f"{name}/kernel"] = rng.normal(0, 1 / math.sqrt(i), (i, o))
        w[f"{name}/bias"] = rng.normal(0, 0.1, (o,))

    def norm(name: str) -> None:
        w[f"{name}/scale"] = 1 + rng.normal(0, 0.1, (D,))
        w[f"{name}/bias"] = rng.normal(0, 0.1, (D,))

    for b in range(BLOCKS):
        p = f"blocks/{b}"
        norm(f"{p}/ln1")
        for x in "qkvo":
            dense(f"{p}/attn/{x}", D, D)
        norm(f"{p}/ln2")
        dense(f"{p}/mlp/fc", D, FF)
        dense(f"{p}/mlp/proj", FF, D)
    norm("ln_f")
    dense("head", D, VOCAB)
    return {k: v.astype(np.float32) for k, v in w.items()}


def gpt_batches() -> tuple[np.ndarray, np.ndarray]:
    """Tokens [STEPS, BATCH, T] and next-token targets (random tokens, int32)."""
    rng = np.random.default_rng(SEED + 1)
    seq = rng.integers(0, VOCAB, (STEPS, BATCH, T + 1)).astype(np.int32)
    return seq[:, :, :-1], seq[:, :, 1:]


def policy(snapshots: bool = True, opt_state: bool = False) -> traintape.CapturePolicy:
    kinds = ["param", "grad", "update", "activation"] + (["opt_state"] if opt_state else [])
    snaps = tuple(k for k in kinds if k != "activation") if snapshots else ()
    return traintape.CapturePolicy(every=1, full_every=3, kinds=tuple(kinds),
                                   snapshot_kinds=snaps)  # fmt: skip


# ------------------------------------------------------------------------------ torch
def torch_gpt(bug: str | None = None) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            dh = D // HEADS
            q = self.q(x)

            def split(y: torch.Tensor) -> torch.Tensor:
                return y.reshape(b, t, HEADS, dh).transpose(1, 2)

            scale = 1.0 / D if bug == "scale_1_over_d" else 1.0 / math.sqrt(dh)
            logits = split(q) @ split(self.k(x)).transpose(-1, -2) * scale
            if bug != "no_mask":
                mask = torch.ones(t, t, dtype=torch.bool).tril()
                logits = logits.masked_fill(~mask, float("-inf"))
            y = torch.softmax(logits, dim=-1) @ split(self.v(x))
            return self.o(y.transpose(1, 2).reshape(b, t, D))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.proj = nn.Linear(D, FF), nn.Linear(FF, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(F.gelu(self.fc(x)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.attn = nn.LayerNorm(D, eps=LN_EPS), Attention()
            self.ln2, self.mlp = nn.LayerNorm(D, eps=LN_EPS), MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.ln_f, self.head = nn.LayerNorm(D, eps=LN_EPS), nn.Linear(D, VOCAB)

        def forward(self, tok: torch.Tensor) -> torch.Tensor:
            x = self.wte(tok) + self.wpe(torch.arange(tok.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    return GPT()


def train_torch_gpt(
    url: str, bug: str | None = None, snapshots: bool = True, bf16: bool = False
) -> None:
    """``bf16``: forward and backward under ``torch.autocast('cpu', torch.bfloat16)``
    (mixed precision: float32 params and optimizer), recorded as
    ``user={'precision': 'bf16-mixed'}``."""
    import torch
    import torch.nn.functional as F

    import traintape.torch as ttt

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = torch_gpt(bug)
    w = gpt_weights()
    if bug == "transposed_q":  # the port loads the (square) q kernel without transposing
        w["blocks/0/attn/q/kernel"] = np.ascontiguousarray(w["blocks/0/attn/q/kernel"].T)
    ttt.from_canonical(model, w, strict=True)
    x, y = gpt_batches()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    user = {"precision": "bf16-mixed"} if bf16 else None
    with (
        traintape.Recorder(url, policy(snapshots), user=user) as rec,
        ttt.watch(model, rec) as handle,
    ):
        for t in range(STEPS):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(torch.from_numpy(x[t]).long()).float()
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(y[t]).long().ravel())
            loss.backward()
            opt.step()
            handle.step()
            rec.log(t, loss=float(loss.detach()))


# -------------------------------------------------------------------------------- NNX
def nnx_gpt() -> Any:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rngs = nnx.Rngs(0)

    def linear(i: int, o: int) -> Any:
        return nnx.Linear(i, o, rngs=rngs)

    def norm() -> Any:
        return nnx.LayerNorm(D, epsilon=LN_EPS, rngs=rngs)

    class Attention(nnx.Module):
        def __init__(self) -> None:
            self.q, self.k, self.v, self.o = linear(D, D), linear(D, D), linear(D, D), linear(D, D)

        def __call__(self, x: Any) -> Any:
            b, t, _ = x.shape
            dh = D // HEADS

            def split(y: Any) -> Any:
                return y.reshape(b, t, HEADS, dh).transpose(0, 2, 1, 3)

            logits = split(self.q(x)) @ split(self.k(x)).transpose(0, 1, 3, 2) / math.sqrt(dh)
            mask = jnp.tril(jnp.ones((t, t), bool))
            w = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
            y = (w @ split(self.v(x))).transpose(0, 2, 1, 3).reshape(b, t, D)
            return self.o(y)

    class MLP(nnx.Module):
        def __init__(self) -> None:
            self.fc, self.proj = linear(D, FF), linear(FF, D)

        def __call__(self, x: Any) -> Any:
            return self.proj(jax.nn.gelu(self.fc(x), approximate=False))

    class Block(nnx.Module):
        def __init__(self) -> None:
            self.ln1, self.attn, self.ln2, self.mlp = norm(), Attention(), norm(), MLP()

        def __call__(self, x: Any) -> Any:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nnx.Module):
        def __init__(self) -> None:
            self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
            self.wpe = nnx.Embed(T, D, rngs=rngs)
            self.blocks = nnx.List([Block() for _ in range(BLOCKS)])
            self.ln_f, self.head = norm(), linear(D, VOCAB)

        def __call__(self, tok: Any) -> Any:
            x = self.wte(tok) + self.wpe(jnp.arange(tok.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    return GPT()


def _load_nnx(model: Any, weights: dict[str, np.ndarray]) -> None:
    import jax.numpy as jnp

    for name, value in weights.items():
        *path, role = name.split("/")
        node = model
        for seg in path:
            node = node[int(seg)] if seg.isdigit() else getattr(node, seg)
        var = getattr(node, role)
        assert tuple(var[...].shape) == value.shape, name
        var[...] = jnp.asarray(value)


def train_nnx_gpt(url: str, snapshots: bool = True) -> None:
    import jax
    import optax
    from flax import nnx

    import traintape.jax as ttj

    model = nnx_gpt()
    _load_nnx(model, gpt_weights())
    x, y = gpt_batches()

    def loss_fn(m: Any, xb: Any, yb: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(m(xb), yb).mean()

    with traintape.Recorder(url, policy(snapshots)) as rec:
        opt = nnx.Optimizer(model, ttj.watch(optax.sgd(LR), rec), wrt=nnx.Param)
        vg = ttj.nnx_value_and_grad(loss_fn, recorder=rec)

        @nnx.jit
        def step(m: Any, o: Any, xb: Any, yb: Any) -> Any:
            loss, g = vg(m, xb, yb)
            o.update(m, g)
            return loss

        for t in range(STEPS):
            loss = step(model, opt, x[t], y[t])
            rec.log(t, loss=float(jax.device_get(loss)))


# ----------------------------------------------------------------------------- LLaMA
ADAMW = dict(lr=2e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
CLIP = 1.0
LLAMA_STEPS = 6


def _llama_setup() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conformance/
    from conformance import spec as S

    w = S.initial_weights("llm", "float32")
    x, y = S.batches("llm", "float32")
    return w, x, y


def train_torch_llama(url: str, bug: str | None = None, clip: float = CLIP) -> None:
    """conformance's ``llm`` block in torch, AdamW (decay off for norm scales) after
    ``clip_grad_norm_(clip)``; ``bug='decay_norms'``: decay on the scales too."""
    import torch
    import torch.nn.functional as F

    import traintape.torch as ttt
    from conformance import models_torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    w, x, y = _llama_setup()
    model = models_torch.LLMBlock()
    ttt.from_canonical(model, w, strict=True)
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.RMSNorm)
             for p in m.parameters()}  # fmt: skip
    decay = [p for p in model.parameters() if bug == "decay_norms" or id(p) not in norms]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    hp = ADAMW
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"])  # fmt: skip
    with (
        traintape.Recorder(url, policy(opt_state=True)) as rec,
        ttt.watch(model, rec, optimizer=opt),
    ):
        for t in range(LLAMA_STEPS):
            opt.zero_grad()
            loss = F.mse_loss(model(torch.from_numpy(x[t])), torch.from_numpy(y[t]))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            rec.log(t, loss=float(loss.detach()))


def train_linen_llama(url: str, clip: float = CLIP) -> None:
    """conformance's ``llm`` block in Flax Linen, ``optax.chain(clip_by_global_norm,
    adamw(mask: no decay on norm scales))``."""
    import jax
    import optax

    import traintape.jax as ttj
    from conformance import models_jax

    w, x, y = _llama_setup()
    model = models_jax.linen_model("llm", "float32")
    params = models_jax.linen_variables(w)["params"]
    hp = ADAMW

    def mask(p: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: getattr(path[-1], "key", "") != "scale", p
        )

    tx = optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"],
                    weight_decay=hp["weight_decay"], mask=mask),
    )  # fmt: skip
    with traintape.Recorder(url, policy(opt_state=True)) as rec:
        tx = ttj.watch(tx, rec)
        vg = ttj.value_and_grad(
            lambda p, xb, yb: ((model.apply({"params": p}, xb) - yb) ** 2).mean(), recorder=rec
        )

        @jax.jit
        def step(p: Any, o: Any, xb: Any, yb: Any) -> Any:
            loss, g = vg(p, xb, yb)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o, loss

        opt_state = tx.init(params)
        for t in range(LLAMA_STEPS):
            params, opt_state, loss = step(params, opt_state, x[t], y[t])
            rec.log(t, loss=float(jax.device_get(loss)))
