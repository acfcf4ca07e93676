"""`traintape report --format md` (a Markdown summary) and the HTML report's sortable
tables, per-layer details and registered checks."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

import traintape
from traintape.analysis import registry, render_markdown, render_report
from traintape.analysis.registry import CheckIssue, CheckResult, check
from traintape.cli import app
from traintape.schema import CapturePolicy

cli = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RUN_ID = "exp|<b>1</b>_*x*"
LAYERS = ("dense_0", "dense_1", "dense_2")


def _record(url: str, *, full_every: int | None = 4, nan_at: int | None = 6) -> dict:
    """Three dense layers; dense_2 gets a NaN gradient at ``nan_at``. Returns θ_t."""
    rng = np.random.default_rng(1)
    p = {f"{layer}/kernel": rng.standard_normal((5, 5)).astype(np.float32) for layer in LAYERS}
    seen = {}
    with traintape.Recorder(url, CapturePolicy(full_every=full_every), run_id=RUN_ID) as rec:
        for t in range(10):
            g = {k: (0.1 * (i + 1) * rng.standard_normal(v.shape)).astype(np.float32)
                 for i, (k, v) in enumerate(p.items())}  # fmt: skip
            if t == nan_at:
                g["dense_2/kernel"][0, 0] = np.nan
            new = {k: np.nan_to_num(v - 0.05 * g[k]).astype(np.float32) for k, v in p.items()}
            rec.record(t, "param", p)
            rec.record(t, "grad", g)
            rec.record(t, "update", {k: new[k] - p[k] for k in p})
            rec.log(t, loss=1.0 / (t + 1))
            seen[t] = {k: v.astype(np.float64) for k, v in p.items()}
            p = new
    return seen


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("md") / "run")
    return url, _record(url)


@pytest.fixture(autouse=True)
def checks(monkeypatch):
    """One passing check with per-layer values and a warning, one failing check."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_LOAD_ERRORS", {})
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])

    @check("kernel_size", description="numel per kernel")
    def kernel_size(run):
        return CheckResult(
            values={"dense_0": 25.0, "dense_1": 25.0, "dense_2": 25.0},
            issues=[CheckIssue(severity="warning", layer="dense_1", message="too <small>",
                               recommendation="widen it")],
        )  # fmt: skip

    @check("flaky")
    def flaky(run):
        raise ValueError("no data|here")


def test_markdown_summary(store):
    url, seen = store
    md = render_markdown(traintape.open_run(url))
    # run info, with the run id escaped (no HTML, no table break)
    assert md.startswith("## traintape report: exp\\|\\<b\\>1\\</b\\>\\_\\*x\\*\n")
    assert "<b>" not in md
    for head in ("### Health", "### Checks", "### Anomalies", "### Largest parameter changes"):
        assert head in md
    assert "| steps | 10 rows, steps 0..9 |" in md
    # health table: a row per layer
    rows = [line for line in md.splitlines() if line.startswith("| dense\\_")]
    assert {r.split(" | ")[0][2:] for r in rows} >= {"dense\\_0", "dense\\_1", "dense\\_2"}
    # the checks, with the failure and the escaped issue
    assert re.search(
        r"\| kernel\\_size \| check \| warning \| – \| .*too \\<small\\> \(dense\\_1\)", md
    )
    assert "| flaky | check | error |" in md and "ValueError: no data\\|here" in md
    # anomalies: the NaN gradient
    assert "first non-finite: step 6, grad dense_2/kernel" in md.replace("\\_", "_")
    # largest change: first → last snapshot (0 → 8), layers by relative change
    assert "Δ = θ(step 8) − θ(step 0)" in md
    rel = {
        layer: np.linalg.norm(seen[8][f"{layer}/kernel"] - seen[0][f"{layer}/kernel"])
        / np.linalg.norm(seen[0][f"{layer}/kernel"])
        for layer in LAYERS
    }
    section = md.split("### Largest parameter changes")[1]
    order = [m.replace("\\_", "_") for m in re.findall(r"^\| (dense\\_\d) \|", section, re.M)]
    assert order == sorted(LAYERS, key=lambda x: -rel[x])
    top = max(LAYERS, key=lambda x: rel[x])
    assert f"{rel[top]:.3g}" in section


