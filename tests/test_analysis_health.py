"""Gradient-flow health on stores of real (tiny) JAX trainings with known defects."""

from __future__ import annotations

from _stores import stores  # noqa: F401

import traintape
from traintape.analysis import HealthThresholds, IssueType, Status, health


def test_deep_sigmoid_is_vanishing_in_first_layers(stores):  # noqa: F811
    rep = health(traintape.open_run(stores["sigmoid_deep"]))
    by = {lh.layer: lh for lh in rep.layers}
    assert [lh.layer for lh in rep.layers] == [f"layers/{i}" for i in range(9)]
    for i in range(3):
        lh = by[f"layers/{i}"]
        assert lh.status == Status.CRITICAL
        assert any(x.type == IssueType.VANISHING for x in lh.issues)
        assert all(x.recommendation for x in lh.issues)
    # the last layers are fine, and the profile decays towards the input
    assert not by["layers/8"].issues
    assert by["layers/0"].rel_grad < by["layers/4"].rel_grad < by["layers/8"].rel_grad
    assert rep.has(IssueType.DECAY_WITH_DEPTH)
    assert rep.status == Status.CRITICAL
    assert by["layers/0"].score < by["layers/8"].score


def test_exploding_learning_rate(stores):  # noqa: F811
    rep = health(traintape.open_run(stores["exploding"]))
    assert rep.has(IssueType.EXPLODING)
    exp = [i for i in rep.issues() if i.type == IssueType.EXPLODING]
    assert any(i.severity == Status.CRITICAL for i in exp)
    assert "learning rate" in exp[0].recommendation


def test_dead_relu_layer(stores):  # noqa: F811
    rep = health(traintape.open_run(stores["dead"]))
    by = {lh.layer: lh for lh in rep.layers}
    dead = [i for i in by["layers/1"].issues if i.type == IssueType.DEAD]
    assert dead and dead[0].severity == Status.CRITICAL
    assert by["layers/1"].act_zero_frac == 1.0
    # the output layer still learns
    assert not any(i.type == IssueType.DEAD for i in by["layers/2"].issues)


def test_healthy_model_has_no_critical_issue(stores):  # noqa: F811
    rep = health(traintape.open_run(stores["healthy"]))
    assert rep.status != Status.CRITICAL
    assert not [i for i in rep.issues() if i.severity == Status.CRITICAL]
    assert all(lh.score >= 75 for lh in rep.layers)
    assert all(lh.grad_norm and lh.grad_norm > 0 for lh in rep.layers)


def test_thresholds_are_configurable(stores):  # noqa: F811
    run = traintape.open_run(stores["healthy"])
    strict = health(run, HealthThresholds(update_ratio_high=1e-6))
    assert strict.has(IssueType.EXPLODING)
    assert strict.thresholds.update_ratio_high == 1e-6


def test_health_json_roundtrip(stores):  # noqa: F811
    from traintape.analysis import HealthReport

    rep = health(traintape.open_run(stores["dead"]))
    back = HealthReport.model_validate_json(rep.model_dump_json())
    assert back.status == rep.status and len(back.layers) == len(rep.layers)


# ----------------------------------------------------------------- attention q/k/v balance

ATTN = "blocks/0/attn"


def _train_attention(url: str, q_scale: float, k_scale: float, steps: int = 20) -> None:
    """Train one single-head self-attention block + linear head for real (JAX, SGD).

    Recorded with the core Recorder under canonical names ``blocks/0/attn/{q,k,v,o}/kernel``
    and ``head/kernel``. ``∂L/∂W_q`` scales with ``W_k`` and ``∂L/∂W_k`` with ``W_q``, so a
    large k init and a small q init give q gradients far larger than k's (and v's).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    d, seq, batch, lr = 16, 8, 16, 0.05
    rng = np.random.default_rng(0)

    def init(scale: float) -> np.ndarray:
        return (rng.standard_normal((d, d)) / np.sqrt(d) * scale).astype(np.float32)

    params = {
        f"{ATTN}/q/kernel": init(q_scale),
        f"{ATTN}/k/kernel": init(k_scale),
        f"{ATTN}/v/kernel": init(1.0),
        f"{ATTN}/o/kernel": init(1.0),
        "head/kernel": init(1.0),
    }
    xs = rng.standard_normal((steps, batch, seq, d)).astype(np.float32)
    ys = np.roll(xs, 1, axis=2).mean(axis=2)

    def forward(p, x):
        q, k, v = (x @ p[f"{ATTN}/{r}/kernel"] for r in ("q", "k", "v"))
        att = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(d), axis=-1)
        return ((att @ v) @ p[f"{ATTN}/o/kernel"]).mean(axis=1) @ p["head/kernel"]

    grad_fn = jax.jit(jax.value_and_grad(lambda p, x, y: jnp.mean((forward(p, x) - y) ** 2)))
    with traintape.Recorder(url) as rec:
        for t in range(steps):
            loss, grads = grad_fn(params, xs[t], ys[t])
            grads = {k: np.asarray(v) for k, v in grads.items()}
            new = {k: params[k] - lr * grads[k] for k in params}
            rec.record(t, "param", params)
            rec.record(t, "grad", grads)
            rec.record(t, "update", {k: new[k] - params[k] for k in params})
            rec.log(t, loss=float(loss))
            params = new


def test_attention_qkv_imbalance_is_flagged_on_the_attention_layer(tmp_path):
    from typer.testing import CliRunner

    from traintape.cli import app

    url = str(tmp_path / "attn")
    _train_attention(url, q_scale=0.1, k_scale=10.0)
    rep = health(traintape.open_run(url))
    qkv = [i for i in rep.issues() if i.type == IssueType.ATTENTION_QKV_IMBALANCE]
    assert len(qkv) == 1, rep.issues()
    (iss,) = qkv
    assert iss.layer == ATTN and rep.has(IssueType.ATTENTION_QKV_IMBALANCE, ATTN)
    assert iss.severity == Status.WARNING and "attention scaling" in iss.recommendation
    ev = iss.evidence
    # the evidence is the three projections' gradient norms, q by far the largest
    assert ev["grad_norm_q"] > 10 * ev["grad_norm_k"] and ev["grad_norm_q"] > 2 * ev["grad_norm_v"]
    by = {lh.layer: lh for lh in rep.layers}
    assert ev["grad_norm_q"] == by[f"{ATTN}/q"].grad_norm
    assert ev["grad_norm_k"] == by[f"{ATTN}/k"].grad_norm
    # shown by the CLI, named by layer
    r = CliRunner().invoke(app, ["health", url], env={"COLUMNS": "200"})
    assert f"ATTENTION_QKV_IMBALANCE {ATTN}:" in r.output, r.output


def test_balanced_attention_has_no_qkv_issue(tmp_path):
    url = str(tmp_path / "attn")
    _train_attention(url, q_scale=1.0, k_scale=1.0)
    rep = health(traintape.open_run(url))
    assert not rep.has(IssueType.ATTENTION_QKV_IMBALANCE)
    # and a stricter threshold is honoured on the same run
    norms = [lh.grad_norm for lh in rep.layers if lh.layer.startswith(ATTN + "/")]
    assert len(norms) == 4 and all(norms)
    strict = health(traintape.open_run(url), HealthThresholds(qkv_ratio=1.0001))
    assert strict.has(IssueType.ATTENTION_QKV_IMBALANCE, ATTN)
