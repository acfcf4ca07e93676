"""The compare corpus's architectures in Flax NNX (and the LLaMA model in Flax Linen),
trained with optax the way a user writes it.

Attribute paths are the canonical layer names of the torch ports
(:mod:`verdict_corpus.ports_torch`); the weights are loaded by path from the canonical
initial weights. The recurrent layers and the attention are written out (Flax's own
cells and ``MultiHeadDotProductAttention`` use other parameter layouts), with torch's
formulation and gate order. A planted bug is one named line (``bug == "..."``).
float64 runs set ``jax_enable_x64`` for their duration (and put it back, so float32 work
later in the same process is unaffected).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from verdict_corpus import arch as A

JAX_BUGS = frozenset({"lstm_gate_order_ifog", "gru_reset_before_matmul"})
"""Bugs planted in the JAX port (one line each; see :mod:`verdict_corpus.bugs`)."""


def _gelu(x: Any) -> Any:
    import jax

    return jax.nn.gelu(x, approximate=False)


def rope(x: Any) -> Any:
    """Rotary embedding on (B, T, H, dh), Llama's rotate_half convention."""
    import jax.numpy as jnp

    cos, sin = (jnp.asarray(a)[:, None, :] for a in A.rope_tables(x.dtype.name))
    h = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1) * sin


def attention(q: Any, k: Any, v: Any, causal: bool, use_rope: bool) -> Any:
    """Scaled dot-product attention over (B, T, D) projections, head h = features
    h*dh:(h+1)*dh."""
    import jax
    import jax.numpy as jnp

    b, t, d = q.shape
    dh = d // A.HEADS
    q, k, v = (y.reshape(b, t, A.HEADS, dh) for y in (q, k, v))
    if use_rope:
        q, k = rope(q), rope(k)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(dh).astype(q.dtype)
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    w = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)


def lstm_scan(x: Any, k_ih: Any, k_hh: Any, b_ih: Any, b_hh: Any, bug: str | None) -> Any:
    """torch's LSTM over (B, T, F) from zero state, gates i, f, g, o; returns (B, T, H)."""
    import jax
    import jax.numpy as jnp

    n = k_hh.shape[0]
    h = c = jnp.zeros((x.shape[0], n), x.dtype)
    outs = []
    for t in range(x.shape[1]):
        gates = x[:, t] @ k_ih + b_ih + h @ k_hh + b_hh
        if bug == "lstm_gate_order_ifog":  # Keras/Flax order i, f, o, g read as torch's
            i, f, o, g = jnp.split(gates, 4, axis=-1)
        else:
            i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        outs.append(h)
    return jnp.stack(outs, axis=1)


def gru_scan(x: Any, k_ih: Any, k_hh: Any, b_ih: Any, b_hh: Any, bug: str | None) -> Any:
    """torch's GRU over (B, T, F) from zero state, gates r, z, n; returns (B, T, H)."""
    import jax
    import jax.numpy as jnp

    n = k_hh.shape[0]
    h = jnp.zeros((x.shape[0], n), x.dtype)
    outs = []
    for t in range(x.shape[1]):
        gi = x[:, t] @ k_ih + b_ih
        gh = h @ k_hh + b_hh
        ir, iz, in_ = jnp.split(gi, 3, axis=-1)
        hr, hz, hn = jnp.split(gh, 3, axis=-1)
        r = jax.nn.sigmoid(ir + hr)
        z = jax.nn.sigmoid(iz + hz)
        if bug == "gru_reset_before_matmul":  # Keras reset_after=False
            hn = (r * h) @ k_hh[:, 2 * n :] + b_hh[2 * n :]
            nn_ = jnp.tanh(in_ + hn)
        else:
            nn_ = jnp.tanh(in_ + r * hn)
        h = (1 - z) * nn_ + z * h
        outs.append(h)
    return jnp.stack(outs, axis=1)


