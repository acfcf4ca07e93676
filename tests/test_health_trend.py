"""Health over time (``health_trend``, ``traintape health RUN --window N``) on real numpy
trainings: a layer whose learning rate ramps up from step 100 explodes only in the second
half; outlier batches from step 100 make the first layer's gradient turbulent."""

from __future__ import annotations

import json

import pytest
from _np_mlp import train
from typer.testing import CliRunner

import traintape
from traintape.analysis import HealthTrend, IssueType, Status, health_trend, render_report
from traintape.cli import app

cli = CliRunner()
STEPS = 200


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("trend")
    urls = {name: str(root / name) for name in ("healthy", "exploding", "turbulent")}
    train(urls["healthy"], steps=STEPS)
    # layer 2's learning rate grows 6 % a step from step 100: it diverges late
    train(urls["exploding"], steps=STEPS,
          lr_mult=lambda t, i: 1.06 ** (t - 100) if i == 2 and t >= 100 else 1.0)  # fmt: skip
    # from step 100, every 10th batch comes at 30x the input scale
    train(urls["turbulent"], steps=STEPS,
          batch_scale=lambda t: 30.0 if t >= 100 and t % 10 == 0 else 1.0)  # fmt: skip
    return urls


def test_second_half_explosion_changes_the_layers_status(runs):
    tr = health_trend(traintape.open_run(runs["exploding"]), 25)
    assert [(w.first_step, w.last_step, w.rows) for w in tr.windows] == [
        (25 * k, 25 * k + 24, 25) for k in range(8)
    ]
    lt = tr.layer("layers/2")
    # healthy through the first half, critical at the end
    assert lt.status[:4] == [Status.HEALTHY] * 4 and lt.status[-1] == Status.CRITICAL
    (change,) = [c for c in lt.changes if c.after == Status.CRITICAL]
    assert change.before == Status.HEALTHY and 100 <= change.step < STEPS
    assert IssueType.EXPLODING in change.issues
    (exp,) = [i for i in lt.issues if i.type == IssueType.EXPLODING]
    assert exp.first_step == change.step and exp.last_step == STEPS - 1
    assert exp.severity == Status.CRITICAL and "learning rate" in exp.recommendation
    assert exp.windows == (STEPS - exp.first_step) // 25
    # the measures tell the same story: the grad norm speeds up and presses harder
    assert lt.velocity[-1] > 0.5 > abs(lt.velocity[1])
    assert lt.max_pressure[-1] > 10 * lt.max_pressure[1]
    assert lt.grad_norm[-1] > 1e3 * lt.grad_norm[1]
    assert tr.status[:4] == [Status.HEALTHY] * 4 and tr.worst == Status.CRITICAL


def test_acceleration_is_flagged_before_the_explosion(runs):
    tr = health_trend(traintape.open_run(runs["exploding"]), 20)
    lt = tr.layer("layers/0")
    acc = [i for i in lt.issues if i.type == IssueType.ACCELERATING]
    exp = [i for i in lt.issues if i.type == IssueType.EXPLODING]
    assert acc and exp and acc[0].first_step < exp[0].first_step
    w = next(k for k, win in enumerate(tr.windows) if win.first_step == acc[0].first_step)
    assert lt.status[w] == Status.WARNING and lt.acceleration[w] > 0
    ev = acc[0].evidence
    assert ev["velocity_end"] > ev["velocity_start"] and ev["velocity_end"] > 0
    assert "growth rate rose" in acc[0].message and "learning rate" in acc[0].recommendation


def test_outlier_batches_are_turbulent_with_pressure_spikes(runs):
    tr = health_trend(traintape.open_run(runs["turbulent"]), 50)
    lt = tr.layer("layers/0")
    assert lt.status == [Status.HEALTHY, Status.HEALTHY, Status.WARNING, Status.WARNING]
    turb = [i for i in lt.issues if i.type == IssueType.TURBULENT]
    assert len(turb) == 1 and (turb[0].first_step, turb[0].last_step) == (100, 199)
    assert turb[0].windows == 2 and turb[0].evidence["turbulence"] > 1
    assert "batch size" in turb[0].recommendation
    assert lt.turbulence[2] > 1 > 3 * lt.turbulence[1]
    assert tr.has(IssueType.PRESSURE_SPIKE, "layers/0")
    assert lt.max_pressure[2] > 5 * lt.max_pressure[1]
    assert not any(i.type == IssueType.EXPLODING for i in tr.issues())


def test_healthy_run_stays_healthy_in_every_window(runs):
    run = traintape.open_run(runs["healthy"])
    for window in (10, 30):
        tr = health_trend(run, window)
        assert all(s == Status.HEALTHY for lt in tr.layers for s in lt.status), tr.issues()
        assert not tr.issues() and not any(lt.changes for lt in tr.layers)
    # windows are aligned to multiples of the window; the last one is partial
    assert [(w.index, w.first_step, w.last_step, w.rows) for w in tr.windows][-2:] == [
        (5, 150, 179, 30), (6, 180, 199, 20),
    ]  # fmt: skip
    assert all(len(lt.status) == len(lt.turbulence) == 7 for lt in tr.layers)


def test_window_must_be_positive(runs):
    with pytest.raises(ValueError, match="window must be at least 1 step, got 0"):
        health_trend(traintape.open_run(runs["healthy"]), 0)
    r = cli.invoke(app, ["health", runs["healthy"], "--window", "0"])
    assert r.exit_code == 2 and "--window must be at least 1 step, got 0" in r.output


def test_cli_window_prints_the_trend(runs):
    r = cli.invoke(app, ["health", runs["exploding"], "--window", "25"], env={"COLUMNS": "250"})
    assert r.exit_code == 1, r.output  # critical in a window
    assert "200 steps in 8 windows of 25 steps — worst critical (from step 150)" in r.output
    line = next(x for x in r.output.splitlines() if x.startswith("│ layers/2 "))
    assert "······✖✖" in line and "healthy → critical at 150 (EXPLODING)" in line
    assert "EXPLODING layers/2, steps 150..199 (2 windows):" in r.output
    assert "→ lower the learning rate" in r.output
    ok = cli.invoke(app, ["health", runs["healthy"], "-w", "50"], env={"COLUMNS": "250"})
    assert ok.exit_code == 0, ok.output
    assert "worst healthy" in ok.output and "····" in ok.output


def test_cli_window_json(runs):
    r = cli.invoke(app, ["health", runs["turbulent"], "--window", "50", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["window"] == 50 and len(doc["windows"]) == 4
    lay = {x["layer"]: x for x in doc["layers"]}
    assert lay["layers/0"]["status"] == ["healthy", "healthy", "warning", "warning"]
    assert {i["type"] for i in lay["layers/0"]["issues"]} >= {"TURBULENT", "PRESSURE_SPIKE"}
    back = HealthTrend.model_validate_json(r.output)
    assert back.layer("layers/0").turbulence == lay["layers/0"]["turbulence"]


def test_cli_window_unknown_run(tmp_path):
    r = cli.invoke(app, ["health", str(tmp_path / "nope"), "--window", "10"])
    assert r.exit_code == 2 and str(tmp_path / "nope") in " ".join(r.output.split())


def test_report_shows_status_over_time(runs):
    html = render_report(traintape.open_run(runs["exploding"]))
    assert "Health over time (windows of 20 steps" in html
    part = html.split("Health over time", 1)[1].split("<h2>", 1)[0]
    assert "layers/2: <span class='healthy'>healthy</span> → " in part
    assert part.count('class="critical"') >= 2 and "EXPLODING layers/2, steps" in part
