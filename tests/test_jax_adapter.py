"""JAX adapter: recorded values against jax.grad / optax, step accounting, names, NaN."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict

import traintape
import traintape.jax as tj
from traintape import CapturePolicy, Kind, Recorder, open_run
from traintape.core.stats import stat_vectors
from traintape.schema.stats import activation_map

jax.config.update("jax_default_matmul_precision", "highest")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(2):
            x = nn.relu(nn.Dense(6, name=f"layers_{i}")(x))
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(1, name="head")(x)


def _data(n: int = 5, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (n, 3)), jax.random.normal(k2, (n, 1))


def _ref_stats(tree, names_of) -> np.ndarray:
    """numpy reference stats of ``tree``'s leaves in canonical (sorted name) order."""
    leaves = sorted(tj.named_leaves(tree), key=lambda lf: lf.name)
    flat = jax.tree_util.tree_leaves(tree)
    assert [lf.name for lf in leaves] == names_of
    return stat_vectors([np.asarray(flat[lf.index]) for lf in leaves])


def _train(url: str, *, jit: bool, steps: int = 4, policy: CapturePolicy | None = None):
    model = MLP()
    x, _ = _data()
    params = model.init(jax.random.key(1), x)
    rec = Recorder(url, policy or CapturePolicy(full_every=2))

    def loss(p, x, y):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    vg = tj.value_and_grad(loss, recorder=rec)
    tx = tj.watch(optax.sgd(0.1, momentum=0.9), rec)
    opt = tx.init(params)

    def step(p, o, x, y):
        loss_v, g = vg(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss_v, g

    if jit:
        step = jax.jit(step)
    history = [params]
    grads = []
    for t in range(steps):
        xb, yb = _data(seed=t + 10)
        params, opt, _, g = step(params, opt, xb, yb)
        history.append(params)
        grads.append(g)
    rec.close()
    return history, grads


@pytest.fixture(params=["xla", "kernel"])
def stats_mode(request, monkeypatch) -> str:
    """Run a test with both in-computation stat paths: XLA reductions and the FFI kernel."""
    monkeypatch.setenv("TRAINTAPE_JAX_STATS", request.param)
    return request.param


def test_recorded_grads_and_params_match_jax(mem_url: str, stats_mode: str) -> None:
    history, _ = _train(mem_url, jit=True)
    run = open_run(mem_url)
    assert list(run.steps) == [0, 1, 2, 3]
    names = run.tensor_names(Kind.GRAD)
    assert names == run.tensor_names(Kind.PARAM)
    g_stats, p_stats = run.stats_array(Kind.GRAD), run.stats_array(Kind.PARAM)
    model = MLP()
    for t in range(4):
        xb, yb = _data(seed=t + 10)
        ref_g = jax.grad(lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2))(history[t], xb, yb)
        np.testing.assert_allclose(g_stats[t], _ref_stats(ref_g, names), rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(p_stats[t], _ref_stats(history[t], names), rtol=2e-4, atol=1e-6)
        if t % 2 == 0:  # full-capture step: whole tensors
            snap = run.snapshot("layers/0/kernel", Kind.GRAD, t)
            np.testing.assert_allclose(snap, ref_g["params"]["layers_0"]["kernel"], rtol=1e-5)
            np.testing.assert_array_equal(
                run.snapshot("head/bias", Kind.PARAM, t), history[t]["params"]["head"]["bias"]
            )
    assert list(run.snapshot_steps("norm/scale", Kind.GRAD)) == [0, 2]
    assert traintape.validate(mem_url).ok


def test_recorded_updates_equal_parameter_change(mem_url: str) -> None:
    history, _ = _train(mem_url, jit=True)
    run = open_run(mem_url)
    names = run.tensor_names(Kind.UPDATE)
    u_stats = run.stats_array(Kind.UPDATE)
    for t in range(4):
        delta = jax.tree_util.tree_map(lambda a, b: b - a, history[t], history[t + 1])
        np.testing.assert_allclose(u_stats[t], _ref_stats(delta, names), rtol=1e-3, atol=1e-6)
    for t in (0, 2):
        delta = (
            history[t + 1]["params"]["layers_1"]["kernel"]
            - history[t]["params"]["layers_1"]["kernel"]
        )
        np.testing.assert_allclose(
            run.snapshot("layers/1/kernel", Kind.UPDATE, t), delta, rtol=1e-5, atol=1e-7
        )


def _train_plain(url: str, *, jit: bool, steps: int = 3) -> None:
    """A plain-pytree model (eager mode is slow for Flax: op-by-op dispatch)."""
    params = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "bias": jnp.zeros(4)}}
    rec = Recorder(url, CapturePolicy(full_every=2))

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"]) - y) ** 2)

    vg = tj.value_and_grad(loss, recorder=rec)
    tx = tj.watch(optax.adam(0.1), rec)
    opt = tx.init(params)

    def step(p, o, x, y):
        _, g = vg(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    if jit:
        step = jax.jit(step)
    for t in range(steps):
        x, _ = _data(seed=t)
        params, opt = step(params, opt, x, jnp.sin(x[:, :1]) * jnp.ones(4))
    rec.close()


def test_jit_and_eager_runs_give_equal_stores(mem_url: str) -> None:
    _train_plain(mem_url, jit=True)
    _train_plain(mem_url + "-eager", jit=False)
    a, b = open_run(mem_url), open_run(mem_url + "-eager")
    assert list(a.steps) == list(b.steps) == [0, 1, 2]
    assert [s.model_dump() for s in a.manifest.tensors] == [
        s.model_dump() for s in b.manifest.tensors
    ]
    for kind in (Kind.PARAM, Kind.GRAD, Kind.UPDATE):
        np.testing.assert_allclose(a.stats_array(kind), b.stats_array(kind), rtol=1e-5, atol=1e-6)
        for name in a.tensor_names(kind):
            np.testing.assert_allclose(
                a.snapshot(name, kind, 2), b.snapshot(name, kind, 2), rtol=1e-5, atol=1e-7
            )


@pytest.mark.parametrize("has_aux", [False, True])
def test_returns_exactly_what_jax_returns(mem_url: str, has_aux: bool) -> None:
    @dataclasses.dataclass
    class Box:
        w: jax.Array
        b: jax.Array

    jax.tree_util.register_dataclass(Box, data_fields=["w", "b"], meta_fields=[])
    params = {
        "frozen": FrozenDict({"kernel": jnp.arange(6.0).reshape(2, 3)}),
        "seq": [jnp.ones(3), (jnp.full((2,), 2.0),)],
        "box": Box(jnp.ones((3,)), jnp.zeros(())),
    }

    def f(p, x):
        v = jnp.sum(p["frozen"]["kernel"] @ x) + jnp.sum(p["seq"][0] * x) + p["seq"][1][0].sum()
        v = v + jnp.sum(p["box"].w * x) ** 2 + p["box"].b
        return (v, {"x2": x * 2}) if has_aux else v

    x = jnp.array([1.0, -2.0, 0.5])
    with Recorder(mem_url) as rec:
        got = jax.jit(tj.value_and_grad(f, has_aux=has_aux, recorder=rec))(params, x)
    want = jax.jit(jax.value_and_grad(f, has_aux=has_aux))(params, x)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert open_run(mem_url).tensor_names(Kind.GRAD) == [
        "box/b", "box/w", "frozen/kernel", "seq/0", "seq/1/0"
    ]  # fmt: skip


def test_multiple_argnums_prefix_the_argument_position(mem_url: str) -> None:
    def f(a, b):
        return jnp.sum(a["w"] * b["w"])

    with Recorder(mem_url) as rec:
        _, (ga, gb) = tj.value_and_grad(f, argnums=(0, 1), recorder=rec)(
            {"w": jnp.ones(2)}, {"w": jnp.full(2, 3.0)}
        )
    run = open_run(mem_url)
    assert run.tensor_names(Kind.GRAD) == ["0/w", "1/w"]
    np.testing.assert_allclose(run.stats_array(Kind.GRAD)[0, :, 0], [3.0, 1.0])
    np.testing.assert_array_equal(ga["w"], np.full(2, 3.0))
    np.testing.assert_array_equal(gb["w"], np.ones(2))


def test_nan_leaf_is_counted_not_fatal(mem_url: str, stats_mode: str) -> None:
    def f(p):
        return jnp.sum(p["a"] * jnp.array([1.0, jnp.nan, 2.0])) + jnp.sum(p["b"] ** 2)

    params = {"a": jnp.array([1.0, 2.0, 3.0]), "b": jnp.array([1.0, jnp.inf])}
    with Recorder(mem_url) as rec:
        step = jax.jit(tj.value_and_grad(f, recorder=rec))
        for _ in range(2):
            v, _g = step(params)
    assert np.isnan(v)
    run = open_run(mem_url)
    g = run.stats(Kind.GRAD).set_index(["step", "tensor"])
    assert g.loc[(0, "a"), "nan_count"] == 1
    np.testing.assert_allclose(g.loc[(0, "a"), "mean"], 1.5)  # finite elements 1 and 2
    p = run.stats(Kind.PARAM).set_index(["step", "tensor"])
    assert p.loc[(1, "b"), "inf_count"] == 1 and p.loc[(1, "b"), "max"] == 1.0
    types = {(e.type, e.tensor) for e in run.manifest.events}
    assert ("nan", "a") in types and ("inf", "b") in types
    assert traintape.validate(mem_url).ok


def test_explicit_step_and_every(mem_url: str, stats_mode: str) -> None:
    def f(p, x):
        return jnp.sum(p["w"] * x)

    with Recorder(mem_url, CapturePolicy(every=2, full_every=4)) as rec:
        vg = jax.jit(tj.value_and_grad(f, recorder=rec, step_kwarg="step"))
        for t in range(10, 18):
            vg({"w": jnp.full(3, float(t))}, jnp.ones(3), step=jnp.int32(t))
    run = open_run(mem_url)
    assert list(run.steps) == [10, 12, 14, 16]
    np.testing.assert_allclose(run.stats_array(Kind.PARAM)[:, 0, 0], [10, 12, 14, 16])
    assert list(run.snapshot_steps("w", Kind.PARAM)) == [12, 16]
    np.testing.assert_array_equal(run.snapshot("w", Kind.PARAM, 16), np.full(3, 16.0))


def test_inside_scan_every_iteration_is_a_step(mem_url: str, stats_mode: str) -> None:
    def f(p, x):
        return jnp.sum((p["w"] * x) ** 2)

    with Recorder(mem_url, CapturePolicy(full_every=2)) as rec:
        vg = tj.value_and_grad(f, recorder=rec)

        def body(p, x):
            _, g = vg(p, x)
            return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), p["w"]

        xs = jnp.arange(1.0, 7.0).reshape(6, 1) * jnp.ones((6, 2))
        _, ws = jax.jit(lambda p: jax.lax.scan(body, p, xs))({"w": jnp.array([1.0, -1.0])})
    run = open_run(mem_url)
    assert list(run.steps) == list(range(6))
    np.testing.assert_allclose(run.stats_array(Kind.PARAM)[:, 0, 0], np.mean(ws, axis=1), atol=1e-6)
    for t in (0, 2, 4):
        np.testing.assert_allclose(run.snapshot("w", Kind.PARAM, t), ws[t], rtol=1e-6)
        np.testing.assert_allclose(
            run.snapshot("w", Kind.GRAD, t), 2 * ws[t] * xs[t] ** 2, rtol=1e-5
        )