# ----------------------------------------------------------------------------- NNX
def nnx_model(arch: str, dtype: str, bug: str | None = None, compute: str | None = None) -> Any:
    """The NNX port of ``arch`` (weights not loaded). ``compute``: the computation dtype
    (``'bfloat16'`` for mixed precision; default ``dtype``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    pdt = jnp.dtype(dtype)
    cdt = jnp.dtype(compute or dtype)
    rngs = nnx.Rngs(0)
    kw = dict(dtype=cdt, param_dtype=pdt, rngs=rngs)

    def linear(i: int, o: int, bias: bool = True) -> Any:
        return nnx.Linear(i, o, use_bias=bias, **kw)

    def layer_norm(d: int = A.D) -> Any:
        return nnx.LayerNorm(d, epsilon=A.LN_EPS, **kw)

    def raw(shape: tuple[int, ...]) -> Any:
        return nnx.Param(jnp.zeros(shape, pdt))

    class Attention(nnx.Module):
        def __init__(self, bias: bool, causal: bool, use_rope: bool) -> None:
            self.q, self.k, self.v, self.o = (linear(A.D, A.D, bias) for _ in range(4))
            self.causal, self.use_rope = causal, use_rope

        def __call__(self, x: Any) -> Any:
            a = attention(self.q(x), self.k(x), self.v(x), self.causal, self.use_rope)
            return self.o(a)

    class MLP2(nnx.Module):
        def __init__(self) -> None:
            self.fc, self.proj = linear(A.D, A.FF), linear(A.FF, A.D)

        def __call__(self, x: Any) -> Any:
            return self.proj(_gelu(self.fc(x)))

    class PreLNBlock(nnx.Module):
        def __init__(self, causal: bool) -> None:
            self.ln1, self.attn = layer_norm(), Attention(True, causal, False)
            self.ln2, self.mlp = layer_norm(), MLP2()

        def __call__(self, x: Any) -> Any:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nnx.Module):
        def __init__(self, tied: bool) -> None:
            self.wte = nnx.Embed(A.VOCAB, A.D, **kw)
            self.wpe = nnx.Embed(A.SEQ, A.D, **kw)
            self.blocks = nnx.List([PreLNBlock(True) for _ in range(A.N_LAYERS)])
            self.ln_f = layer_norm()
            self.tied = tied
            if not tied:
                self.head = linear(A.D, A.VOCAB)

        def __call__(self, tokens: Any) -> Any:
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
            for blk in self.blocks:
                x = blk(x)
            h = self.ln_f(x)
            return self.wte.attend(h) if self.tied else self.head(h)

    class PostLNBlock(nnx.Module):
        def __init__(self) -> None:
            self.attn, self.ln1 = Attention(True, False, False), layer_norm()
            self.mlp, self.ln2 = MLP2(), layer_norm()

        def __call__(self, x: Any) -> Any:
            x = self.ln1(x + self.attn(x))
            return self.ln2(x + self.mlp(x))

    class BERT(nnx.Module):
        def __init__(self) -> None:
            self.tok = nnx.Embed(A.VOCAB, A.D, **kw)
            self.pos = nnx.Embed(A.SEQ, A.D, **kw)
            self.emb_ln = layer_norm()
            self.blocks = nnx.List([PostLNBlock() for _ in range(A.N_LAYERS)])
            self.pooler = linear(A.D, A.D)
            self.cls = linear(A.D, A.N_CLASSES)

        def __call__(self, tokens: Any) -> Any:
            x = self.emb_ln(self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None])
            for blk in self.blocks:
                x = blk(x)
            return self.cls(jnp.tanh(self.pooler(x[:, 0])))

    class SwiGLU(nnx.Module):
        def __init__(self) -> None:
            self.gate = linear(A.D, A.FF, False)
            self.up = linear(A.D, A.FF, False)
            self.down = linear(A.FF, A.D, False)

        def __call__(self, x: Any) -> Any:
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))

    class LlamaBlock(nnx.Module):
        def __init__(self) -> None:
            self.attn_norm = nnx.RMSNorm(A.D, epsilon=A.RMS_EPS, **kw)
            self.attn = Attention(False, True, True)
            self.mlp_norm = nnx.RMSNorm(A.D, epsilon=A.RMS_EPS, **kw)
            self.mlp = SwiGLU()

        def __call__(self, x: Any) -> Any:
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    class Llama(nnx.Module):
        def __init__(self) -> None:
            self.embed = nnx.Embed(A.VOCAB, A.D, **kw)
            self.layers = nnx.List([LlamaBlock() for _ in range(A.N_LAYERS)])
            self.norm = nnx.RMSNorm(A.D, epsilon=A.RMS_EPS, **kw)
            self.lm_head = linear(A.D, A.VOCAB, False)

        def __call__(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for blk in self.layers:
                x = blk(x)
            return self.lm_head(self.norm(x))

    class ViT(nnx.Module):
        def __init__(self) -> None:
            n = (A.IMG // A.PATCH) ** 2
            self.patch = nnx.Conv(A.IMG_C, A.D, (A.PATCH, A.PATCH), strides=A.PATCH,
                                  padding="VALID", **kw)  # fmt: skip
            self.cls_token = raw((1, 1, A.D))
            self.pos_embed = raw((1, n + 1, A.D))
            self.blocks = nnx.List([PreLNBlock(False)])
            self.ln = layer_norm()
            self.head = linear(A.D, A.N_CLASSES)

        def __call__(self, img: Any) -> Any:
            x = self.patch(img)
            x = x.reshape(x.shape[0], -1, A.D)  # (B, N, D), patches row-major
            cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, A.D)).astype(x.dtype)
            x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x)[:, 0])

    def batch_norm() -> Any:
        bn = nnx.BatchNorm(A.RES_C, momentum=1.0 - A.BN_MOMENTUM_TORCH, epsilon=A.BN_EPS, **kw)
        # nnx.BatchNorm keeps its running statistics in float32 whatever param_dtype
        bn.mean = nnx.BatchStat(jnp.zeros(A.RES_C, pdt))
        bn.var = nnx.BatchStat(jnp.ones(A.RES_C, pdt))
        return bn

    def conv3(i: int, o: int) -> Any:
        return nnx.Conv(i, o, (3, 3), padding=((1, 1), (1, 1)), use_bias=False, **kw)

    class BasicBlock(nnx.Module):
        def __init__(self) -> None:
            self.conv1, self.bn1 = conv3(A.RES_C, A.RES_C), batch_norm()
            self.conv2, self.bn2 = conv3(A.RES_C, A.RES_C), batch_norm()

        def __call__(self, x: Any) -> Any:
            h = jax.nn.relu(self.bn1(self.conv1(x)))
            return jax.nn.relu(x + self.bn2(self.conv2(h)))

    class ResNet(nnx.Module):
        def __init__(self) -> None:
            self.stem, self.bn = conv3(A.IMG_C, A.RES_C), batch_norm()
            self.block = BasicBlock()
            self.fc = linear(A.RES_C, A.N_CLASSES)

        def __call__(self, img: Any) -> Any:
            x = jax.nn.relu(self.bn(self.stem(img)))
            return self.fc(self.block(x).mean(axis=(1, 2)))

    class Conv1DNet(nnx.Module):
        def __init__(self) -> None:
            self.conv1 = nnx.Conv(A.CONV_C, A.CONV_H, (3,), padding=((1, 1),), **kw)
            self.conv2 = nnx.Conv(A.CONV_H, A.CONV_H, (3,), padding=((1, 1),), **kw)
            self.head = linear(A.CONV_H, 2)

        def __call__(self, x: Any) -> Any:
            h = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
            return self.head(h.mean(axis=1))

    class Recurrent(nnx.Module):
        def __init__(self, gates: int) -> None:
            self.kernel_ih = raw((A.RNN_IN, gates * A.RNN_H))
            self.kernel_hh = raw((A.RNN_H, gates * A.RNN_H))
            self.bias_ih = raw((gates * A.RNN_H,))
            self.bias_hh = raw((gates * A.RNN_H,))
            self.scan = lstm_scan if gates == 4 else gru_scan

        def __call__(self, x: Any) -> Any:
            p = (self.kernel_ih, self.kernel_hh, self.bias_ih, self.bias_hh)
            return self.scan(x, *(v[...].astype(cdt) for v in p), bug)

    class RNN(nnx.Module):
        def __init__(self, cell: str) -> None:
            setattr(self, cell, Recurrent(4 if cell == "lstm" else 3))
            self.cell = cell
            self.head = linear(A.RNN_H, A.N_CLASSES)

        def __call__(self, x: Any) -> Any:
            return self.head(getattr(self, self.cell)(x)[:, -1])

    class Expert(nnx.Module):
        def __init__(self) -> None:
            self.fc1, self.fc2 = linear(A.D, A.FF), linear(A.FF, A.D)

        def __call__(self, x: Any) -> Any:
            return self.fc2(_gelu(self.fc1(x)))

    class MoE(nnx.Module):
        def __init__(self) -> None:
            self.inp = linear(A.MOE_IN, A.D)
            self.router = linear(A.D, A.MOE_EXPERTS, False)
            self.experts = nnx.List([Expert() for _ in range(A.MOE_EXPERTS)])
            self.head = linear(A.D, 2)

        def __call__(self, x: Any) -> Any:
            h = self.inp(x)
            probs = jax.nn.softmax(self.router(h), axis=-1)
            top, idx = jax.lax.top_k(probs, A.MOE_TOPK)
            top = top / top.sum(axis=-1, keepdims=True)
            gates = (jax.nn.one_hot(idx, A.MOE_EXPERTS, dtype=top.dtype) * top[..., None]).sum(-2)
            outs = jnp.stack([e(h) for e in self.experts], axis=-1)  # (B, T, D, E)
            h = h + (outs * gates[..., None, :]).sum(axis=-1)
            return self.head(h.mean(axis=1))

    class MLP(nnx.Module):
        def __init__(self) -> None:
            self.fc1 = linear(A.MLP_IN, A.MLP_HIDDEN)
            self.drop1 = nnx.Dropout(0.0, rngs=rngs)  # the config's hidden_dropout
            self.fc2 = linear(A.MLP_HIDDEN, A.MLP_HIDDEN)
            self.drop2 = nnx.Dropout(0.0, rngs=rngs)
            self.head = linear(A.MLP_HIDDEN, A.N_CLASSES)

        def __call__(self, x: Any) -> Any:
            h = self.drop1(jax.nn.relu(self.fc1(x)))
            return self.head(self.drop2(jax.nn.relu(self.fc2(h))))

    if arch in ("gpt", "gpt_tied"):
        return GPT(arch == "gpt_tied")
    if arch in ("lstm", "gru"):
        return RNN(arch)
    cls = {"bert": BERT, "llama": Llama, "vit": ViT, "resnet": ResNet, "conv1d": Conv1DNet,
           "moe": MoE, "mlp": MLP}[arch]  # fmt: skip
    return cls()


_FLAX_LEAF = {"running_mean": "mean", "running_var": "var"}


def load_nnx(model: Any, weights: dict[str, np.ndarray]) -> None:
    """Canonical tensors → the NNX model's variables, in place (path = attribute path)."""
    import jax.numpy as jnp

    for name, value in weights.items():
        *path, role = name.split("/")
        node = model
        for seg in path:
            node = node[int(seg)] if seg.isdigit() else getattr(node, seg)
        var = getattr(node, _FLAX_LEAF.get(role, role))
        if tuple(var[...].shape) != tuple(value.shape):
            raise ValueError(f"{name}: shape {value.shape} vs NNX {var[...].shape}")
        var[...] = jnp.asarray(value)


