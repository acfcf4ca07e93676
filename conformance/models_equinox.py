"""The conformance models in Equinox, recorded through ``traintape.jax``.

Equinox layers see one example (``eqx.nn.Linear`` maps a vector), so each model maps one
example and training runs ``jax.vmap(model)`` over the batch (and the per-token layers
``jax.vmap`` over the tokens), as equinox code does. Field names are the canonical layer
names; equinox's PyTorch-like layouts (``Linear.weight`` (out, in), ``MultiheadAttention``
``query_proj``...) are mapped to canonical ones by the JAX adapter
(``traintape/adapters/jax/equinox.py``).

Weights in: :func:`load` (conformance-local, as for Flax: the JAX adapter has no
``from_canonical``) inverts the adapter's own mapping — every array leaf of the model
gets the canonical tensor of its canonical name (``traintape.jax.named_leaves``),
transposed back by the leaf's permutation; strict (every name, every shape).
Recording: ``traintape.jax.filter_value_and_grad`` (param, grad, activation) under
``eqx.filter_jit``, ``traintape.jax.watch(optax...)`` (update, opt_state).

The ``cnn``'s ``eqx.nn.BatchNorm`` (``mode="batch"``) keeps its running statistics in an
``eqx.nn.State``: loaded from the canonical ``bn1/running_mean``/``running_var``
(:func:`load_state`), threaded through the training step, and recorded by the adapter
from the State argument.

``gru`` is written out, as the Flax columns write it (``models_jax.gru_scan``): a small
module holding PyTorch's four parameters in canonical layout as plain array fields
(``gru/kernel_ih`` (in, 3H), ``kernel_hh`` (H, 3H), ``bias_ih``, ``bias_hh`` (3H), gates
r, z, n), which the adapter records under their field names as they are, layer kind
``gru`` from ``layer_kinds``. ``eqx.nn.GRUCell`` cannot be used: its one ``bias`` holds
``b_ir + b_hr`` / ``b_iz + b_hz`` for r and z (``bias_n`` = ``b_hn``), so PyTorch's two
free biases would load only folded (rounded) and train differently. (The adapter's
GRUCell layout is tested in tests/test_jax_equinox.py.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance import spec as S
from conformance.models_jax import _jax, _mse, _tx, attention, gelu, gru_scan, swiglu

MODELS = ("mlp", "cnn", "transformer", "gru", "llm")
"""The models written in equinox (all of them)."""
LAYER_KINDS = {"gru": "gru"}
"""The written-out GRU's layer kind (equinox's own layers are known to the adapter)."""
STATEFUL = ("cnn",)
"""Models with an ``eqx.nn.State`` (BatchNorm): built as ``(model, state)``, called as
``model(x, state) -> (y, state)``."""


def model(model_name: str, dtype: str) -> Any:
    """The equinox model ``model_name`` for one example (weights not loaded); ``(model,
    state)`` for the :data:`STATEFUL` ones."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))

    def linear(i: int, o: int, bias: bool = True) -> Any:
        return eqx.nn.Linear(i, o, use_bias=bias, dtype=dt, key=next(keys))

    def tokens(layer: Any, x: Any) -> Any:
        return jax.vmap(layer)(x)

    class MLP(eqx.Module):
        fc1: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self) -> None:
            self.fc1 = linear(S.MLP_IN, S.MLP_HIDDEN)
            self.head = linear(S.MLP_HIDDEN, S.MLP_OUT)

        def __call__(self, x: Any) -> Any:
            return self.head(jnp.tanh(self.fc1(x)))

    class Transformer(eqx.Module):
        emb: eqx.nn.Embedding
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        fc1: eqx.nn.Linear
        fc2: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self) -> None:
            self.emb = eqx.nn.Embedding(S.TF_VOCAB, S.TF_D, dtype=dt, key=next(keys))
            self.ln1 = eqx.nn.LayerNorm(S.TF_D, eps=S.LN_EPS, dtype=dt)
            # bias-free (the default), head h = features h*dh:(h+1)*dh as everywhere
            self.attn = eqx.nn.MultiheadAttention(S.TF_HEADS, S.TF_D, dtype=dt, key=next(keys))
            self.ln2 = eqx.nn.LayerNorm(S.TF_D, eps=S.LN_EPS, dtype=dt)
            self.fc1 = linear(S.TF_D, S.TF_FF)
            self.fc2 = linear(S.TF_FF, S.TF_D)
            self.head = linear(S.TF_D, S.TF_OUT)

        def __call__(self, ids: Any) -> Any:
            x = tokens(self.emb, ids)
            h = tokens(self.ln1, x)
            x = x + self.attn(h, h, h)
            h = tokens(self.ln2, x)
            x = x + tokens(self.fc2, gelu(tokens(self.fc1, h)))
            return self.head(x.mean(axis=0))

    class CNN(eqx.Module):
        conv1: eqx.nn.Conv2d
        bn1: eqx.nn.BatchNorm
        head: eqx.nn.Linear

        def __init__(self) -> None:
            self.conv1 = eqx.nn.Conv2d(S.CNN_C, S.CNN_F1, 3, padding=1, use_bias=False,
                                       dtype=dt, key=next(keys))  # fmt: skip
            # mode="batch": training batches normalised with their own (biased) statistics
            # and an EMA of them kept (Keras momentum convention), as everywhere
            self.bn1 = eqx.nn.BatchNorm(S.CNN_F1, "batch", eps=S.BN_EPS,
                                        momentum=S.BN_MOMENTUM_KERAS, mode="batch", dtype=dt)  # fmt: skip
            self.head = linear(S.CNN_F1, S.CNN_OUT)

        def __call__(self, x: Any, state: Any) -> Any:
            h = self.conv1(jnp.transpose(x, (2, 0, 1)))  # HWC -> CHW (equinox's layout)
            h, state = self.bn1(h, state)
            c, hh, ww = h.shape
            h = jax.nn.relu(h).reshape(c, hh // 2, 2, ww // 2, 2).mean(axis=(2, 4))
            return self.head(h.mean(axis=(1, 2))), state

    class GRU(eqx.Module):
        """PyTorch's GRU written out with the canonical parameters (as the Flax columns
        write it): gate order r, z, n, ``n = tanh(x W_in + b_in + r ⊙ (h W_hn + b_hn))``
        with two free biases. Plain array fields in canonical layout, so the adapter
        names them ``gru/kernel_ih`` ... as they are (no permutation); its layer kind
        comes from ``layer_kinds``. ``eqx.nn.GRUCell`` cannot be used: its single r/z
        bias holds ``b_ir + b_hr`` (module docstring)."""

        kernel_ih: jax.Array  # (in, 3H)
        kernel_hh: jax.Array  # (H, 3H)
        bias_ih: jax.Array  # (3H,)
        bias_hh: jax.Array  # (3H,)

        def __init__(self) -> None:
            z = jnp.zeros
            self.kernel_ih = z((S.GRU_IN, 3 * S.GRU_H), dt)
            self.kernel_hh = z((S.GRU_H, 3 * S.GRU_H), dt)
            self.bias_ih = z((3 * S.GRU_H,), dt)
            self.bias_hh = z((3 * S.GRU_H,), dt)

        def __call__(self, x: Any) -> Any:
            """One example's sequence (T, in) → the output sequence (T, H)."""
            return gru_scan(x[None], self.kernel_ih, self.kernel_hh, self.bias_ih,
                            self.bias_hh)[0]  # fmt: skip

    class GRUModel(eqx.Module):
        gru: GRU
        head: eqx.nn.Linear

        def __init__(self) -> None:
            self.gru = GRU()
            self.head = linear(S.GRU_H, S.GRU_OUT)

        def __call__(self, x: Any) -> Any:
            return self.head(self.gru(x)[-1])

    class CausalSelfAttention(eqx.Module):
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        o: eqx.nn.Linear

        def __init__(self) -> None:
            d = S.LLM_D
            self.q, self.k, self.v, self.o = (linear(d, d, bias=False) for _ in range(4))

        def __call__(self, x: Any) -> Any:
            q, k, v = (tokens(p, x) for p in (self.q, self.k, self.v))
            return tokens(self.o, attention(q, k, v, S.LLM_HEADS, causal=True))

    class SwiGLU(eqx.Module):
        gate: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self) -> None:
            self.gate = linear(S.LLM_D, S.LLM_FF, bias=False)
            self.up = linear(S.LLM_D, S.LLM_FF, bias=False)
            self.down = linear(S.LLM_FF, S.LLM_D, bias=False)

        def __call__(self, x: Any) -> Any:
            return tokens(self.down, swiglu(tokens(self.gate, x), tokens(self.up, x)))

    def rms_norm() -> Any:
        return eqx.nn.RMSNorm(S.LLM_D, eps=S.RMS_EPS, use_bias=False, dtype=dt)

    class LLMBlock(eqx.Module):
        embed: eqx.nn.Embedding
        attn_norm: eqx.nn.RMSNorm
        attn: CausalSelfAttention
        mlp_norm: eqx.nn.RMSNorm
        mlp: SwiGLU
        norm: eqx.nn.RMSNorm
        lm_head: eqx.nn.Linear

        def __init__(self) -> None:
            self.embed = eqx.nn.Embedding(S.LLM_VOCAB, S.LLM_D, dtype=dt, key=next(keys))
            self.attn_norm = rms_norm()
            self.attn = CausalSelfAttention()
            self.mlp_norm = rms_norm()
            self.mlp = SwiGLU()
            self.norm = rms_norm()
            self.lm_head = linear(S.LLM_D, S.LLM_VOCAB, bias=False)

        def __call__(self, ids: Any) -> Any:
            x = tokens(self.embed, ids)
            x = x + self.attn(tokens(self.attn_norm, x))
            x = x + self.mlp(tokens(self.mlp_norm, x))
            return tokens(self.lm_head, tokens(self.norm, x))

    builders = {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "gru": GRUModel,
                "llm": LLMBlock}  # fmt: skip
    if model_name not in builders:
        raise KeyError(f"{model_name!r} is not written in equinox")
    if model_name in STATEFUL:
        return eqx.nn.make_with_state(builders[model_name])()
    return builders[model_name]()


