"""The demo's run (``traintape demo``: a converged Flax model, loss 1e-4) is healthy in
every view of ``health``: over the whole run, and per window (issue 24: TURBULENT and
PRESSURE_SPIKE warnings on every layer in "health over time" while the headline said
healthy)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flax")

from typer.testing import CliRunner

from traintape.cli import app

cli = CliRunner()


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("demo") / "run")
    r = cli.invoke(app, ["demo", "-o", out])
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.parametrize("window", ["auto", "30", "50"])
def test_demo_has_no_warning_in_health_over_time(demo, window):
    r = cli.invoke(app, ["health", demo, "--window", window, "--json"])
    assert r.exit_code == 0, r.output
    trend = json.loads(r.output)
    bad = [(i["type"], i["layer"], i["severity"]) for i in
           [*trend["run_issues"], *(i for lt in trend["layers"] for i in lt["issues"])]
           if i["severity"] in ("warning", "critical")]  # fmt: skip
    assert not bad
    assert set(trend["status"]) == {"healthy"}


def test_demo_is_healthy_and_says_so_once(demo):
    r = cli.invoke(app, ["health", demo])
    assert r.exit_code == 0 and "healthy, score 100/100" in " ".join(r.output.split()), r.output
    assert "recommendations" not in r.output  # nothing to recommend
    r = cli.invoke(app, ["health", demo, "--window", "auto"])
    assert r.exit_code == 0 and "worst healthy" in " ".join(r.output.split()), r.output
