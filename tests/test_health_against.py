"""Comparative health (``health_against``, ``traintape health A --against B``) on real
numpy trainings: one with layer 1 left frozen (its gradients stopped: DEAD), one whose
layer 2 takes steps too large (EXPLODING) by two different amounts, and a healthy one."""

from __future__ import annotations

import json

import pytest
from _np_mlp import train
from typer.testing import CliRunner

import traintape
from traintape.analysis import (
    HealthComparison,
    IssueType,
    NoSharedLayersError,
    Status,
    Verdict,
    compare_health,
    health,
    health_against,
)
from traintape.cli import app

cli = CliRunner()
LAYERS = ["layers/0", "layers/1", "layers/2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("against")
    urls = {n: str(root / n) for n in ("healthy", "frozen", "lr40", "lr60", "other_names")}
    train(urls["healthy"], steps=120)
    train(urls["frozen"], steps=120, frozen=[1])
    train(urls["lr40"], steps=120, lr_mult=lambda t, i: 40.0 if i == 2 else 1.0)
    train(urls["lr60"], steps=120, lr_mult=lambda t, i: 60.0 if i == 2 else 1.0)
    train(urls["other_names"], steps=20, prefix="encoder")
    return urls


def _open(runs, name):
    return traintape.open_run(runs[name])


def test_planted_defect_is_degraded_and_its_fix_improved(runs):
    bad = health_against(_open(runs, "frozen"), _open(runs, "healthy"))
    assert {lc.layer: lc.verdict for lc in bad.layers} == {
        "layers/0": Verdict.UNCHANGED, "layers/1": Verdict.DEGRADED, "layers/2": Verdict.UNCHANGED,
    }  # fmt: skip
    assert bad.verdict == Verdict.DEGRADED and bad.score_after < bad.score_before
    lc = bad.layer("layers/1")
    assert (lc.status_before, lc.status_after) == (Status.HEALTHY, Status.CRITICAL)
    (dead,) = lc.issues
    assert dead.type == IssueType.DEAD and dead.change == "new"
    assert (dead.before, dead.after) == (None, Status.CRITICAL)
    gn = next(m for m in lc.moved if m.measure == "grad_norm")
    assert gn.before and gn.before > 0 and gn.after == 0  # the evidence: from what to what
    assert "DEAD new" in lc.evidence() and "grad_norm" in lc.evidence()

    fix = health_against(_open(runs, "healthy"), _open(runs, "frozen"))
    assert fix.layer("layers/1").verdict == Verdict.IMPROVED and fix.verdict == Verdict.IMPROVED
    assert [i.change for i in fix.layer("layers/1").issues] == ["resolved"]
    gn = next(m for m in fix.layer("layers/1").moved if m.measure == "grad_norm")
    assert gn.before == 0 and gn.after and gn.after > 0
    assert fix.counts() == {Verdict.IMPROVED: 1, Verdict.DEGRADED: 0, Verdict.UNCHANGED: 2}


def test_healthy_run_against_itself_is_unchanged_everywhere(runs):
    cmp = health_against(_open(runs, "healthy"), _open(runs, "healthy"))
    assert [lc.layer for lc in cmp.layers] == LAYERS
    assert all(lc.verdict == Verdict.UNCHANGED for lc in cmp.layers)
    assert all(not lc.moved and not lc.issues for lc in cmp.layers)
    assert cmp.verdict == Verdict.UNCHANGED and not cmp.only_in_a and not cmp.only_in_b


def test_persisting_issue_judged_by_its_measure(runs):
    """Both runs' layer 2 is EXPLODING (same score): the verdict follows update_ratio."""
    a, b = health(_open(runs, "lr40")), health(_open(runs, "lr60"))
    for rep in (a, b):
        assert rep.has(IssueType.EXPLODING, "layers/2")
    better = compare_health(a, b, move_factor=1.5)
    lc = better.layer("layers/2")
    assert lc.verdict == Verdict.IMPROVED and lc.score_before == lc.score_after
    assert lc.reason.startswith("EXPLODING persists; update_ratio")
    ur = next(m for m in lc.moved if m.measure == "update_ratio")
    assert ur.after is not None and ur.before is not None and ur.after < ur.before
    assert compare_health(b, a, move_factor=1.5).layer("layers/2").verdict == Verdict.DEGRADED
    # under the default factor (2) the same move is too small to count
    assert compare_health(a, b).layer("layers/2").verdict == Verdict.UNCHANGED
    with pytest.raises(ValueError, match="move_factor must be > 1"):
        compare_health(a, b, move_factor=1.0)


def test_no_shared_layers_is_an_error_naming_both_runs(runs):
    with pytest.raises(NoSharedLayersError) as e:
        health_against(_open(runs, "other_names"), _open(runs, "healthy"))
    msg = str(e.value)
    assert "share no layers" in msg and "encoder/0" in msg and "layers/0" in msg
    r = cli.invoke(app, ["health", runs["other_names"], "--against", runs["healthy"]])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and out.startswith("error:") and "share no layers" in out
    assert runs["other_names"] in out and runs["healthy"] in out


def test_cli_against(runs):
    env = {"COLUMNS": "250"}
    r = cli.invoke(app, ["health", runs["frozen"], "--against", runs["healthy"]], env=env)
    assert r.exit_code == 1, r.output  # a layer degraded
    assert "degraded — score 100 → 80, status healthy → critical" in r.output
    assert "0 improved, 1 degraded, 2 unchanged of 3 shared layers" in r.output
    line = next(x for x in r.output.splitlines() if x.startswith("│ layers/1 "))
    assert "degraded" in line and "healthy → critical" in line and "DEAD new" in line
    assert "DEAD new layers/1: gradients are exactly zero" in r.output
    ok = cli.invoke(app, ["health", runs["healthy"], "--against", runs["frozen"]], env=env)
    assert ok.exit_code == 0, ok.output
    assert "improved — score 80 → 100" in ok.output and "DEAD resolved" in ok.output
    same = cli.invoke(app, ["health", runs["healthy"], "--against", runs["healthy"]], env=env)
    assert same.exit_code == 0 and "0 improved, 0 degraded, 3 unchanged" in same.output


def test_cli_against_json(runs):
    r = cli.invoke(app, ["health", runs["healthy"], "--against", runs["frozen"], "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["verdict"] == "improved" and doc["b"].rstrip("/").endswith("frozen")
    lay = {x["layer"]: x for x in doc["layers"]}
    assert lay["layers/1"]["verdict"] == "improved"
    assert lay["layers/1"]["issues"][0] == {
        "type": "DEAD", "before": "critical", "after": None,
        "message": "gradients are exactly zero",
        "recommendation": lay["layers/1"]["issues"][0]["recommendation"],
    }  # fmt: skip
    assert HealthComparison.model_validate_json(r.output).layer("layers/1").moved


def test_cli_against_bad_input(runs, tmp_path):
    missing = str(tmp_path / "missing")
    r = cli.invoke(app, ["health", runs["healthy"], "--against", missing])
    assert r.exit_code == 2 and missing in " ".join(r.output.split())
    assert "no such file or directory" in r.output
    r = cli.invoke(app, ["health", runs["healthy"], "--against", runs["frozen"], "--window", "5"])
    assert r.exit_code == 2 and "--window and --against cannot be combined" in r.output
