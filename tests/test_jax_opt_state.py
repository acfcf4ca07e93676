"""JAX optimizer state (kind opt_state) through traintape.jax.watch, against optax's own
state, and named as the torch adapter names the same optimizers' state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import traintape
import traintape.jax as tj


def _params() -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "fc": {"kernel": jax.random.normal(k1, (3, 4)), "bias": jnp.zeros(4)},
        "out": {"kernel": jax.random.normal(k2, (4, 2))},
    }


def _loss(p: dict, x: jax.Array) -> jax.Array:
    return jnp.sum((jnp.tanh(x @ p["fc"]["kernel"] + p["fc"]["bias"]) @ p["out"]["kernel"]) ** 2)


def _train(tx: optax.GradientTransformation, steps: int = 3) -> list:
    """Plain optax: the inner states after each step (what the store must hold)."""
    p, s = _params(), tx.init(_params())
    states = []
    for t in range(steps):
        g = jax.grad(_loss)(p, jnp.full((5, 3), 0.1 * (t + 1)))
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        states.append(s)
    return states


@pytest.mark.parametrize(
    ("make", "fields"),
    [
        (lambda: optax.adam(0.1), {"mu": lambda s: s[0].mu, "nu": lambda s: s[0].nu}),
        (
            lambda: optax.adamw(0.1, weight_decay=0.01),
            {"mu": lambda s: s[0].mu, "nu": lambda s: s[0].nu},
        ),
        (lambda: optax.sgd(0.1, momentum=0.9), {"trace": lambda s: s[0].trace}),
    ],
    ids=["adam", "adamw", "sgd-momentum"],
)
def test_opt_state_equals_optax_state(tmp_path, make, fields) -> None:
    url = str(tmp_path / "run")
    pol = traintape.CapturePolicy(kinds=("update", "opt_state"), full_every=1,
                                  snapshot_kinds=("opt_state",))  # fmt: skip
    with traintape.Recorder(url, pol) as rec:
        tx = tj.watch(make(), rec)  # the policy records opt_state: watch does too
        p, s = _params(), tx.init(_params())

        @jax.jit
        def step(p, s, x):
            g = jax.grad(_loss)(p, x)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        for t in range(3):
            p, s = step(p, s, jnp.full((5, 3), 0.1 * (t + 1)))
    want = _train(make())
    run = traintape.open_run(url)
    names = run.tensor_names("opt_state")
    expected = sorted(f"{layer}/{leaf}/{f}" for f in fields
                      for layer, leaf in (("fc", "kernel"), ("fc", "bias"), ("out", "kernel")))  # fmt: skip
    assert names == expected
    for f, get in fields.items():
        tree = get(want[2])
        for layer, leaf in (("fc", "kernel"), ("fc", "bias"), ("out", "kernel")):
            got = run.snapshot(f"{layer}/{leaf}/{f}", "opt_state", step=2)
            want_a = np.asarray(tree[layer][leaf])  # float32, compiled differently: 1e-5
            np.testing.assert_allclose(got, want_a, rtol=1e-5, atol=1e-5 * np.abs(want_a).max())


def test_kinds_accepts_opt_state_and_refuses_unknown(mem_url: str) -> None:
    rec = traintape.Recorder(mem_url)
    tj.watch(optax.adam(0.1), rec, kinds=("update", "opt_state"))
    with pytest.raises(ValueError, match="not \\['activation'\\]"):
        tj.watch(optax.adam(0.1), rec, kinds=("update", "activation"))
    rec.close()


def test_nnx_optimizer_records_opt_state(tmp_path) -> None:
    nnx = pytest.importorskip("flax.nnx")
    url = str(tmp_path / "nnx")
    pol = traintape.CapturePolicy(kinds=("update", "opt_state"))
    with traintape.Recorder(url, pol) as rec:
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, tj.watch(optax.adam(0.1), rec), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, x):
            grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
            opt.update(model, grads)

        for _ in range(2):
            step(model, opt, jnp.ones((4, 3)))
    run = traintape.open_run(url)
    assert run.tensor_names("opt_state") == ["bias/mu", "bias/nu", "kernel/mu", "kernel/nu"]
    assert run.steps.tolist() == [0, 1]
