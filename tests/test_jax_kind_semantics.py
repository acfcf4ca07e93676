"""JAX adapters record docs/store-format.md's ``grad`` (pre-clip: what ``jax.grad``
returns) and ``update`` (θ_{t+1} − θ_t as applied: ``(θ + u) − θ`` in θ's dtype), start
at ``Recorder.next_step``, and record kinds named explicitly whatever the policy."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import traintape.jax as tj
from traintape import CapturePolicy, Kind, Recorder, RecordError, open_run

jax.config.update("jax_default_matmul_precision", "highest")


def _params() -> dict:
    k = jnp.linspace(-0.5, 0.5, 12, dtype=jnp.float32).reshape(3, 4)
    k = k.at[:, :2].add(1000.0)  # ulp(1000) = 6.1e-5: below half of it nothing moves
    return {"dense": {"kernel": k, "bias": jnp.zeros(4, jnp.float32)}}


def _loss(p, x, y):
    return jnp.mean((x @ p["dense"]["kernel"] + p["dense"]["bias"] - y) ** 2)


def _batch(t: int):
    x = jax.random.normal(jax.random.key(t), (5, 3))
    return x, jnp.sin(x[:, :1]) * jnp.ones(4)


def test_update_is_as_applied_zero_below_half_an_ulp(mem_url: str) -> None:
    """Adam moves every element by ≈ lr = 1e-5 on its first steps: the elements near
    1000 never change and their recorded update is exactly 0 (optax's ``u`` is not);
    the others change. The snapshot is θ_{t+1} − θ_t bit for bit."""
    params = _params()
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    tx = tj.watch(optax.adam(1e-5), rec)
    opt = tx.init(params)

    @jax.jit
    def step(p, o, x, y):
        g = jax.grad(_loss)(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, u

    hist, raw_u = [params], []
    for t in range(3):
        params, opt, u = step(params, opt, *_batch(t))
        hist.append(params)
        raw_u.append(u)
    rec.close()
    run = open_run(mem_url)
    stats = run.stats("update").set_index(["step", "tensor"])
    for t in range(3):
        before = np.asarray(hist[t]["dense"]["kernel"])
        delta = np.asarray(hist[t + 1]["dense"]["kernel"]) - before
        assert (delta[:, :2] == 0).all() and (delta[:, 2:] != 0).all()
        assert (np.asarray(raw_u[t]["dense"]["kernel"])[:, :2] != 0).all()  # optax's u is not 0
        np.testing.assert_array_equal(run.snapshot("dense/kernel", Kind.UPDATE, t), delta)
        assert stats.loc[(t, "dense/kernel"), "zero_frac"] == (delta == 0).mean()


def test_update_needs_params(mem_url: str) -> None:
    """Without params the applied update cannot be formed: not recorded, with a warning
    (default kinds) or refused (update asked for by name)."""
    params = _params()
    g = jax.grad(_loss)(params, *_batch(0))
    rec = Recorder(mem_url)
    tx = tj.watch(optax.sgd(0.1), rec)
    with pytest.warns(RuntimeWarning, match="called without params"):
        tx.update(g, tx.init(params))
    tx2 = tj.watch(optax.sgd(0.1), rec, kinds=("update",))
    with pytest.raises(ValueError, match="needs θ_t"):
        tx2.update(g, tx2.init(params))
    rec.close()


def test_grad_is_pre_clip_under_a_clipping_chain(mem_url: str) -> None:
    """optax.chain(clip_by_global_norm, adamw): ``watch``'s ``grad`` is what it receives
    (jax.grad, pre-clip), like ``value_and_grad``'s; the clipping shows in ``update``."""
    params = _params()
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    tx = tj.watch(
        optax.chain(optax.clip_by_global_norm(0.01), optax.adamw(1e-3)), rec, kinds=("grad",)
    )
    opt = tx.init(params)
    x, y = _batch(0)
    g = jax.grad(_loss)(params, x, y)
    jax.jit(tx.update)(g, opt, params)
    rec.close()
    run = open_run(mem_url)
    l2 = run.stats("grad").set_index("tensor")["l2"]
    total = float(np.sqrt((l2**2).sum()))
    np.testing.assert_allclose(total, float(optax.tree.norm(g)), rtol=1e-6)
    assert total > 0.01  # clipping was active
    np.testing.assert_array_equal(run.snapshot("dense/kernel", Kind.GRAD, 0), g["dense"]["kernel"])


def _record_steps(url: str, n: int, **vg_kw) -> None:
    with Recorder(url) as rec:
        vg = jax.jit(tj.value_and_grad(_loss, recorder=rec, **vg_kw))
        p = _params()
        for t in range(n):
            vg(p, *_batch(t))


def test_start_step_follows_the_recorder(tmp_path) -> None:
    url = str(tmp_path / "run")
    _record_steps(url, 3)
    with Recorder(url) as rec:
        assert rec.next_step == 3
        for make in (tj.value_and_grad, tj.nnx_value_and_grad, tj.filter_value_and_grad):
            with pytest.raises(RecordError, match=r"start step 0 .* at step 3"):
                make(_loss, recorder=rec, start_step=0)
        tx = tj.watch(optax.sgd(0.1), rec, start_step=1)
        with pytest.raises(RecordError, match=r"start step 1 .* at step 3"):
            tx.init(_params())
        assert int(tj.watch(optax.sgd(0.1), rec).init(_params()).count) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _record_steps(url, 2)  # default: continues at 3
    assert open_run(url).steps.tolist() == [0, 1, 2, 3, 4]