def loss_fn(arch: str, out: Any, y: Any) -> Any:
    """The torch ports' loss (:func:`verdict_corpus.ports_torch.loss_fn`), in optax."""
    import optax

    task = A.TASK[arch]
    out = out.astype(y.dtype) if task.startswith("regress") else out
    if task == "lm":
        ce = optax.softmax_cross_entropy_with_integer_labels(out[:, :-1], y[:, 1:])
        return ce.mean()
    if task.startswith("cls"):
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
    return ((out - y) ** 2).mean()


def _decay_mask(params: Any) -> Any:
    """True where weight decay applies: not on biases and norm scales."""
    import jax

    def keep(path: tuple[Any, ...], _: Any) -> bool:
        last = getattr(path[-1], "key", getattr(path[-1], "name", path[-1]))
        return str(last) not in ("bias", "scale")

    return jax.tree_util.tree_map_with_path(keep, params)


def make_tx(recipe_name: str) -> Any:
    """The optax chain of a recipe (clipping first, as ``clip_grad_norm_`` before
    ``opt.step()``; the schedule as ``LambdaLR``)."""
    import jax.numpy as jnp
    import optax

    r = A.RECIPES[recipe_name]
    lr: Any = r.lr
    if r.schedule:
        base = r.lr

        def lr(count: Any) -> Any:
            return base * A.lr_factor(count, jnp)

    if r.optimizer == "sgd":
        opt = optax.sgd(lr, momentum=A.MOMENTUM)
    elif r.optimizer == "adam":
        opt = optax.adam(lr, b1=A.ADAM_BETAS[0], b2=A.ADAM_BETAS[1], eps=A.ADAM_EPS)
    else:
        opt = optax.adamw(lr, b1=A.ADAM_BETAS[0], b2=A.ADAM_BETAS[1], eps=A.ADAM_EPS,
                          weight_decay=A.WEIGHT_DECAY, mask=_decay_mask)  # fmt: skip
    return optax.chain(optax.clip_by_global_norm(r.clip), opt) if r.clip else opt