def test_gradient_accumulation_records_accumulated_grad(mem_url: str) -> None:
    k = 3
    params = {"w": jnp.array([1.0, 2.0])}
    xs = jnp.arange(1.0, 13.0).reshape(6, 2)

    def loss(p, x):
        return jnp.sum(p["w"] * x) ** 2

    with Recorder(mem_url, CapturePolicy(full_every=1)) as rec:
        tx = tj.watch(optax.sgd(0.01), rec, kinds=("param", "grad", "update"), accumulate=k)
        opt = tx.init(params)

        @jax.jit
        def micro(p, o, x):
            g = jax.grad(loss)(p, x)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o, g

        hist, micro_grads = [params], []
        for i in range(6):
            params, opt, g = micro(params, opt, xs[i])
            micro_grads.append(g["w"])
            hist.append(params)
    run = open_run(mem_url)
    assert list(run.steps) == [0, 1]
    for t in range(2):
        acc = np.mean(micro_grads[t * k : (t + 1) * k], axis=0)
        np.testing.assert_allclose(run.snapshot("w", Kind.GRAD, t), acc, rtol=1e-6)
        np.testing.assert_allclose(run.snapshot("w", Kind.PARAM, t), hist[t * k]["w"])
        np.testing.assert_array_equal(hist[t * k + 1]["w"], hist[t * k]["w"])
        np.testing.assert_allclose(
            run.snapshot("w", Kind.UPDATE, t), hist[(t + 1) * k]["w"] - hist[t * k]["w"], rtol=1e-5
        )


