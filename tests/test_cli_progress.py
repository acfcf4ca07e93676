"""Progress bars: rich bars with real totals on stderr when it is a terminal, nothing
otherwise, and never on stdout (``--json`` stays parseable)."""

from __future__ import annotations

import io
import json
import re

import pytest
from _stores import stores  # noqa: F401
from rich.console import Console
from typer.testing import CliRunner

import traintape.cli
from traintape.cli import app

cli = CliRunner()


@pytest.fixture
def tty_err(monkeypatch):
    """Make the CLI's stderr console a terminal writing into a buffer."""
    buf = io.StringIO()
    monkeypatch.setattr(
        traintape.cli, "err", Console(file=buf, force_terminal=True, width=150, color_system=None)
    )
    return buf


def _bars(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+)", text)]


def test_report_shows_a_bar_with_real_totals(stores, tmp_path, tty_err):  # noqa: F811
    r = cli.invoke(app, ["report", stores["healthy"], "-o", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    text = tty_err.getvalue()
    assert "report" in text and "━" in text
    bars = _bars(text)
    assert bars and bars[-1][0] == bars[-1][1] > 5  # finished, with a real total
    assert "wrote" in r.stdout and "━" not in r.stdout


@pytest.mark.parametrize(
    ("args", "label"),
    [
        (["health", "{run}", "--json"], "health"),
        (["anomalies", "{run}", "--json"], "anomalies"),
        (["compare", "{run}", "{run}", "--json"], "compare"),
    ],
)
def test_json_stdout_stays_clean_with_a_bar_on_stderr(stores, tty_err, args, label):  # noqa: F811
    run = stores["healthy"]
    r = cli.invoke(app, [a.format(run=run) for a in args])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # nothing but the JSON document on stdout
    text = tty_err.getvalue()
    assert label in text
    bars = _bars(text)
    assert bars and bars[-1][0] == bars[-1][1] > 0


def test_export_and_ls_bars(stores, tmp_path, tty_err):  # noqa: F811
    run = stores["healthy"]
    r = cli.invoke(app, ["export", run, "-o", str(tmp_path / "x.npz"), "-f", "npz", "--snapshots"])
    assert r.exit_code == 0, r.output
    assert "export npz" in tty_err.getvalue()
    r = cli.invoke(app, ["ls", str(tmp_path.parent), "--json"])
    assert r.exit_code == 0
    json.loads(r.stdout)


def test_no_bar_when_stderr_is_not_a_terminal(stores, tmp_path):  # noqa: F811
    r = cli.invoke(app, ["report", stores["healthy"], "-o", str(tmp_path / "r.html")])
    assert r.exit_code == 0
    assert "━" not in r.output and "report:" not in r.output