def load_state(model: Any, state: Any, weights: dict[str, np.ndarray]) -> Any:
    """``state`` with each BatchNorm's ``(hidden_mean, hidden_var)`` set to the canonical
    ``<layer>/running_mean``/``running_var`` (popped from ``weights``): equinox's
    ``mode="batch"`` EMA continued from PyTorch's running statistics."""
    import equinox as eqx
    import jax.numpy as jnp

    for name, mod in vars(model).items():
        if isinstance(mod, eqx.nn.BatchNorm):
            mean, var = state.get(mod.batch_state_index)
            m, v = weights.pop(f"{name}/running_mean"), weights.pop(f"{name}/running_var")
            if m.shape != mean.shape or v.shape != var.shape:
                raise ValueError(f"{name}: running statistics {m.shape} vs {mean.shape}")
            state = state.set(mod.batch_state_index, (jnp.asarray(m), jnp.asarray(v)))
    return state


def load(model: Any, weights: dict[str, np.ndarray]) -> Any:
    """``model`` with every array leaf replaced by the canonical tensor of its canonical
    name (the adapter's mapping inverted); strict: a missing or unknown name, or a shape
    that differs, raises."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import traintape.jax as ttj

    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, treedef = jax.tree_util.tree_flatten(params)
    leaves = ttj.named_leaves(params)
    names = {lf.name for lf in leaves}
    if names != set(weights):
        raise ValueError(f"names: missing {sorted(set(weights) - names)}, "
                         f"unknown {sorted(names - set(weights))}")  # fmt: skip
    for lf in leaves:
        w = np.asarray(weights[lf.name])
        if tuple(w.shape) != tuple(lf.shape):
            raise ValueError(f"{lf.name}: shape {w.shape} vs canonical {lf.shape}")
        if lf.permutation is not None:
            w = w.transpose(np.argsort(lf.permutation))
        elif lf.source_shape is not None:
            w = w.reshape(lf.source_shape)
        if w.shape != flat[lf.index].shape or w.dtype != flat[lf.index].dtype:
            raise ValueError(f"{lf.name}: {w.dtype}{w.shape} vs equinox "
                             f"{flat[lf.index].dtype}{flat[lf.index].shape}")  # fmt: skip
        flat[lf.index] = jnp.asarray(w)
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, flat), static)


def train(
    model_name: str, url: str, dtype: str, steps: int = S.STEPS, optimizer: str = "sgd",
    *, weights: dict[str, np.ndarray] | None = None,
) -> None:  # fmt: skip
    """Train ``model_name`` with ``traintape.jax.filter_value_and_grad`` +
    ``traintape.jax.watch(optax...)`` under ``eqx.filter_jit``, recording into ``url``.
    ``weights`` (default :func:`conformance.spec.initial_weights`) exists for the
    negative controls."""
    jax = _jax(dtype)
    import equinox as eqx

    import traintape.jax as ttj
    from conformance.policy import recorder

    w = dict(S.initial_weights(model_name, dtype) if weights is None else weights)
    built = model(model_name, dtype)
    st = None
    if model_name in STATEFUL:
        built, st = built
        st = load_state(built, st, w)
    m = load(built, w)
    x, y = S.batches(model_name, dtype)
    with recorder(url, model_name, optimizer) as rec:
        tx = ttj.watch(_tx(optimizer), rec)

        def loss(mod: Any, state: Any, xb: Any, yb: Any) -> Any:
            if state is None:
                return _mse(jax.vmap(mod)(xb), yb), None
            # the batch axis is BatchNorm's axis_name; one state for the whole batch
            out, state = jax.vmap(mod, axis_name="batch", in_axes=(0, None),
                                  out_axes=(0, None))(xb, state)  # fmt: skip
            return _mse(out, yb), state

        # the State argument is found by the adapter: BatchNorm statistics as param
        vg = ttj.filter_value_and_grad(loss, recorder=rec, has_aux=True,
                                       layer_kinds=LAYER_KINDS)  # fmt: skip

        @eqx.filter_jit
        def step(mod: Any, state: Any, o: Any, xb: Any, yb: Any) -> Any:
            (_, state), g = vg(mod, state, xb, yb)
            u, o = tx.update(g, o, eqx.filter(mod, eqx.is_inexact_array))
            return eqx.apply_updates(mod, u), state, o

        opt_state = tx.init(eqx.filter(m, eqx.is_inexact_array))
        for t in range(steps):
            m, st, opt_state = step(m, st, opt_state, x[t], y[t])
        jax.block_until_ready(eqx.filter(m, eqx.is_array))