def _policy(recipe_name: str) -> Any:
    import traintape

    kinds = ["param", "grad", "update", "activation"]
    if A.RECIPES[recipe_name].records_opt_state:
        kinds.append("opt_state")
    return traintape.CapturePolicy(every=1, full_every=A.FULL_EVERY, kinds=tuple(kinds),
                                   snapshot_kinds=("param", "grad", "update"))  # fmt: skip


@contextlib.contextmanager
def _x64(dtype: str) -> Any:
    """float64: ``jax_enable_x64`` set globally for the run, as a user sets it, and put
    back afterwards. (Not ``jax.enable_x64(True)``: that context is thread-local, and the
    JAX adapter's host callbacks, run on another thread, then see float64 arrays as
    float32 — the recorder refuses them and capture stops.)"""
    import jax

    if dtype != "float64":
        yield
        return
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def train_nnx(
    arch: str, url: str, dtype: str, recipe_name: str, shapes: dict[str, tuple[int, ...]],
    bug: str | None = None, steps: int = A.STEPS, bf16: bool = False,
) -> None:  # fmt: skip
    """Train the NNX port with ``traintape.jax.nnx_value_and_grad`` and
    ``nnx.Optimizer(model, traintape.jax.watch(tx, rec))`` under ``nnx.jit``.
    ``shapes``: the canonical shapes (from the torch port). ``bf16``: compute in
    bfloat16, parameters in ``dtype``."""
    with _x64(dtype):
        import jax
        from flax import nnx

        import traintape
        import traintape.jax as ttj

        model = nnx_model(arch, dtype, bug, "bfloat16" if bf16 else None)
        load_nnx(model, A.initial_weights(arch, shapes, dtype))
        x, y = A.batches(arch, dtype, steps)
        with traintape.Recorder(url, policy=_policy(recipe_name)) as rec:
            opt = nnx.Optimizer(model, ttj.watch(make_tx(recipe_name), rec), wrt=nnx.Param)
            # bf16: the loss in the parameters' dtype, as torch.autocast leaves it
            vg = ttj.nnx_value_and_grad(
                lambda m, xb, yb: loss_fn(arch, m(xb).astype(dtype), yb), recorder=rec
            )

            @nnx.jit
            def step(m: Any, o: Any, xb: Any, yb: Any) -> Any:
                loss, g = vg(m, xb, yb)
                o.update(m, g)
                return loss

            for t in range(steps):
                loss = step(model, opt, x[t], y[t])
                rec.log(t, {"train/loss": float(loss)})
            jax.block_until_ready(nnx.state(model))