def test_opt_state_adam_moments_named_by_parameter(mem_url: str) -> None:
    params = {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    pol = CapturePolicy(kinds=tuple(Kind), snapshot_kinds=tuple(Kind), full_every=1)
    with Recorder(mem_url, pol) as rec:
        tx = tj.watch(optax.adam(0.1), rec, opt_state=True)
        opt = tx.init(params)
        g = {"dense": {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full(3, -1.0)}}
        _, opt = jax.jit(tx.update)(g, opt, params)
    run = open_run(mem_url)
    assert run.tensor_names(Kind.OPT_STATE) == [
        "dense/bias/mu", "dense/bias/nu", "dense/kernel/mu", "dense/kernel/nu"
    ]  # fmt: skip
    mu = opt.inner[0].mu["dense"]["kernel"]
    np.testing.assert_allclose(run.snapshot("dense/kernel/mu", Kind.OPT_STATE, 0), mu)
    np.testing.assert_allclose(run.snapshot("dense/bias/nu", Kind.OPT_STATE, 0), np.full(3, 1e-3))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = nn.Embed(11, 4, name="embed")(tokens)  # (B, T, 4)
        h = nn.Conv(5, (3,), name="conv")(h)
        h = nn.LayerNorm(name="norm")(h)
        for i in range(2):
            h = nn.Dense(4, name=f"layers_{i}")(h)
        return h.mean()


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(11, 4, rngs=rngs)
        self.conv = nnx.Conv(4, 5, (3,), rngs=rngs)
        self.norm = nnx.LayerNorm(5, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(5, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.norm(self.conv(self.embed(tokens)))
        for layer in self.layers:
            h = layer(h)
        return h.mean()


TOKENS = jnp.array([[1, 2, 3, 4], [5, 6, 7, 0]])


def test_linen_activations_recorded_with_correct_stats(mem_url: str) -> None:
    net = LinenNet()
    params = net.init(jax.random.key(0), TOKENS)
    with Recorder(mem_url) as rec:
        jax.jit(tj.value_and_grad(lambda p, t: net.apply(p, t), recorder=rec))(params, TOKENS)
    run = open_run(mem_url)
    names = run.tensor_names(Kind.ACTIVATION)
    assert names == ["conv/output", "embed/output", "layers/0/output", "layers/1/output",
                     "norm/output"]  # fmt: skip
    kinds = {s.name: s.layer_kind for s in run.manifest.tensors if s.kind == Kind.ACTIVATION}
    assert kinds["conv/output"] == "conv" and kinds["embed/output"] == "embedding"
    assert kinds["norm/output"] == "layer_norm" and kinds["layers/0/output"] == "dense"
    assert run.spec("conv/output", Kind.ACTIVATION).shape == [None, 4, 5]
    _, inter = net.apply(params, TOKENS, capture_intermediates=True, mutable=["intermediates"])
    inter = inter["intermediates"]
    acts = [np.asarray(inter[k]["__call__"][0]) for k in
            ("conv", "embed", "layers_0", "layers_1", "norm")]  # fmt: skip
    ref = stat_vectors(acts, maps=[activation_map(a.shape) for a in acts])  # batch axis free
    np.testing.assert_allclose(run.stats_array(Kind.ACTIVATION)[0], ref, rtol=2e-4, atol=1e-6)


def test_linen_and_nnx_models_get_the_same_canonical_names(mem_url: str) -> None:
    net = LinenNet()
    params = net.init(jax.random.key(0), TOKENS)
    with Recorder(mem_url) as rec:
        jax.jit(tj.value_and_grad(lambda p, t: net.apply(p, t), recorder=rec))(params, TOKENS)
    model = NNXNet(nnx.Rngs(0))
    with Recorder(mem_url + "-nnx") as rec:
        vg = tj.nnx_value_and_grad(lambda m, t: m(t), recorder=rec)
        loss, grads = nnx.jit(vg)(model, TOKENS)
    want_loss, want_grads = nnx.value_and_grad(lambda m, t: m(t))(model, TOKENS)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert type(grads) is type(want_grads)
    a, b = open_run(mem_url), open_run(mem_url + "-nnx")
    for kind in (Kind.PARAM, Kind.GRAD, Kind.ACTIVATION):
        assert a.tensor_names(kind) == b.tensor_names(kind), kind
        assert [(s.shape, s.layer_kind) for s in a.manifest.specs(kind)] == [
            (s.shape, s.layer_kind) for s in b.manifest.specs(kind)
        ]
    names = b.tensor_names(Kind.GRAD)
    flat = {"/".join(str(k.key) for k in p[:-1]): v
            for p, v in jax.tree_util.tree_flatten_with_path(want_grads)[0]}  # fmt: skip
    ref = stat_vectors([np.asarray(flat[n]) for n in names])
    np.testing.assert_allclose(b.stats_array(Kind.GRAD)[0], ref, rtol=2e-4, atol=1e-6)


def test_names_collections_roles_and_name_map() -> None:
    tree = {
        "params": {
            "layers_0": {"kernel": jnp.ones((2, 2))},
            "emb": {"embeddings": jnp.ones((3, 2))},
        },
        "batch_stats": {"bn": {"mean": jnp.ones(2), "var": jnp.ones(2)}},
    }
    names = sorted(lf.name for lf in tj.named_leaves(tree))
    assert names == ["bn/running_mean", "bn/running_var", "emb/embedding", "layers/0/kernel"]
    mapped = tj.named_leaves(tree, {"layers/0/kernel": "first/kernel"})
    assert "first/kernel" in {lf.name for lf in mapped}
    upper = tj.named_leaves(tree, lambda n: n.replace("emb/", "tok_emb/"))
    assert "tok_emb/embedding" in {lf.name for lf in upper}
    with pytest.raises(traintape.RecordError, match="both map"):
        tj.named_leaves({"a": {"kernel": jnp.ones(1)}, "params": {"a": {"kernel": jnp.ones(1)}}})


def test_activation_snapshots_use_the_fixed_probe_batch(mem_url: str) -> None:
    net = LinenNet()
    params = net.init(jax.random.key(0), TOKENS)
    probe = jnp.array([[3, 3, 1, 2]])
    with Recorder(mem_url, CapturePolicy(full_every=2)) as rec:
        vg = jax.jit(
            tj.value_and_grad(lambda p, t: net.apply(p, t), recorder=rec, probe={1: probe})
        )
        history = []
        for t in range(3):
            history.append(params)
            _, g = vg(params, (TOKENS + t) % 11)
            params = jax.tree_util.tree_map(lambda a, b: a - 0.5 * b, params, g)
    run = open_run(mem_url)
    assert list(run.snapshot_steps("conv/output", Kind.ACTIVATION)) == [0, 2]
    assert run.spec("conv/output", Kind.ACTIVATION).snapshot_shape == [1, 4, 5]
    for t in (0, 2):
        _, inter = net.apply(
            history[t], probe, capture_intermediates=True, mutable=["intermediates"]
        )
        np.testing.assert_allclose(
            run.snapshot("layers/1/output", Kind.ACTIVATION, t),
            inter["intermediates"]["layers_1"]["__call__"][0],
            rtol=1e-5,
            atol=1e-6,
        )
    # stats are over the training batch, not the probe
    _, inter = net.apply(history[1], (TOKENS + 1) % 11, capture_intermediates=True,
                         mutable=["intermediates"])  # fmt: skip
    emb = np.asarray(inter["intermediates"]["embed"]["__call__"][0])
    ref = stat_vectors([emb], maps=[activation_map(emb.shape)])[0]
    row = run.stats(Kind.ACTIVATION).set_index(["step", "tensor"]).loc[(1, "embed/output")]
    np.testing.assert_allclose(row.to_numpy(dtype=float), ref, rtol=1e-4, atol=1e-6)


def test_a_failed_record_is_raised_by_close_not_inside_the_step(mem_url: str) -> None:
    rec = Recorder(mem_url)
    vg = jax.jit(tj.value_and_grad(lambda p: jnp.sum(p**2), recorder=rec, step_kwarg="step"))
    vg(jnp.ones(2), step=5)
    with pytest.warns(RuntimeWarning, match="recording into"):
        v, g = vg(jnp.ones(2), step=3)  # steps must not go backwards: training goes on
        jax.block_until_ready((v, g))
        jax.effects_barrier()
    np.testing.assert_array_equal(g, [2.0, 2.0])
    with pytest.raises(traintape.RecordError, match="step 3"):
        rec.close()
    assert list(open_run(mem_url).steps) == [5]
    assert open_run(mem_url).tensor_names(Kind.GRAD) == ["arg0"]  # a bare array argument


def test_strict_recorder_fails_the_step_itself(mem_url: str) -> None:
    """``Recorder(strict=True)``: a failed record raises out of the jitted call."""
    rec = Recorder(mem_url, strict=True)
    vg = jax.jit(tj.value_and_grad(lambda p: jnp.sum(p**2), recorder=rec, step_kwarg="step"))
    vg(jnp.ones(2), step=5)
    with pytest.raises(Exception, match="step 3"):
        jax.block_until_ready(vg(jnp.ones(2), step=3))
        jax.effects_barrier()
    rec.close()
    assert list(open_run(mem_url).steps) == [5]
