"""The conformance models in JAX, with Flax Linen and with Flax NNX.

Modules are named like the torch attributes / Keras layers (``fc1``, ``conv1``, ``bn1``,
``attn/{q,k,v,o}``, ``ln1``, ``gru``, ``head``), so the JAX adapter's pytree names are the
canonical ones. Flax layouts are canonical already (Dense kernel (in, out), Conv kernel
(kh, kw, in, out)); the attention and the GRU are written out here with canonical
parameters (q/k/v/o Dense sub-layers; GRU ``kernel_ih``/``kernel_hh``/``bias_ih``/
``bias_hh`` in gate order r, z, n with PyTorch's formulation), because Flax's own
``MultiHeadDotProductAttention`` stores (in, heads, head_dim) kernels and Flax's GRUCell
keeps six separate Dense layers.

The JAX adapter has no ``from_canonical``: :func:`linen_variables` / :func:`load_nnx`
are the conformance-local inverse mapping (canonical name → pytree path, role leaf →
Flax leaf: ``running_mean`` → ``mean``, ``running_var`` → ``var``).
"""

from __future__ import annotations

import os
from typing import Any

from conformance import spec as S

_FLAX_LEAF = {"running_mean": "mean", "running_var": "var"}


def _jax(dtype: str) -> Any:
    import jax

    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    return jax


# ----------------------------------------------------------------------------- math
def attention(q: Any, k: Any, v: Any, heads: int, causal: bool = False) -> Any:
    """Scaled dot-product attention over (B, T, D) projections (or one example's (T, D));
    head h = features h*dh:(h+1)*dh (torch ``in_proj`` row blocks, Keras row-major
    reshape). ``causal`` (the ``llm`` block): rotary embeddings on q and k
    (``spec.rope_tables``) and position i attends to j <= i (masked logits -inf)."""
    import jax
    import jax.numpy as jnp

    *b, t, d = q.shape
    dh = d // heads

    def split(x: Any) -> Any:
        return x.reshape(*b, t, heads, dh)

    qs, ks = split(q), split(k)
    if causal:  # the llm block: rotary q and k (Llama's rotate_half convention)
        cos, sin = (jnp.asarray(a)[:, None, :] for a in S.rope_tables(q.dtype.name))
        h = dh // 2

        def rope(x: Any) -> Any:
            return x * cos + jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1) * sin

        qs, ks = rope(qs), rope(ks)
    logits = jnp.einsum("...qhd,...khd->...hqk", qs / jnp.sqrt(dh).astype(q.dtype), ks)
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    w = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", w, split(v)).reshape(*b, t, d)


def swiglu(g: Any, u: Any) -> Any:
    """silu(g) * u, silu written out as g * sigmoid(g) (as in every framework)."""
    import jax

    return g * jax.nn.sigmoid(g) * u


def gelu(x: Any) -> Any:
    """GELU, tanh approximation, with the conformance constants (see spec.GELU_C)."""
    import jax.numpy as jnp

    return 0.5 * x * (1.0 + jnp.tanh(S.GELU_C * (x + S.GELU_A * x * x * x)))


def gru_scan(x: Any, k_ih: Any, k_hh: Any, b_ih: Any, b_hh: Any) -> Any:
    """PyTorch GRU over (B, T, F) from h0 = 0; returns the output sequence (B, T, H)."""
    import jax
    import jax.numpy as jnp

    h = jnp.zeros((x.shape[0], k_hh.shape[0]), x.dtype)
    outs = []
    for t in range(x.shape[1]):
        gi = x[:, t] @ k_ih + b_ih
        gh = h @ k_hh + b_hh
        ir, iz, in_ = jnp.split(gi, 3, axis=-1)
        hr, hz, hn = jnp.split(gh, 3, axis=-1)
        r = jax.nn.sigmoid(ir + hr)
        z = jax.nn.sigmoid(iz + hz)
        n = jnp.tanh(in_ + r * hn)
        h = (1 - z) * n + z * h
        outs.append(h)
    return jnp.stack(outs, axis=1)


