"""JAX adapter: BatchNorm statistics as θ_t, attention layers, layer_kinds, layer kinds of
updates, forward order, the recorder's sync hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import traintape.jax as tj
from traintape import CapturePolicy, Kind, Recorder, open_run
from traintape.core.stats import stat_vectors

X = jax.random.normal(jax.random.key(0), (8, 3))
Y = jax.random.normal(jax.random.key(1), (8, 2))


class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(4, name="fc")(x)
        h = nn.BatchNorm(use_running_average=False, momentum=0.5, name="bn")(h)
        return nn.Dense(2, name="head")(jax.nn.relu(h))


class NNXBN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.fc = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(jax.nn.relu(self.bn(self.fc(x))))


def _bn_want(history: list[dict]) -> np.ndarray:
    """Reference stats of [running_mean, running_var] per step (θ_t: before the call)."""
    return np.stack([stat_vectors([np.asarray(h["mean"]), np.asarray(h["var"])]) for h in history])


def _recorded_bn(url: str) -> np.ndarray:
    run = open_run(url)
    names = run.tensor_names(Kind.PARAM)
    idx = [names.index("bn/running_mean"), names.index("bn/running_var")]
    kinds = {s.name: s.layer_kind for s in run.manifest.specs(Kind.PARAM)}
    assert kinds["bn/running_mean"] == kinds["bn/scale"] == "batch_norm"
    assert "bn/running_mean" not in run.tensor_names(Kind.GRAD)
    return run.stats_array(Kind.PARAM)[:, idx]


def test_linen_batch_stats_recorded_as_param_before_the_update(mem_url: str) -> None:
    model = LinenBN()
    v = model.init(jax.random.key(2), X)
    params, bs = v["params"], v["batch_stats"]
    with Recorder(mem_url) as rec:

        def loss(p, st, x, y):
            out, upd = model.apply({"params": p, "batch_stats": st}, x, mutable=["batch_stats"])
            return jnp.mean((out - y) ** 2), upd["batch_stats"]

        vg = jax.jit(tj.value_and_grad(loss, has_aux=True, recorder=rec))
        history = []
        for t in range(3):
            history.append(bs["bn"])
            (_, bs), g = vg(params, bs, X + t, Y)
            params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, g)
    np.testing.assert_allclose(_recorded_bn(mem_url), _bn_want(history), rtol=1e-5, atol=1e-6)
    # the running statistics did change between steps (so θ_t vs θ_t+1 is tested)
    assert not np.allclose(history[0]["mean"], history[2]["mean"])


def test_nnx_batch_stats_recorded_as_param_before_the_update(mem_url: str) -> None:
    model = NNXBN(nnx.Rngs(0))
    with Recorder(mem_url) as rec:
        vg = tj.nnx_value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2), recorder=rec)

        @nnx.jit
        def step(m, x, y):
            return vg(m, x, y)

        history = []
        for t in range(3):
            history.append({"mean": model.bn.mean[...], "var": model.bn.var[...]})
            step(model, X + t, Y)
    np.testing.assert_allclose(_recorded_bn(mem_url), _bn_want(history), rtol=1e-5, atol=1e-6)


class Attn(nn.Module):
    """A custom attention block built from four Dense projections."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = (nn.Dense(4, use_bias=False, name=n)(x) for n in "qkv")
        w = jax.nn.softmax(q @ k.T / 2.0)
        return nn.Dense(4, use_bias=False, name="o")(w @ v)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm(name="ln")(nn.Dense(4, name="inp")(x))
        return nn.Dense(2, name="head")(Attn(name="attn")(h))


def test_layer_kinds_make_a_custom_attention_one_layer(mem_url: str) -> None:
    model = Block()
    params = model.init(jax.random.key(3), X)
    with Recorder(mem_url, CapturePolicy(kinds=["param", "grad", "update", "activation"])) as rec:
        vg = tj.value_and_grad(lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2),
                               recorder=rec, layer_kinds={"at*": "attention"})  # fmt: skip
        tx = tj.watch(optax.sgd(0.1), rec)
        opt = tx.init(params)

        @jax.jit
        def step(p, o, x, y):
            _, g = vg(p, x, y)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o

        for _ in range(2):
            params, opt = step(params, opt, X, Y)
    run = open_run(mem_url)
    assert run.tensor_names(Kind.ACTIVATION) == [
        "attn/output", "head/output", "inp/output", "ln/output"
    ]  # fmt: skip
    kinds = {(s.kind, s.name): s.layer_kind for s in run.manifest.tensors}
    assert kinds[(Kind.ACTIVATION, "attn/output")] == "attention"
    assert kinds[(Kind.PARAM, "attn/q/kernel")] == "dense"
    # update specs (declared by watch, which knows no modules) take the layer's kind
    assert kinds[(Kind.UPDATE, "ln/scale")] == "layer_norm"
    assert kinds[(Kind.UPDATE, "attn/o/kernel")] == "dense"
    # Linen reports layers in the order they ran
    assert run.manifest.forward_order == ["inp", "ln", "attn", "head"]


def test_layer_kinds_rejects_an_unknown_kind(mem_url: str) -> None:
    with Recorder(mem_url) as rec, pytest.raises(ValueError, match=r"layer_kinds\['attn'\]"):
        tj.value_and_grad(lambda p: p, recorder=rec, layer_kinds={"attn": "transformerish"})