def test_markdown_without_snapshots(tmp_path):
    url = str(tmp_path / "stats_only")
    _record(url, full_every=None, nan_at=None)
    md = render_markdown(traintape.open_run(url))
    assert "No param snapshots: the layers with the largest median update/param ratio" in md
    assert "Summary: none" in md


def test_report_cli_md(store, tmp_path):
    url, _ = store
    r = cli.invoke(app, ["report", url, "--format", "md"])
    assert r.exit_code == 0, r.output
    assert r.output == render_markdown(traintape.open_run(url))
    out = tmp_path / "r.md"
    r = cli.invoke(app, ["report", url, "-f", "md", "-o", str(out)])
    assert r.exit_code == 0 and f"wrote {out}" in r.output
    assert out.read_text().startswith("## traintape report")
    bad = cli.invoke(app, ["report", url, "--format", "pdf"])
    assert bad.exit_code == 2 and "unknown report format 'pdf': use html or md" in bad.output
    bad = cli.invoke(app, ["report", url, "-f", "md", "-o", str(tmp_path / "no" / "r.md")])
    assert bad.exit_code == 2 and "does not exist" in bad.output


def test_html_sortable_tables_details_and_checks(store):
    url, _ = store
    text = render_report(traintape.open_run(url))
    # sortable tables: header row in <thead>, rows in <tbody>, one inline script
    assert text.count('<table class="sortable"><thead>') >= 4
    assert text.count("<script>") == 1 and 'addEventListener("click"' in text
    assert 'src="http' not in text and "<link" not in text
    # the status column sorts by severity
    assert '<td class="warning" data-sort="1">warning</td>' in text
    # a <details> per layer, with its measures, issues, anomalies and checks
    layers = re.findall(
        r"<details><summary><span class='\w+'>.{1,3} \w+</span> <b>([^<]+)</b>", text
    )
    assert layers == list(LAYERS)
    d2 = text.split("<b>dense_2</b>")[1].split("</details>")[0]
    assert "EXPLODING" in d2 and "non-finite" in d2 and "Anomalies (" in d2
    assert "Change between snapshots" in d2 and "0→4" in d2 and "4→8" in d2
    d1 = text.split("<b>dense_1</b>")[1].split("</details>")[0]
    assert "kernel_size = 25" in d1 and "too &lt;small&gt;" in d1
    # the checks section: both checks, the failure shown, text escaped
    sec = text.split("<h2>Checks</h2>")[1].split("<h2>")[0]
    assert "kernel_size" in sec and "numel per kernel" in sec
    assert '<td class="error" data-sort="3">error</td>' in sec
    assert "ValueError: no data|here" in sec
    assert "<small>" not in text and "&lt;b&gt;1&lt;/b&gt;" in text


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_table_sorts_in_chromium(store, tmp_path):
    """Click the health table's 'grad norm' header twice in a real browser: the rows
    come back sorted ascending, then descending."""
    url, _ = store
    run = traintape.open_run(url)
    text = render_report(run)
    gn = {lh.layer: lh.grad_norm for lh in traintape.analysis.health(run).layers}
    order = {}
    for clicks in (1, 2):
        click = (
            "<script>var t=document.querySelector('h2+p+table.sortable');"
            f"for(var i=0;i<{clicks};i++)t.tHead.rows[0].cells[3].click();"
            "document.title=Array.prototype.map.call(t.tBodies[0].rows,"
            "function(r){return r.cells[0].textContent}).join(',');</script>"
        )
        page = tmp_path / f"sort{clicks}.html"
        page.write_text(text.replace("</body>", click + "</body>"))
        cmd = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update",
            f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri(),
        ]  # fmt: skip
        dom = subprocess.run(cmd, check=True, timeout=120, capture_output=True, text=True).stdout
        order[clicks] = re.search(r"<title>([^<]*)</title>", dom).group(1).split(",")
    finite = sorted((x for x in LAYERS if gn[x] is not None), key=lambda x: gn[x])
    assert order[1][: len(finite)] == finite
    assert order[2][: len(finite)] == finite[::-1]
    assert sorted(order[1]) == sorted(LAYERS)