# ----------------------------------------------------------------------------- Linen
LAYER_KINDS = {"attn": "attention", "gru": "gru"}
"""The custom modules' layer kinds (torch/Keras know theirs from built-in classes)."""


def layer_kinds(model_name: str) -> dict[str, str]:
    """:data:`LAYER_KINDS` for ``model_name``; none for ``llm``, whose attention is written
    out in every framework (torch/Keras record its q/k/v/o projections as dense layers)."""
    return {} if model_name == "llm" else LAYER_KINDS


def linen_model(model_name: str, dtype: str) -> Any:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)

    def dense(n: int, name: str, bias: bool = True) -> Any:
        return nn.Dense(n, use_bias=bias, dtype=dt, param_dtype=dt, name=name)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: Any, train: bool = True) -> Any:
            return dense(S.MLP_OUT, "head")(jnp.tanh(dense(S.MLP_HIDDEN, "fc1")(x)))

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: Any, train: bool = True) -> Any:
            h = nn.Conv(S.CNN_F1, (3, 3), padding=((1, 1), (1, 1)), use_bias=False,
                        dtype=dt, param_dtype=dt, name="conv1")(x)  # fmt: skip
            h = nn.BatchNorm(use_running_average=not train, momentum=S.BN_MOMENTUM_KERAS,
                             epsilon=S.BN_EPS, dtype=dt, param_dtype=dt, name="bn1")(h)  # fmt: skip
            h = nn.avg_pool(jax.nn.relu(h), (2, 2), strides=(2, 2))
            return dense(S.CNN_OUT, "head")(h.mean(axis=(1, 2)))

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            q, k, v = (dense(S.TF_D, p, bias=False)(x) for p in "qkv")
            return dense(S.TF_D, "o", bias=False)(attention(q, k, v, S.TF_HEADS))

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any, train: bool = True) -> Any:
            x = nn.Embed(S.TF_VOCAB, S.TF_D, dtype=dt, param_dtype=dt, name="emb")(tokens)
            ln = dict(epsilon=S.LN_EPS, dtype=dt, param_dtype=dt)
            x = x + Attention(name="attn")(nn.LayerNorm(name="ln1", **ln)(x))
            h = nn.LayerNorm(name="ln2", **ln)(x)
            x = x + dense(S.TF_D, "fc2")(gelu(dense(S.TF_FF, "fc1")(h)))
            return dense(S.TF_OUT, "head")(x.mean(axis=1))

    class GRU(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            z = nn.initializers.zeros
            k_ih = self.param("kernel_ih", z, (S.GRU_IN, 3 * S.GRU_H), dt)
            k_hh = self.param("kernel_hh", z, (S.GRU_H, 3 * S.GRU_H), dt)
            b_ih = self.param("bias_ih", z, (3 * S.GRU_H,), dt)
            b_hh = self.param("bias_hh", z, (3 * S.GRU_H,), dt)
            return gru_scan(x, k_ih, k_hh, b_ih, b_hh)

    class GRUModel(nn.Module):
        @nn.compact
        def __call__(self, x: Any, train: bool = True) -> Any:
            return dense(S.GRU_OUT, "head")(GRU(name="gru")(x)[:, -1])

    class CausalSelfAttention(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            q, k, v = (dense(S.LLM_D, p, bias=False)(x) for p in "qkv")
            return dense(S.LLM_D, "o", bias=False)(attention(q, k, v, S.LLM_HEADS, causal=True))

    class SwiGLU(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            g = dense(S.LLM_FF, "gate", bias=False)(x)
            u = dense(S.LLM_FF, "up", bias=False)(x)
            return dense(S.LLM_D, "down", bias=False)(swiglu(g, u))

    class LLMBlock(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any, train: bool = True) -> Any:
            rms = dict(epsilon=S.RMS_EPS, dtype=dt, param_dtype=dt)
            x = nn.Embed(S.LLM_VOCAB, S.LLM_D, dtype=dt, param_dtype=dt, name="embed")(tokens)
            x = x + CausalSelfAttention(name="attn")(nn.RMSNorm(name="attn_norm", **rms)(x))
            x = x + SwiGLU(name="mlp")(nn.RMSNorm(name="mlp_norm", **rms)(x))
            return dense(S.LLM_VOCAB, "lm_head", bias=False)(nn.RMSNorm(name="norm", **rms)(x))

    builders = {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "gru": GRUModel,
                "llm": LLMBlock}  # fmt: skip
    return builders[model_name]()


def linen_variables(weights: dict[str, Any]) -> dict[str, Any]:
    """Canonical tensors → Linen variables ``{'params': ..., 'batch_stats': ...}``."""
    import jax.numpy as jnp

    out: dict[str, Any] = {}
    for name, value in weights.items():
        *path, role = name.split("/")
        coll = "batch_stats" if role in _FLAX_LEAF else "params"
        node = out.setdefault(coll, {})
        for seg in path:
            node = node.setdefault(seg, {})
        node[_FLAX_LEAF.get(role, role)] = jnp.asarray(value)
    return out


def _mse(out: Any, y: Any) -> Any:
    return ((out - y) ** 2).mean()


def _tx(optimizer: str) -> Any:
    import optax

    if optimizer == "sgd":
        return optax.sgd(S.LR, momentum=S.MOMENTUM)
    if optimizer == "adam":
        return optax.adam(S.ADAM_LR, b1=S.ADAM_B1, b2=S.ADAM_B2, eps=S.ADAM_EPS)
    raise ValueError(optimizer)


def train_linen(
    model_name: str, url: str, dtype: str, steps: int = S.STEPS, optimizer: str = "sgd"
) -> None:
    """Train the Linen model with ``traintape.jax.value_and_grad`` + ``watch(optax.sgd)``."""
    jax = _jax(dtype)
    import optax

    import traintape.jax as ttj
    from conformance.policy import recorder

    model = linen_model(model_name, dtype)
    variables = linen_variables(S.initial_weights(model_name, dtype))
    params, stats = variables["params"], variables.get("batch_stats")
    x, y = S.batches(model_name, dtype)
    if jax.process_count() > 1:
        params, stats, x, y = data_parallel(jax, params, stats, x, y)
    with recorder(url, model_name, optimizer) as rec:
        tx = ttj.watch(_tx(optimizer), rec)

        def loss_fn(p: Any, st: Any, xb: Any, yb: Any) -> Any:
            if st is None:
                return _mse(model.apply({"params": p}, xb), yb), None
            out, upd = model.apply({"params": p, "batch_stats": st}, xb, mutable=["batch_stats"])
            return _mse(out, yb), upd["batch_stats"]

        vg = ttj.value_and_grad(loss_fn, has_aux=True, recorder=rec,
                                layer_kinds=layer_kinds(model_name))  # fmt: skip

        @jax.jit
        def step(p: Any, st: Any, o: Any, xb: Any, yb: Any) -> Any:
            (_, st), g = vg(p, st, xb, yb)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), st, o

        opt_state = tx.init(params)
        for t in range(steps):
            params, stats, opt_state = step(params, stats, opt_state, x[t], y[t])
        jax.block_until_ready(params)


def data_parallel(jax: Any, params: Any, stats: Any, x: Any, y: Any) -> tuple:
    """Under ``jax.distributed``: a ("data",) mesh over every process's devices, the
    parameters (and batch statistics) replicated, every batch split over "data" — global
    arrays each process builds from its own copy of the data (no host transfer between
    processes). Returns ``(params, stats, xs, ys)`` with ``xs[t]``/``ys[t]`` batch t."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))

    def put(a: Any, spec: Any) -> Any:
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    rep = lambda t: None if t is None else jax.tree.map(lambda a: put(a, P()), t)  # noqa: E731
    xs = [put(b, P("data")) for b in x]
    ys = [put(b, P("data")) for b in y]
    return rep(params), rep(stats), xs, ys


def train(
    model_name: str, url: str, dtype: str, flavour: str = "linen", optimizer: str = "sgd"
) -> None:
    """Train ``model_name`` with Flax ``flavour`` ('linen' or 'nnx') into ``url``."""
    if flavour == "linen":
        train_linen(model_name, url, dtype, optimizer=optimizer)
    elif flavour == "nnx":
        train_nnx(model_name, url, dtype, optimizer=optimizer)
    else:
        raise KeyError(flavour)


# ----------------------------------------------------------------------------- NNX
def nnx_model(model_name: str, dtype: str) -> Any:
    """The NNX model (attribute names = canonical layer names); weights not loaded."""
    import jax
    import jax.numpy as jnp
    from flax import linen, nnx

    dt = jnp.dtype(dtype)
    rngs = nnx.Rngs(0)

    def linear(i: int, o: int, bias: bool = True) -> Any:
        return nnx.Linear(i, o, use_bias=bias, dtype=dt, param_dtype=dt, rngs=rngs)

    class MLP(nnx.Module):
        def __init__(self) -> None:
            self.fc1 = linear(S.MLP_IN, S.MLP_HIDDEN)
            self.head = linear(S.MLP_HIDDEN, S.MLP_OUT)

        def __call__(self, x: Any) -> Any:
            return self.head(jnp.tanh(self.fc1(x)))

    class CNN(nnx.Module):
        def __init__(self) -> None:
            self.conv1 = nnx.Conv(S.CNN_C, S.CNN_F1, (3, 3), padding=((1, 1), (1, 1)),
                                  use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)  # fmt: skip
            self.bn1 = nnx.BatchNorm(S.CNN_F1, momentum=S.BN_MOMENTUM_KERAS, epsilon=S.BN_EPS,
                                     dtype=dt, param_dtype=dt, rngs=rngs)  # fmt: skip
            # nnx.BatchNorm keeps its running statistics in float32 whatever param_dtype
            self.bn1.mean = nnx.BatchStat(jnp.zeros(S.CNN_F1, dt))
            self.bn1.var = nnx.BatchStat(jnp.ones(S.CNN_F1, dt))
            self.head = linear(S.CNN_F1, S.CNN_OUT)

        def __call__(self, x: Any) -> Any:
            h = linen.avg_pool(jax.nn.relu(self.bn1(self.conv1(x))), (2, 2), strides=(2, 2))
            return self.head(h.mean(axis=(1, 2)))

    class Attention(nnx.Module):
        def __init__(self) -> None:
            self.q = linear(S.TF_D, S.TF_D, bias=False)
            self.k = linear(S.TF_D, S.TF_D, bias=False)
            self.v = linear(S.TF_D, S.TF_D, bias=False)
            self.o = linear(S.TF_D, S.TF_D, bias=False)

        def __call__(self, x: Any) -> Any:
            return self.o(attention(self.q(x), self.k(x), self.v(x), S.TF_HEADS))

    class Transformer(nnx.Module):
        def __init__(self) -> None:
            self.emb = nnx.Embed(S.TF_VOCAB, S.TF_D, dtype=dt, param_dtype=dt, rngs=rngs)
            self.ln1 = nnx.LayerNorm(S.TF_D, epsilon=S.LN_EPS, dtype=dt, param_dtype=dt,
                                     rngs=rngs)  # fmt: skip
            self.attn = Attention()
            self.ln2 = nnx.LayerNorm(S.TF_D, epsilon=S.LN_EPS, dtype=dt, param_dtype=dt,
                                     rngs=rngs)  # fmt: skip
            self.fc1 = linear(S.TF_D, S.TF_FF)
            self.fc2 = linear(S.TF_FF, S.TF_D)
            self.head = linear(S.TF_D, S.TF_OUT)

        def __call__(self, tokens: Any) -> Any:
            x = self.emb(tokens)
            x = x + self.attn(self.ln1(x))
            x = x + self.fc2(gelu(self.fc1(self.ln2(x))))
            return self.head(x.mean(axis=1))

    class GRU(nnx.Module):
        def __init__(self) -> None:
            z = jnp.zeros
            self.kernel_ih = nnx.Param(z((S.GRU_IN, 3 * S.GRU_H), dt))
            self.kernel_hh = nnx.Param(z((S.GRU_H, 3 * S.GRU_H), dt))
            self.bias_ih = nnx.Param(z((3 * S.GRU_H,), dt))
            self.bias_hh = nnx.Param(z((3 * S.GRU_H,), dt))

        def __call__(self, x: Any) -> Any:
            return gru_scan(x, self.kernel_ih[...], self.kernel_hh[...], self.bias_ih[...],
                            self.bias_hh[...])  # fmt: skip

    class GRUModel(nnx.Module):
        def __init__(self) -> None:
            self.gru = GRU()
            self.head = linear(S.GRU_H, S.GRU_OUT)

        def __call__(self, x: Any) -> Any:
            return self.head(self.gru(x)[:, -1])

    def rms_norm() -> Any:
        return nnx.RMSNorm(S.LLM_D, epsilon=S.RMS_EPS, dtype=dt, param_dtype=dt, rngs=rngs)

    class CausalSelfAttention(nnx.Module):
        def __init__(self) -> None:
            d = S.LLM_D
            self.q = linear(d, d, bias=False)
            self.k = linear(d, d, bias=False)
            self.v = linear(d, d, bias=False)
            self.o = linear(d, d, bias=False)

        def __call__(self, x: Any) -> Any:
            return self.o(attention(self.q(x), self.k(x), self.v(x), S.LLM_HEADS, causal=True))

    class SwiGLU(nnx.Module):
        def __init__(self) -> None:
            self.gate = linear(S.LLM_D, S.LLM_FF, bias=False)
            self.up = linear(S.LLM_D, S.LLM_FF, bias=False)
            self.down = linear(S.LLM_FF, S.LLM_D, bias=False)

        def __call__(self, x: Any) -> Any:
            return self.down(swiglu(self.gate(x), self.up(x)))

    class LLMBlock(nnx.Module):
        def __init__(self) -> None:
            self.embed = nnx.Embed(S.LLM_VOCAB, S.LLM_D, dtype=dt, param_dtype=dt, rngs=rngs)
            self.attn_norm = rms_norm()
            self.attn = CausalSelfAttention()
            self.mlp_norm = rms_norm()
            self.mlp = SwiGLU()
            self.norm = rms_norm()
            self.lm_head = linear(S.LLM_D, S.LLM_VOCAB, bias=False)

        def __call__(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            x = x + self.attn(self.attn_norm(x))
            x = x + self.mlp(self.mlp_norm(x))
            return self.lm_head(self.norm(x))

    builders = {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "gru": GRUModel,
                "llm": LLMBlock}  # fmt: skip
    return builders[model_name]()


def load_nnx(model: Any, weights: dict[str, Any]) -> None:
    """Canonical tensors → the NNX model's variables, in place (path = attribute path)."""
    import jax.numpy as jnp

    for name, value in weights.items():
        *path, role = name.split("/")
        node = model
        for seg in path:
            node = getattr(node, seg)
        var = getattr(node, _FLAX_LEAF.get(role, role))
        if tuple(var[...].shape) != tuple(value.shape):
            raise ValueError(f"{name}: shape {value.shape} vs NNX {var[...].shape}")
        var[...] = jnp.asarray(value)


def train_nnx(
    model_name: str, url: str, dtype: str, steps: int = S.STEPS, optimizer: str = "sgd"
) -> None:
    """Train the NNX model with ``traintape.jax.nnx_value_and_grad`` + ``watch(optax.sgd)``."""
    jax = _jax(dtype)
    from flax import nnx

    import traintape.jax as ttj
    from conformance.policy import recorder

    model = nnx_model(model_name, dtype)
    load_nnx(model, S.initial_weights(model_name, dtype))
    x, y = S.batches(model_name, dtype)
    with recorder(url, model_name, optimizer) as rec:
        opt = nnx.Optimizer(model, ttj.watch(_tx(optimizer), rec),
                            wrt=nnx.Param)  # fmt: skip
        vg = ttj.nnx_value_and_grad(lambda m, xb, yb: _mse(m(xb), yb), recorder=rec,
                                    layer_kinds=layer_kinds(model_name))  # fmt: skip

        @nnx.jit
        def step(m: Any, o: Any, xb: Any, yb: Any) -> None:
            _, g = vg(m, xb, yb)
            o.update(m, g)

        for t in range(steps):
            step(model, opt, x[t], y[t])
        jax.block_until_ready(nnx.state(model))