def test_nnx_attention_and_gru_layer_kinds(mem_url: str) -> None:
    class Cell(nnx.Module):
        def __init__(self) -> None:
            self.kernel_ih = nnx.Param(jnp.ones((3, 6)) * 0.1)
            self.kernel_hh = nnx.Param(jnp.ones((2, 6)) * 0.1)

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(x @ self.kernel_ih[...])[:, :2]

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.rnn = Cell()
            self.head = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.head(self.rnn(x))

    model = Net(nnx.Rngs(0))
    with Recorder(mem_url) as rec:
        vg = tj.nnx_value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2), recorder=rec,
                                   layer_kinds={"rnn": "gru"})  # fmt: skip
        nnx.jit(vg)(model, X, Y)
    run = open_run(mem_url)
    kinds = {(s.kind, s.name): s.layer_kind for s in run.manifest.tensors}
    assert kinds[(Kind.PARAM, "rnn/kernel_ih")] == "gru"
    assert kinds[(Kind.ACTIVATION, "rnn/output")] == "gru"
    assert run.manifest.forward_order is None  # NNX cannot know the call order


def test_sync_hook_failure_is_raised_after_close_commits(mem_url: str) -> None:
    rec = Recorder(mem_url)
    rec.log(0, loss=1.0)
    calls: list[bool] = []

    def hook(closing: bool) -> None:
        calls.append(closing)
        if closing:
            raise RuntimeError("device callbacks lost")

    rec.add_sync_hook(hook)
    rec.flush()
    with pytest.raises(RuntimeError, match="device callbacks lost"):
        rec.close()
    assert calls == [False, True]
    run = open_run(mem_url)
    assert run.manifest.status == "closed" and run.steps.tolist() == [0]


class LinenMHA(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, name="attn")(x, x)
        return nn.Dense(2, name="head")(h.mean(axis=1))


def test_flax_attention_gets_canonical_q_k_v_o_layout(mem_url: str) -> None:
    model = LinenMHA()
    x = jax.random.normal(jax.random.key(4), (3, 5, 6))
    y = jnp.zeros((3, 2))
    params = model.init(jax.random.key(5), x)
    pol = CapturePolicy(kinds=tuple(Kind), snapshot_kinds=tuple(Kind), full_every=1)
    with Recorder(mem_url, pol) as rec:
        vg = tj.value_and_grad(lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2),
                               recorder=rec)  # fmt: skip
        tx = tj.watch(optax.adam(1e-2), rec, opt_state=True)
        opt = tx.init(params)

        @jax.jit
        def step(p, o):
            _, g = vg(p, x, y)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o

        step(params, opt)
    run = open_run(mem_url)
    spec = run.spec("attn/q/kernel", Kind.PARAM)
    assert spec.shape == [6, 4] and spec.source_shape == [6, 2, 2] and spec.layer_kind == "dense"
    assert run.spec("attn/o/kernel", Kind.PARAM).shape == [4, 6]
    assert run.spec("attn/v/bias", Kind.GRAD).shape == [4]
    assert run.spec("attn/o/kernel", Kind.UPDATE).shape == [4, 6]
    assert "attn/q/kernel/mu" in run.tensor_names(Kind.OPT_STATE)
    flax_q = params["params"]["attn"]["query"]["kernel"]
    np.testing.assert_array_equal(
        run.snapshot("attn/q/kernel", Kind.PARAM, 0), np.asarray(flax_q).reshape(6, 4)
    )
    acts = run.tensor_names(Kind.ACTIVATION)
    assert "attn/output" in acts and not any(a.startswith("attn/") and a != "attn/output"
                                             for a in acts)  # fmt: skip
    assert run.spec("attn/output", Kind.ACTIVATION).layer_kind == "attention"
    mu = run.snapshot("attn/k/kernel/mu", Kind.OPT_STATE, 0)
    assert mu.shape == (6, 4) and np.all(np.isfinite(mu))


def test_nnx_activation_snapshots_use_the_probe_batch_on_a_copy(mem_url: str) -> None:
    """NNX probe: snapshots on full-capture steps are the layer outputs for the probe batch
    under θ_t; the probe's forward pass (BatchNorm in training mode) leaves the trained
    module exactly as plain ``nnx.value_and_grad`` training leaves it."""

    def loss(m: NNXBN, x: jax.Array) -> jax.Array:
        return jnp.mean(m(x) ** 2)

    xs = np.random.default_rng(0).normal(size=(3, 8, 3)).astype(np.float32)
    probe = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3)).astype(np.float32))

    def train(m: NNXBN, vg: Callable[..., Any]) -> list[np.ndarray]:
        @nnx.jit
        def step(m: NNXBN, x: jax.Array) -> None:
            _, g = vg(m, x)
            params = nnx.state(m, nnx.Param)
            nnx.update(m, jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g))

        fc_probe = []  # fc output for the probe under θ_t
        for t in range(3):
            fc_probe.append(np.asarray(m.fc(probe)))
            step(m, jnp.asarray(xs[t]))
        return fc_probe

    plain = NNXBN(nnx.Rngs(0))
    want = train(plain, nnx.value_and_grad(loss))
    model = NNXBN(nnx.Rngs(0))
    with Recorder(mem_url, CapturePolicy(full_every=2)) as rec:
        train(model, tj.nnx_value_and_grad(loss, recorder=rec, probe={1: probe}))
    # the probe changed nothing in the trained module (params and BatchNorm statistics)
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(plain)),
                    jax.tree_util.tree_leaves(nnx.state(model)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    run = open_run(mem_url)
    assert list(run.snapshot_steps("fc/output", Kind.ACTIVATION)) == [0, 2]
    assert run.spec("fc/output", Kind.ACTIVATION).snapshot_shape == [2, 4]
    for t in (0, 2):
        np.testing.assert_allclose(
            run.snapshot("fc/output", Kind.ACTIVATION, t), want[t], rtol=1e-5, atol=1e-6
        )
