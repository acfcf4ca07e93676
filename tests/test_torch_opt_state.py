"""traintape.torch.watch: optimizer state (kind ``opt_state``) named as the JAX adapter."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import traintape  # noqa: E402
from traintape import CapturePolicy, Kind, Recorder  # noqa: E402
from traintape.adapters.torch.opt_state import opt_state_field  # noqa: E402
from traintape.core.stats import stat_vectors  # noqa: E402
from traintape.torch import watch  # noqa: E402

torch.set_num_threads(1)

ALL = CapturePolicy(kinds=tuple(Kind), snapshot_kinds=tuple(Kind), full_every=1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.dense = nn.Linear(4, 2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x, seq):
        h = self.conv(x).mean()
        a, _ = self.attn(seq, seq, seq)
        return self.frozen(self.dense(a).mean(1)) + h


def inputs(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 2, 5, generator=g), torch.randn(3, 6, 4, generator=g)


def train(url, make_opt, steps=2, policy=ALL):
    torch.manual_seed(0)
    model = Net()
    opt = make_opt(model)
    states = []
    with Recorder(url, policy) as rec, watch(model, rec, optimizer=opt):
        for i in range(steps):
            opt.zero_grad()
            model(*inputs(i)).pow(2).sum().backward()
            opt.step()
            states.append(
                {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
            )
    return model, opt, states


def test_adam_moments_named_and_permuted_like_the_parameter(mem_url):
    model, _, states = train(mem_url, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    run = traintape.open_run(mem_url)
    names = run.tensor_names(Kind.OPT_STATE)
    params = run.tensor_names(Kind.GRAD)
    assert names == sorted(f"{p}/{f}" for p in params for f in ("mu", "nu"))
    assert not any(n.startswith("frozen/kernel") for n in names)  # no grad, no state
    assert "frozen/bias/mu" in names
    # conv: (O, I, K) -> (K, I, O), the parameter's permutation
    spec = run.spec("conv/kernel/mu", Kind.OPT_STATE)
    assert spec.permutation == [2, 1, 0] and spec.shape == [3, 2, 3]
    assert (spec.role, spec.layer, spec.layer_kind) == ("mu", "conv/kernel", None)
    assert spec.source_name == "conv.weight:exp_avg"
    for t in range(2):
        st = states[t][id(model.conv.weight)]
        np.testing.assert_array_equal(
            run.snapshot("conv/kernel/mu", Kind.OPT_STATE, t), st["exp_avg"].permute(2, 1, 0)
        )
        np.testing.assert_array_equal(
            run.snapshot("conv/kernel/nu", Kind.OPT_STATE, t), st["exp_avg_sq"].permute(2, 1, 0)
        )
    # MultiheadAttention: the q/k/v row blocks of in_proj_weight's state, transposed
    st = states[1][id(model.attn.in_proj_weight)]["exp_avg_sq"]
    np.testing.assert_array_equal(run.snapshot("attn/k/kernel/nu", Kind.OPT_STATE, 1), st[4:8].T)
    spec = run.spec("attn/k/kernel/nu", Kind.OPT_STATE)
    assert spec.source_name == "attn.in_proj_weight[4:8]:exp_avg_sq"
    i = names.index("dense/kernel/nu")
    want = states[1][id(model.dense.weight)]["exp_avg_sq"].T.numpy()
    np.testing.assert_allclose(
        run.stats_array(Kind.OPT_STATE)[1, i], stat_vectors([want])[0], rtol=2e-5, atol=1e-12
    )
    assert traintape.validate(mem_url).ok


def test_sgd_momentum_buffer_is_trace_and_state_is_not_touched(mem_url):
    model, opt, states = train(
        mem_url, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    )
    run = traintape.open_run(mem_url)
    assert "dense/kernel/trace" in run.tensor_names(Kind.OPT_STATE)
    np.testing.assert_array_equal(
        run.snapshot("dense/bias/trace", Kind.OPT_STATE, 1),
        states[1][id(model.dense.bias)]["momentum_buffer"],
    )
    # reading state never creates entries in the optimizer's defaultdict
    assert model.frozen.weight not in opt.state


def test_no_opt_state_unless_the_policy_asks_or_the_optimizer_has_any(mem_url):
    train(mem_url + "-a", lambda m: torch.optim.Adam(m.parameters()), policy=CapturePolicy())
    assert traintape.open_run(mem_url + "-a").tensor_names(Kind.OPT_STATE) == []
    train(mem_url + "-b", lambda m: torch.optim.SGD(m.parameters(), lr=0.1))  # no momentum
    run = traintape.open_run(mem_url + "-b")
    assert run.tensor_names(Kind.OPT_STATE) == [] and list(run.steps) == [0, 1]


def test_field_names_follow_optax():
    p = [nn.Parameter(torch.ones(2))]
    assert opt_state_field(torch.optim.AdamW(p), "exp_avg_sq") == "nu"
    assert opt_state_field(torch.optim.Adam(p, amsgrad=True), "max_exp_avg_sq") == "nu_max"
    assert opt_state_field(torch.optim.RMSprop(p), "square_avg") == "nu"
    assert opt_state_field(torch.optim.Adadelta(p), "square_avg") == "e_g"
    assert opt_state_field(torch.optim.Adagrad(p), "sum") == "sum_of_squares"
    assert opt_state_field(torch.optim.Rprop(p), "prev") == "prev"  # unknown: torch's key


def test_same_opt_state_store_as_the_jax_adapter(tmp_path):
    """Adam on one dense layer: torch and optax stores name, shape and value the
    moments identically."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jnp = jax.numpy
    import traintape.jax as tj

    kinds = (Kind.UPDATE, Kind.OPT_STATE)
    pol = CapturePolicy(kinds=kinds, snapshot_kinds=kinds, full_every=1)
    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=2).astype(np.float32)
    gw, gb = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=2).astype(np.float32)

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(3, 2)

    model = Dense()
    with torch.no_grad():
        model.dense.weight.copy_(torch.from_numpy(w.T))
        model.dense.bias.copy_(torch.from_numpy(b))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with Recorder(str(tmp_path / "torch"), pol) as rec, watch(model, rec, optimizer=opt):
        model.dense.weight.grad = torch.from_numpy(gw.T.copy())
        model.dense.bias.grad = torch.from_numpy(gb)
        opt.step()
    params = {"dense": {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}}
    with Recorder(str(tmp_path / "jax"), pol) as rec:
        tx = tj.watch(optax.adam(0.1), rec, opt_state=True)
        state = tx.init(params)
        grads = {"dense": {"kernel": jnp.asarray(gw), "bias": jnp.asarray(gb)}}
        tx.update(grads, state, params)
    rt, rj = traintape.open_run(str(tmp_path / "torch")), traintape.open_run(str(tmp_path / "jax"))
    names = rj.tensor_names(Kind.OPT_STATE)
    assert names == rt.tensor_names(Kind.OPT_STATE) == [
        "dense/bias/mu", "dense/bias/nu", "dense/kernel/mu", "dense/kernel/nu"
    ]  # fmt: skip
    for n in names:
        st, sj = rt.spec(n, Kind.OPT_STATE), rj.spec(n, Kind.OPT_STATE)
        for f in ("shape", "dtype", "role", "layer", "layer_kind"):
            assert getattr(st, f) == getattr(sj, f), (n, f)
        np.testing.assert_allclose(
            rt.snapshot(n, Kind.OPT_STATE, 0), rj.snapshot(n, Kind.OPT_STATE, 0), rtol=1e-6
        )
    np.testing.assert_allclose(
        rt.stats_array(Kind.OPT_STATE), rj.stats_array(Kind.OPT_STATE), rtol=1e-5, atol=1e-12
    )
