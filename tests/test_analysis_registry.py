"""User checks and metrics (traintape.analysis.registry): the decorator, entry points,
failures kept inside a check, and their place in health (library, CLI table, --json)."""

from __future__ import annotations

import importlib.metadata
import json
import sys
import types

import numpy as np
import pytest
from typer.testing import CliRunner

import traintape
from traintape.analysis import health, registry
from traintape.analysis.registry import CheckIssue, CheckResult, check, metric, run_checks
from traintape.cli import app

cli = CliRunner()


@pytest.fixture(scope="module")
def run_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("registry") / "run")
    rng = np.random.default_rng(0)
    p = {"a/kernel": rng.standard_normal((3, 4)).astype(np.float32),
         "b/kernel": 50 * rng.standard_normal((4, 2)).astype(np.float32)}  # fmt: skip
    with traintape.Recorder(url) as rec:
        for t in range(6):
            g = {k: (0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in p.items()}
            rec.record(t, "param", p)
            rec.record(t, "grad", g)
            rec.record(t, "update", {k: -0.01 * g[k] for k in p})
            rec.log(t, loss=1.0 / (t + 1))
            p = {k: v - 0.01 * g[k] for k, v in p.items()}
    return url


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    """Each test starts with no checks and no entry points, and leaves none behind."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_LOAD_ERRORS", {})
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    monkeypatch.delenv("TRAINTAPE_NO_PLUGINS", raising=False)


def _norm_cap(run):
    """no parameter's L2 norm above 100"""
    df = run.stats("param")
    last = df[df.step == df.step.max()].set_index("tensor")["l2"]
    return CheckResult(
        values={k: float(v) for k, v in last.items()},
        issues=[
            CheckIssue(severity="critical", layer=k, message=f"L2 norm {v:.3g} > 100",
                       recommendation="add weight decay")
            for k, v in last.items() if v > 100
        ],
    )  # fmt: skip


def test_decorated_check_runs_with_health(run_url):
    check("norm_cap")(_norm_cap)

    @metric("final_loss", description="the last loss")
    def final_loss(run):
        return {"value": float(run.metrics()["loss"].iloc[-1]), "unit": "nats"}

    run = traintape.open_run(run_url)
    rep = health(run)
    names = [c.name for c in rep.checks]
    assert names == ["norm_cap", "final_loss"]
    cap, loss = rep.checks
    assert cap.kind == "check" and cap.description == "no parameter's L2 norm above 100"
    df = run.stats("param")
    want = df[df.step == 5].set_index("tensor")["l2"]
    assert cap.values == pytest.approx(want.to_dict())
    assert cap.status == "critical" and [i.layer for i in cap.issues] == ["b/kernel"]
    assert loss.kind == "metric" and loss.value == pytest.approx(1 / 6) and loss.unit == "nats"
    assert loss.status == "healthy" and loss.description == "the last loss"
    # a critical user issue makes the run critical, without touching the score
    assert rep.status == "critical"
    plain = health(run, checks=False)
    assert plain.checks == [] and plain.score == rep.score and plain.status != "critical"


def test_failing_check_does_not_break_health(run_url):
    @check
    def broken(run):
        raise ZeroDivisionError("boom")

    @check("wrong_type")
    def wrong_type(run):
        return 42

    @check("bad_fields")
    def bad_fields(run):
        return {"issues": [{"severity": "apocalyptic", "message": "x"}]}

    check("norm_cap")(_norm_cap)
    rep = health(traintape.open_run(run_url))
    by = {c.name: c for c in rep.checks}
    assert list(by) == ["broken", "wrong_type", "bad_fields", "norm_cap"]
    assert by["broken"].status == "error"
    assert by["broken"].error.startswith("ZeroDivisionError: boom (at test_analysis_registry.py:")
    assert by["wrong_type"].error == "returned int, expected a CheckResult"
    assert by["bad_fields"].error.startswith("returned an invalid result: ValidationError")
    assert by["norm_cap"].status == "critical"  # the others still ran
    # failed checks do not decide the status
    registry.unregister("norm_cap")
    rep = health(traintape.open_run(run_url))
    assert rep.status != "critical" and len(rep.checks) == 3


def test_health_cli_table_and_json(run_url):
    check("norm_cap")(_norm_cap)

    @check("explodes")
    def explodes(run):
        raise RuntimeError("no\nsecond line")

    r = cli.invoke(app, ["health", run_url], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output  # the user check's critical issue
    assert "registered checks" in r.output
    assert "norm_cap" in r.output and "L2 norm" in r.output and "add weight decay" in r.output
    assert "explodes" in r.output and "RuntimeError: no" in r.output
    assert "second line" not in r.output
    j = json.loads(cli.invoke(app, ["health", run_url, "--json"]).output)
    by = {c["name"]: c for c in j["checks"]}
    assert by["norm_cap"]["issues"][0]["layer"] == "b/kernel"
    assert by["explodes"]["error"].startswith("RuntimeError: no")


class _EP:
    """A stand-in for importlib.metadata.EntryPoint."""

    def __init__(self, name: str, value: str, obj=None, exc: Exception | None = None):
        self.name, self.value, self._obj, self._exc = name, value, obj, exc

    def load(self):
        if self._exc is not None:
            raise self._exc
        return self._obj


def test_entry_points_are_discovered(run_url, monkeypatch):
    mod = types.ModuleType("tt_plugin_mod")

    def registering_module_check(run):
        return CheckResult(value=1.0)

    mod.registering_module_check = registering_module_check
    registry.register(registering_module_check, "from_module")  # as its import would
    eps = [
        _EP("plugin_cap", "tt_plugin:cap", _norm_cap),
        _EP("plugin_module", "tt_plugin_mod", mod),
        _EP("plugin_missing", "nowhere:fn", exc=ModuleNotFoundError("No module named 'nowhere'")),
        _EP("plugin_value", "tt_plugin:VALUE", 3),
    ]
    calls = []

    def entry_points(**kw):
        calls.append(kw)
        return eps if kw.get("group") == "traintape.checks" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setitem(sys.modules, "tt_plugin_mod", mod)
    results = run_checks(traintape.open_run(run_url))
    by = {r.name: r for r in results}
    assert calls == [{"group": "traintape.checks"}]
    assert list(by) == ["from_module", "plugin_cap", "plugin_missing", "plugin_value"]
    assert by["plugin_cap"].status == "critical"
    assert registry.registered()["plugin_cap"].source == "entry point tt_plugin:cap"
    assert by["plugin_missing"].error == (
        "cannot load entry point plugin_missing = nowhere:fn: "
        "ModuleNotFoundError: No module named 'nowhere'"
    )
    assert "is int, not a function" in by["plugin_value"].error
    # loaded once
    run_checks(traintape.open_run(run_url))
    assert len(calls) == 1
    # the health CLI shows entry-point checks and their load failures
    r = cli.invoke(app, ["health", run_url, "--json"])
    names = [c["name"] for c in json.loads(r.output)["checks"]]
    assert names == ["from_module", "plugin_cap", "plugin_missing", "plugin_value"]


def test_no_plugins_env(run_url, monkeypatch):
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda **kw: [_EP("cap", "x:cap", _norm_cap)]
    )
    monkeypatch.setenv("TRAINTAPE_NO_PLUGINS", "1")
    assert run_checks(traintape.open_run(run_url)) == []


def test_register_errors_and_selection(run_url):
    with pytest.raises(TypeError, match="must be a function"):
        registry.register(3, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty name"):
        registry.register(lambda run: CheckResult(), " ")
    check("norm_cap")(_norm_cap)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(lambda run: CheckResult(), "norm_cap", replace=False)
    check("other")(lambda run: CheckResult(value=2.0))
    run = traintape.open_run(run_url)
    assert [r.name for r in run_checks(run, ["other"])] == ["other"]
    with pytest.raises(KeyError, match="no check named 'zzz'; registered: norm_cap, other"):
        run_checks(run, ["zzz"])
    res = run_checks(run)[0]
    assert res.seconds >= 0


def test_checks_option_imports_a_module(run_url, tmp_path):
    mod = tmp_path / "my_checks.py"
    mod.write_text(
        "from traintape.analysis import CheckResult, check\n\n"
        "@check('row_count', description='rows recorded')\n"
        "def row_count(run):\n"
        "    return CheckResult(value=float(run.rows), unit='rows')\n"
    )
    r = cli.invoke(app, ["health", run_url, "--checks", str(mod), "--json"])
    assert r.exit_code == 0, r.output
    (c,) = json.loads(r.output)["checks"]
    assert c["name"] == "row_count" and c["value"] == 6 and c["status"] == "healthy"
    out = tmp_path / "r.md"
    r = cli.invoke(app, ["report", run_url, "-f", "md", "-o", str(out), "--checks", str(mod)])
    assert r.exit_code == 0, r.output
    assert "| row\\_count | check | healthy | 6 |" in out.read_text()
    bad = cli.invoke(app, ["health", run_url, "--checks", str(tmp_path / "nope.py")])
    assert bad.exit_code == 2 and "--checks" in bad.output and "nope.py" in bad.output
    bad = cli.invoke(app, ["health", run_url, "--checks", "no_such_module_xyz"])
    assert bad.exit_code == 2
    assert "cannot import no_such_module_xyz: ModuleNotFoundError" in bad.output