# ----------------------------------------------------------------------------- Linen
def train_linen_llama(
    url: str, dtype: str, recipe_name: str, shapes: dict[str, tuple[int, ...]],
    steps: int = A.STEPS,
) -> None:  # fmt: skip
    """The LLaMA model in Flax Linen, trained with ``traintape.jax.value_and_grad`` +
    ``watch(tx)`` under ``jax.jit`` (names ``layers_0`` mapped to ``layers/0``)."""
    with _x64(dtype):
        import flax.linen as nn
        import jax
        import jax.numpy as jnp
        import optax

        import traintape
        import traintape.jax as ttj

        dt = jnp.dtype(dtype)

        def dense(n: int, name: str) -> Any:
            return nn.Dense(n, use_bias=False, dtype=dt, param_dtype=dt, name=name)

        class Attn(nn.Module):
            @nn.compact
            def __call__(self, x: Any) -> Any:
                q, k, v = (dense(A.D, p)(x) for p in "qkv")
                return dense(A.D, "o")(attention(q, k, v, True, True))

        class SwiGLU(nn.Module):
            @nn.compact
            def __call__(self, x: Any) -> Any:
                g, u = dense(A.FF, "gate")(x), dense(A.FF, "up")(x)
                return dense(A.D, "down")(jax.nn.silu(g) * u)

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x: Any) -> Any:
                rms = dict(epsilon=A.RMS_EPS, dtype=dt, param_dtype=dt)
                x = x + Attn(name="attn")(nn.RMSNorm(name="attn_norm", **rms)(x))
                return x + SwiGLU(name="mlp")(nn.RMSNorm(name="mlp_norm", **rms)(x))

        class Llama(nn.Module):
            @nn.compact
            def __call__(self, tokens: Any) -> Any:
                x = nn.Embed(A.VOCAB, A.D, dtype=dt, param_dtype=dt, name="embed")(tokens)
                for i in range(A.N_LAYERS):
                    x = Block(name=f"layers_{i}")(x)
                x = nn.RMSNorm(epsilon=A.RMS_EPS, dtype=dt, param_dtype=dt, name="norm")(x)
                return dense(A.VOCAB, "lm_head")(x)

        def name_map(name: str) -> str:
            import re

            return re.sub(r"^layers_(\d+)/", r"layers/\1/", name)

        params: dict[str, Any] = {}
        for name, value in A.initial_weights("llama", shapes, dtype).items():
            *path, role = name.split("/")
            if path[0] == "layers":
                path = [f"layers_{path[1]}", *path[2:]]
            node = params
            for seg in path:
                node = node.setdefault(seg, {})
            node[role] = jnp.asarray(value)
        model = Llama()
        x, y = A.batches("llama", dtype, steps)
        with traintape.Recorder(url, policy=_policy(recipe_name)) as rec:
            tx = ttj.watch(make_tx(recipe_name), rec, name_map=name_map)
            vg = ttj.value_and_grad(lambda p, xb, yb: loss_fn("llama", model.apply({"params": p}, xb), yb),
                                    recorder=rec, name_map=name_map)  # fmt: skip

            @jax.jit
            def step(p: Any, o: Any, xb: Any, yb: Any) -> Any:
                loss, g = vg(p, xb, yb)
                u, o = tx.update(g, o, p)
                return optax.apply_updates(p, u), o, loss

            opt_state = tx.init(params)
            for t in range(steps):
                params, opt_state, loss = step(params, opt_state, x[t], y[t])
                rec.log(t, {"train/loss": float(loss)})
            jax.block_until_ready(params)
