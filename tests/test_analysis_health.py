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
