"""Self-contained HTML report of a run (one file, no network: figures are base64 PNGs),
and a Markdown summary of it.

HTML sections: run info; metric curves; layer × step heatmaps of gradient norm and of the
update/param ratio (log10); weight-distribution evolution (mean ± std and min/max of each
kernel over steps); health table and each layer's health per window of steps (about
:data:`TREND_WINDOWS` windows); the registered checks
(:mod:`~traintape.analysis.registry`); anomalies; parameter change (with LoRA runs'
effective update ΔW = s·A·B per adapted layer); a collapsible detail per layer (its
measures, issues, status per window, anomalies, checks and change per snapshot pair).
Tables sort by a click on a column header (a few lines of inline script; the page works
without it). Every name read from the store is HTML-escaped.

:func:`render_markdown`: run info, the health table (layers with issues first), the
registered checks, an anomalies summary and the largest parameter changes — text to paste
into an issue tracker.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from traintape.analysis._common import (
    ProgressCallback,
    layer_of,
)
from traintape.analysis.anomalies import AnomalyReport
from traintape.analysis.change import (
    LoraDelta,
    ParameterChange,
)
from traintape.analysis.health import HealthReport, LayerHealth
from traintape.analysis.health_trend import (
    HealthTrend,
)
from traintape.analysis.registry import CheckResult
from traintape.analysis.summary import RunSummary, summarize

if TYPE_CHECKING:
    from traintape.core.reader import Run

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}.healthy{color:#1a7f37}.warning{color:#9a6700}.critical,.error{color:#cf222e;font-weight:600}
img{max-width:100%;display:block;margin:8px 0}.muted{color:#777}code{font-size:12px}
table.sortable th{cursor:pointer;user-select:none}table.sortable th:after{content:" ⇅";color:#bbb}
table.sortable th[aria-sort=ascending]:after{content:" ▲";color:#444}
table.sortable th[aria-sort=descending]:after{content:" ▼";color:#444}
details{margin:2px 0}details>summary{cursor:pointer}details[open]{padding-bottom:6px}
details .body{margin-left:18px}
"""

# Click a header of a table.sortable to sort its body rows by that column (again: the
# other way). Cells sort by data-sort if set, else their text: numbers as numbers, other
# text in natural order; empty cells and "–" always last. No network, no dependencies.
_SORT_JS = """
document.querySelectorAll("table.sortable").forEach(function(t){
 var hs=t.tHead?t.tHead.rows[0].cells:[];
 Array.prototype.forEach.call(hs,function(th,i){th.addEventListener("click",function(){
  var asc=th.getAttribute("aria-sort")!=="ascending",b=t.tBodies[0];
  Array.prototype.forEach.call(hs,function(h){h.removeAttribute("aria-sort")});
  th.setAttribute("aria-sort",asc?"ascending":"descending");
  function key(r){var c=r.cells[i],v=c?(c.getAttribute("data-sort")||c.textContent).trim():"";
   if(v===""||v==="–")return null;var n=Number(v.replace("%",""));return isNaN(n)?v:n}
  var rows=Array.prototype.slice.call(b.rows);
  rows.sort(function(x,y){var a=key(x),c=key(y);if(a===null||c===null)return a===c?0:a===null?1:-1;
   var r=typeof a==="number"&&typeof c==="number"?a-c:typeof a==="number"?-1:typeof c==="number"?1:
    String(a).localeCompare(String(c),undefined,{numeric:true});return asc?r:-r});
  rows.forEach(function(r){b.appendChild(r)})})})});
"""

_RANK = {"healthy": 0, "info": 0, "warning": 1, "critical": 2, "error": 3}


def _table(head: list[str], rows: list[str], sortable: bool = True) -> str:
    """A table with a ``<thead>`` of the (escaped here) headers and a ``<tbody>`` of
    ``rows`` (each already ``<tr>…</tr>``); sortable by a header click."""
    cls = ' class="sortable"' if sortable else ""
    ths = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f"<table{cls}><thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _status_td(status: str) -> str:
    return f'<td class="{_e(status)}" data-sort="{_RANK.get(status, 0)}">{_e(status)}</td>'


def _img(src: str, alt: str) -> str:
    return f'<img src="{src}" alt="{html.escape(alt)}">'


def _e(x: object) -> str:
    return html.escape(str(x))


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.3g}"


def _health_html(h: HealthReport) -> str:
    rows = []
    for lh in h.layers:
        iss = "; ".join(f"{i.type}: {i.message}" for i in lh.issues) or ""
        rows.append(
            f'<tr><td data-sort="{lh.depth}">{_e(lh.layer)}</td><td>{lh.score:.0f}</td>'
            f"{_status_td(lh.status.value)}<td>{_fmt(lh.grad_norm)}</td>"
            f"<td>{_fmt(lh.rel_grad)}</td><td>{_fmt(lh.update_ratio)}</td>"
            f"<td>{_fmt(lh.act_zero_frac)}</td><td>{_e(iss)}</td></tr>"
        )
    run_iss = "".join(
        f'<li class="{i.severity.value}">{_e(i.type)}: {_e(i.message)} — '
        f'<span class="muted">{_e(i.recommendation)}</span></li>'
        for i in h.run_issues
    )
    recos = "".join(
        f'<li class="{r.severity.value}"><b>{_e(r.type)}</b> ({_e(", ".join(r.layers))}): '
        f"{_e(r.recommendation)}</li>"
        for r in h.recommendations()
        if r.severity != "info"
    )
    head = ["layer", "score", "status", "grad norm", "grad/param", "update/param",
            "act zero frac", "issues"]  # fmt: skip
    return (
        f'<p>Overall: <span class="{h.status.value}">{h.status.value}</span>, score {h.score:.0f}/100</p>'
        + _table(head, rows)
        + (f"<ul>{run_iss}</ul>" if run_iss else "")
        + (f"<p>Recommendations:</p><ul>{recos}</ul>" if recos else "")
    )


def _values_text(values: dict[str, float | None], most: int = 6) -> str:
    shown = ", ".join(f"{k}: {_fmt(v)}" for k, v in list(values.items())[:most])
    return shown + (f", … ({len(values)} in all)" if len(values) > most else "")


def _checks_html(results: list[CheckResult]) -> str:
    """The registered checks: a row per check, then a collapsible detail of each one
    with per-layer values or issues (its values in full, its issues with advice)."""
    if not results:
        return (
            "<p class='muted'>No checks registered (see <code>traintape.analysis.registry"
            "</code>: a decorator, or the entry-point group <code>traintape.checks</code>).</p>"
        )
    rows = []
    for c in results:
        what = (
            _e(c.error)
            if c.error is not None
            else _e("; ".join(f"{i.severity}: {i.message}" for i in c.issues[:3]))
            + (f" … {len(c.issues) - 3} more" if len(c.issues) > 3 else "")
        )
        rows.append(
            f"<tr><td>{_e(c.name)}</td><td>{_e(c.kind)}</td>{_status_td(c.status)}"
            f"<td>{_fmt(c.value)}{(' ' + _e(c.unit)) if c.unit and c.value is not None else ''}"
            f"</td><td>{_e(_values_text(c.values))}</td><td>{what}</td>"
            f"<td>{_e(c.description)}</td></tr>"
        )
    details = []
    for c in results:
        if not c.values and not c.issues:
            continue
        vals = _table(
            ["layer / tensor", "value"],
            [f"<tr><td>{_e(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in c.values.items()],
        ) if c.values else ""  # fmt: skip
        iss = _table(
            ["severity", "where", "step", "message", "recommendation"],
            [
                f"<tr>{_status_td(i.severity)}<td>{_e(i.layer or 'run')}</td>"
                f"<td>{'' if i.step is None else i.step}</td><td>{_e(i.message)}</td>"
                f"<td>{_e(i.recommendation)}</td></tr>"
                for i in c.issues
            ],
        ) if c.issues else ""  # fmt: skip
        details.append(
            f"<details><summary>{_e(c.name)}: {len(c.values)} values, "
            f"{len(c.issues)} issues</summary><div class='body'>{vals}{iss}</div></details>"
        )
    return _table(
        ["check", "kind", "status", "value", "values", "issues / error", "about"], rows
    ) + "".join(details)


def _layer_details(
    h: HealthReport,
    tr: HealthTrend | None,
    a: AnomalyReport,
    pc: ParameterChange | None,
    checks: list[CheckResult],
) -> str:
    """A collapsible ``<details>`` per layer (forward order): its measures, issues with
    recommendations and evidence, status per window, anomalies, checks' values and
    issues, and its change per snapshot pair."""
    trend = {lt.layer: lt for lt in tr.layers} if tr is not None and len(tr.windows) >= 2 else {}
    by_layer: dict[str, list] = {}
    for x in a.anomalies:
        where = x.layer or (layer_of(x.tensor) if x.tensor else None)
        if where is not None:
            by_layer.setdefault(where, []).append(x)
    out = []
    for lh in h.layers:
        parts = [_layer_measures(lh)]
        if lh.issues:
            parts.append(
                "<ul>"
                + "".join(
                    f'<li class="{i.severity.value}">{_e(i.type)}: {_e(i.message)} — '
                    f'<span class="muted">{_e(i.recommendation)}</span>'
                    + (f"<br><code>{_e(_evidence(i.evidence))}</code>" if i.evidence else "")
                    + "</li>"
                    for i in lh.issues
                )
                + "</ul>"
            )
        lt = trend.get(lh.layer)
        if lt is not None and tr is not None:
            marks = "".join(
                f'<span class="{st.value}" title="steps {w.first_step}..{w.last_step}: '
                f'{st.value}">{_MARK[st.value]}</span>'
                for w, st in zip(tr.windows, lt.status, strict=True)
            )
            parts.append(f"<p>Status per window of {tr.window} steps: {marks}</p>")
        an = by_layer.get(lh.layer, [])
        if an:
            parts.append(
                f"<p>Anomalies ({len(an)}):</p>"
                + _table(
                    ["step", "type", "severity", "tensor", "message"],
                    [
                        f"<tr><td>{x.step}</td><td>{_e(x.type)}</td>{_status_td(x.severity.value)}"
                        f"<td>{_e(x.tensor or '')}</td><td>{_e(x.message)}</td></tr>"
                        for x in an[:20]
                    ],
                )
            )
        mine = [
            (c, c.values.get(lh.layer), [i for i in c.issues if i.layer == lh.layer])
            for c in checks
        ]
        mine = [(c, v, iss) for c, v, iss in mine if v is not None or iss]
        if mine:
            parts.append(
                "<p>Checks: "
                + "; ".join(
                    f"{_e(c.name)}"
                    + (f" = {_fmt(v)}" if v is not None else "")
                    + "".join(f" — <span class='{i.severity}'>{_e(i.message)}</span>" for i in iss)
                    for c, v, iss in mine
                )
                + "</p>"
            )
        ch = [
            (p, p.per_layer[lh.layer]) for p in (pc.pairs if pc else []) if lh.layer in p.per_layer
        ]
        if ch:
            parts.append(
                "<p>Change between snapshots:</p>"
                + _table(
                    ["steps", "‖Δ‖₂", "relative", "max |Δ|", "mean Δ", "std Δ"],
                    [
                        f'<tr><td data-sort="{p.step_old}">{p.step_old}→{p.step_new}</td>'
                        f"<td>{_fmt(c.l2)}</td><td>{_fmt(c.relative)}</td><td>{_fmt(c.max)}</td>"
                        f"<td>{_fmt(c.mean)}</td><td>{_fmt(c.std)}</td></tr>"
                        for p, c in ch
                    ],
                )
            )
        st = lh.status.value
        out.append(
            f"<details><summary><span class='{st}'>{_MARK[st]} {_e(st)}</span> "
            f"<b>{_e(lh.layer)}</b> — score {lh.score:.0f}"
            + (f", {_e(', '.join(i.type for i in lh.issues))}" if lh.issues else "")
            + (" (frozen)" if lh.frozen else "")
            + f"</summary><div class='body'>{''.join(parts)}</div></details>"
        )
    return "".join(out) or "<p>No layers.</p>"


def _evidence(ev: dict) -> str:
    return ", ".join(f"{k}={_fmt(v) if isinstance(v, float) else v}" for k, v in ev.items())


def _layer_measures(lh: LayerHealth) -> str:
    rows = [
        ("grad norm (median)", lh.grad_norm), ("grad norm std/mean", lh.grad_norm_cv),
        ("grad/param", lh.rel_grad), ("update/param", lh.update_ratio),
        ("grad growth (last/first quarter)", lh.grad_growth),
        ("activation zero fraction", lh.act_zero_frac),
    ]  # fmt: skip
    if lh.lora is not None:
        rows += [
            (f"LoRA {lh.lora.part} effective grad/param", lh.lora.rel_grad),
            (f"LoRA {lh.lora.part} effective update ratio", lh.lora.update_ratio),
        ]
    cells = "".join(
        f"<tr><th>{_e(k)}</th><td>{_fmt(v)}</td></tr>" for k, v in rows if v is not None
    )
    return f"<table>{cells}</table>" if cells else "<p class='muted'>Nothing measured.</p>"


"""About how many windows of steps the report's health-over-time table has."""

_MARK = {"healthy": "·", "warning": "▲", "critical": "✖"}


def _trend_html(tr: HealthTrend) -> str:
    """Each layer's status per window (a cell per window, its issues as the tooltip), the
    changes of status and the issues with the steps they span."""
    if len(tr.windows) < 2:
        return ""
    head = "".join(f"<th>{w.first_step}</th>" for w in tr.windows)
    rows = []
    for lt in tr.layers:
        cells = []
        for w, st in zip(tr.windows, lt.status, strict=True):
            types = [str(i.type) for i in lt.issues
                     if (i.first_step or 0) <= w.first_step <= w.last_step <= (i.last_step or 0)]  # fmt: skip
            tip = ", ".join(types) or st.value
            cells.append(f'<td class="{st.value}" title="{_e(tip)}">{_MARK[st.value]}</td>')
        rows.append(f"<tr><td>{_e(lt.layer)}</td>{''.join(cells)}</tr>")
    changes = "".join(
        f"<li>{_e(lt.layer)}: <span class='{c.before.value}'>{c.before.value}</span> → "
        f"<span class='{c.after.value}'>{c.after.value}</span> at step {c.step}"
        + (f" ({_e(', '.join(str(i) for i in c.issues))})" if c.issues else "")
        + "</li>"
        for lt in tr.layers
        for c in lt.changes
    )
    issues = "".join(
        f'<li class="{i.severity.value}">{_e(i.type)} {_e(i.layer or "run")}, steps '
        f"{i.first_step}..{i.last_step}: {_e(i.message)} — "
        f'<span class="muted">{_e(i.recommendation)}</span></li>'
        for i in sorted(tr.issues(), key=lambda i: i.first_step or 0)
    )
    return (
        f"<h3>Health over time (windows of {tr.window} steps; columns: first step)</h3>"
        f"<table><thead><tr><th>layer</th>{head}</tr></thead><tbody>" + "".join(rows)
        + "</tbody></table>"
        + (f"<p>Status changes:</p><ul>{changes}</ul>" if changes else
           "<p>No layer changed status.</p>")
        + (f"<ul>{issues}</ul>" if issues else "")
    )  # fmt: skip


def _anomalies_html(a: AnomalyReport, limit: int = 100) -> str:
    if not a.anomalies:
        return "<p>No anomalies.</p>"
    rows = [
        f"<tr><td>{x.step}</td><td>{_e(x.type)}</td>{_status_td(x.severity.value)}"
        f"<td>{_e(x.kind.value if x.kind else '')}</td><td>{_e(x.tensor or x.layer or '')}</td>"
        f"<td>{_e(x.message)}</td></tr>"
        for x in a.anomalies[:limit]
    ]
    first = ""
    if a.first_nonfinite is not None:
        f = a.first_nonfinite
        first = (
            f'<p class="error">First non-finite value: step {f.step}, '
            f"{_e(f.kind.value if f.kind else 'metric')} {_e(f.tensor)}</p>"
        )
    more = (
        f"<p class='muted'>{len(a.anomalies) - limit} more not shown</p>"
        if len(a.anomalies) > limit
        else ""
    )
    head = ["step", "type", "severity", "kind", "tensor/layer", "message"]
    return first + _table(head, rows) + more


def _change_html(pc: ParameterChange) -> str:
    """The parameter-change tables: per snapshot pair, and LoRA's effective update."""
    parts = []
    if pc.pairs:
        thr = [f"{t:g}" for t in pc.thresholds]
        rows = [
            f'<tr><td data-sort="{p.step_old}">{p.step_old}→{p.step_new}</td>'
            f"<td>{_fmt(p.total.l2)}</td><td>{_fmt(p.total.relative)}</td>"
            f"<td>{_fmt(p.total.max)}</td><td>{_fmt(p.total.mean)}</td><td>{_fmt(p.total.std)}</td>"
            + "".join(f"<td>{p.total.sparsity[t]:.3f}</td>" for t in thr)
            + "<td>"
            + _e(", ".join(f"{k}: {_fmt(v.relative)}" for k, v in p.per_component.items()))
            + "</td></tr>"
            for p in pc.pairs
        ]
        head = ["steps", "‖Δ‖₂", "relative", "max |Δ|", "mean Δ", "std Δ",
                *(f"sparsity ≤{t}" for t in thr), "relative by component"]  # fmt: skip
        parts.append("<p>From full snapshots (Δ = θ_new − θ_old):</p>" + _table(head, rows))
    if pc.lora is not None and pc.lora.per_layer:
        parts.append(_lora_html(pc.lora))
    if not parts:
        parts.append("<p class='muted'>No param snapshots: change shown from stats only.</p>")
    return "".join(parts)


LORA_ROWS = 40
"""Most adapters the LoRA table lists (the largest ‖ΔW‖ first; the rest are counted)."""


def _lora_html(d: LoraDelta) -> str:
    """The LoRA effective-update table (:func:`~traintape.analysis.change.lora_delta`)."""
    where = (f"from snapshots at step {d.step}" if d.from_snapshots
             else f"stats only (no snapshots), step {d.step}")  # fmt: skip
    scale = ("" if d.scale_known else
             " The run does not record PEFT's scale s (lora_alpha / r): values are up to s "
             "(record it with <code>Recorder(user={'lora_alpha': …})</code>).")  # fmt: skip
    layers = sorted(d.per_layer.items(), key=lambda kv: -(kv[1].norm or kv[1].norm_bound or 0))
    rows = [
        f"<tr><td>{_e(k)}</td><td>{_e(x.component)}</td><td>{x.rank}</td><td>{_fmt(x.scale)}</td>"
        f"<td>{_fmt(x.norm)}</td><td>{_fmt(x.relative)}</td><td>{_fmt(x.effective_rank)}</td>"
        f"<td>{_fmt(x.energy[0] if x.energy else None)}</td><td>{_fmt(x.norm_bound)}</td></tr>"
        for k, x in layers[:LORA_ROWS]
    ]
    more = (f"<p class='muted'>{len(layers) - LORA_ROWS} more adapters not shown</p>"
            if len(layers) > LORA_ROWS else "")  # fmt: skip
    comp = _e(", ".join(f"{k}: {_fmt(v.norm if v.norm is not None else v.norm_bound)}"
                        for k, v in d.per_component.items()))  # fmt: skip
    return (
        f"<p>LoRA effective update ΔW = s·A·B per adapted layer, {_e(where)}.{scale}</p>"
        + _table(
            [
                "layer",
                "component",
                "r",
                "s",
                "‖ΔW‖_F",
                "‖ΔW‖/‖W_base‖",
                "effective rank",
                "σ₁² share",
                "bound s·‖A‖·‖B‖",
            ],
            rows,
        )
        + more
        + f"<p>‖ΔW‖ by component (root-sum-square): {comp}</p>"
    )


_FIGURES = 5  # metrics, grad heatmap, ratio heatmap, weights, change curves


def render_report(
    run: Run, *, progress: ProgressCallback | None = None, tensors: str | None = None
) -> str:
    """The HTML text of the report of ``run``: :func:`to_html` of its
    :func:`~traintape.analysis.summary.summarize` (with figures).

    ``progress(stage, done, total)`` is called as work is done: a unit is one row block of
    a stats array read (each is read once, shared by all sections), one figure, one
    analysis (health, anomalies) and one tensor of a snapshot pair (parameter change).
    ``tensors``: ``fnmatch`` pattern of the tensors whose grad and param distributions
    over time are drawn from snapshots (default: the kernels).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    return to_html(summarize(run, figures=True, tensors=tensors, progress=progress))


def _figure(summary: RunSummary, name: str, alt: str, missing: str) -> str:
    src = summary.figures.get(name)
    return _img(src, alt) if src else f"<p>{missing}</p>"


def _distributions(summary: RunSummary) -> str:
    """The value distributions over time of the chosen tensors (from snapshots)."""
    parts = [
        _img(src, f"{kind} distributions")
        for kind in ("grad", "param")
        if (src := summary.figures.get(f"{kind}_distribution"))
    ]
    if not parts:
        return "<p class='muted'>No tensor with two snapshot steps: no distributions.</p>"
    return "<h3>Value distributions over time (snapshots)</h3>" + "".join(parts)


def _single_metrics_html(single: dict[str, tuple[int, float]]) -> str:
    """Metrics logged once, as a table (no empty one-point chart)."""
    if not single:
        return ""
    rows = [f"<tr><td>{_e(k)}</td><td>{step}</td><td>{value:.6g}</td></tr>"
            for k, (step, value) in single.items()]  # fmt: skip
    return "<p>Logged at one step only:</p>" + _table(["metric", "step", "value"], rows)


def to_html(summary: RunSummary) -> str:
    """The self-contained HTML report of a :class:`~traintape.analysis.summary.RunSummary`
    (pure: no reading, no analysis)."""
    h, an, tr = summary.health, summary.anomalies, summary.trend
    info = "<table>" + "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in summary.info
    ) + "</table>"  # fmt: skip
    sys_fig = summary.figures.get("system")
    system = (
        _img(sys_fig, "system metrics")
        + "<p class='muted'>Dashed lines: memory spikes (anomalies).</p>"
        if sys_fig
        else "<p>No system metrics recorded.</p>"
    )
    pc = summary.change
    change = _change_html(pc) if pc is not None else ""
    change_fig = summary.figures.get("change")
    body = [
        f"<h1>traintape report — {_e(summary.run_id)}</h1>", "<h2>Run</h2>", info,
        "<h2>Metrics</h2>" + _figure(summary, "metrics", "metric curves", "No metric curves.")
        + _single_metrics_html(summary.single_metrics),
        "<h2>System</h2>" + system,
        "<h2>Gradient norm by layer</h2>"
        + _figure(summary, "grad_heatmap", "grad heatmap", "No gradients recorded.")
        + (_img(lines, "grad norm lines") if (lines := summary.figures.get("grad_lines")) else ""),
        "<h2>Update / param ratio by layer</h2>"
        + _figure(summary, "ratio_heatmap", "ratio heatmap", "Needs param and update kinds."),
        "<h2>Weight distributions over steps</h2>"
        + _figure(summary, "weights", "weights", "No params.")
        + _distributions(summary),
        "<h2>Health</h2>" + _health_html(h) + (_trend_html(tr) if tr is not None else ""),
        "<h2>Checks</h2>" + _checks_html(h.checks),
        "<h2>Anomalies</h2>" + _anomalies_html(an),
        "<h2>Parameter change</h2>" + change
        + (_img(change_fig, "parameter change") if change_fig else ""),
        "<h2>Layers</h2><p class='muted'>Each layer's detail (click to open).</p>"
        + _layer_details(h, tr, an, pc, h.checks),
    ]  # fmt: skip
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>traintape report {_e(summary.run_id)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(body)
        + f"<script>{_SORT_JS}</script></body></html>\n"
    )


# ------------------------------------------------------------------------- Markdown

MD_LAYERS = 40
"""Most layers the Markdown health table lists (those with issues first)."""
MD_ANOMALIES = 15
"""Most anomalies the Markdown summary lists (errors and warnings first)."""
MD_TOP = 10
"""Layers in the Markdown's largest-change table."""

_MD_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_[]<>|#~"} | {"\n": " ", "\r": " "})


def _md(x: object) -> str:
    """Free text from a store, inert in Markdown: its special characters escaped (HTML
    too: ``<`` ``>``), line breaks made spaces — safe in a table cell."""
    return str(x).translate(_MD_SPECIAL)


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _md_health(h: HealthReport) -> list[str]:
    sev = {"critical": 0, "warning": 1, "healthy": 2}
    layers = sorted(h.layers, key=lambda lh: (sev[lh.status.value], lh.depth))
    shown = layers[:MD_LAYERS]
    lines = [f"**{h.status.value}**, score {h.score:.0f}/100, {len(h.layers)} layers "
             f"over {h.steps} steps", ""]  # fmt: skip
    if shown:
        lines += _md_table(
            ["layer", "status", "score", "grad norm", "grad/param", "update/param", "issues"],
            [[_md(lh.layer), lh.status.value, f"{lh.score:.0f}", _fmt(lh.grad_norm),
              _fmt(lh.rel_grad), _fmt(lh.update_ratio),
              _md(", ".join(i.type for i in lh.issues))] for lh in shown],
        )  # fmt: skip
    if len(layers) > len(shown):
        lines += ["", f"… {len(layers) - len(shown)} more layers, all healthy, not shown."]
    issues = h.issues()
    if issues:
        lines += ["", "Issues:", ""]
        lines += [
            f"- **{i.severity.value}** {i.type} ({_md(i.layer or 'run')}): {_md(i.message)}"
            for i in issues[:MD_LAYERS]
        ]
        if len(issues) > MD_LAYERS:
            lines.append(f"- … {len(issues) - MD_LAYERS} more")
    recs = [r for r in h.recommendations() if r.severity != "info"]
    if recs:
        lines += ["", "Recommendations (each once, with the layers it applies to):", ""]
        lines += [f"- {r.type} ({_md(', '.join(r.layers))}): {_md(r.recommendation)}"
                  for r in recs]  # fmt: skip
    return lines


def _md_checks(results: list[CheckResult]) -> list[str]:
    rows = []
    for c in results:
        what = c.error if c.error is not None else "; ".join(
            f"{i.severity}: {i.message}" + (f" ({i.layer})" if i.layer else "") for i in c.issues
        )  # fmt: skip
        rows.append([_md(c.name), c.kind, c.status, _fmt(c.value),
                     _md(_values_text(c.values, 4)), _md(what)])  # fmt: skip
    return _md_table(["check", "kind", "status", "value", "values", "issues / error"], rows)


def _md_anomalies(a: AnomalyReport) -> list[str]:
    lines = [f"Summary: {_md(a.summary())}"]
    if not a.anomalies:
        return lines
    order = {"error": 0, "warning": 1, "info": 2}
    pick = sorted(a.anomalies, key=lambda x: (order[x.severity.value], x.step))[:MD_ANOMALIES]
    pick.sort(key=lambda x: x.step)
    lines.append("")
    lines += _md_table(
        ["step", "type", "severity", "where", "message"],
        [[str(x.step), _md(x.type), x.severity.value,
          _md(" ".join(v for v in (x.kind.value if x.kind else "", x.tensor or x.layer or "") if v)),
          _md(x.message)] for x in pick],
    )  # fmt: skip
    if len(a.anomalies) > len(pick):
        lines += ["", f"… {len(a.anomalies) - len(pick)} more (`traintape anomalies RUN`)."]
    return lines


def _md_change(h: HealthReport, pc: ParameterChange | None) -> list[str]:
    """The layers that changed most: from the first to the last param snapshot, else
    (stats only) by median update/param ratio."""
    if pc is not None and pc.pairs:
        p = pc.pairs[0]
        top = sorted(p.per_layer.items(), key=lambda kv: -(kv[1].relative or 0))[:MD_TOP]
        lines = [f"From param snapshots, Δ = θ(step {p.step_new}) − θ(step {p.step_old}); "
                 f"in total ‖Δ‖₂ {_fmt(p.total.l2)}, relative {_fmt(p.total.relative)}.", ""]  # fmt: skip
        return lines + _md_table(
            ["layer", "‖Δ‖₂", "‖Δ‖/‖θ‖", "max abs Δ", "mean Δ", "std Δ"],
            [[_md(k), _fmt(c.l2), _fmt(c.relative), _fmt(c.max), _fmt(c.mean), _fmt(c.std)]
             for k, c in top],
        )  # fmt: skip
    ranked = sorted((lh for lh in h.layers if lh.update_ratio is not None),
                    key=lambda lh: -(lh.update_ratio or 0))[:MD_TOP]  # fmt: skip
    if not ranked:
        return ["No param snapshots and no update/param ratios recorded."]
    return [
        "No param snapshots: the layers with the largest median update/param ratio per step.",
        "",
        *_md_table(["layer", "update/param"],
                   [[_md(lh.layer), _fmt(lh.update_ratio)] for lh in ranked]),
    ]  # fmt: skip


def render_markdown(run: Run, *, progress: ProgressCallback | None = None) -> str:
    """A Markdown summary of ``run`` to paste into an issue tracker: :func:`to_markdown`
    of its :func:`~traintape.analysis.summary.summarize`.

    ``progress(stage, done, total)``: a unit is one row block of a stats array read, one
    analysis, one tensor of the snapshot pair."""
    return to_markdown(summarize(run, progress=progress))


def to_markdown(summary: RunSummary) -> str:
    """The Markdown summary of a :class:`~traintape.analysis.summary.RunSummary` (pure):
    run info, the health table (layers with issues first, at most :data:`MD_LAYERS`),
    issues and each recommendation once, the registered checks, an anomalies summary (at
    most :data:`MD_ANOMALIES`) and the :data:`MD_TOP` layers that changed most (first to
    last param snapshot; without snapshots, by update/param ratio). Text from the store
    is escaped."""
    h = summary.health
    lines = [f"## traintape report: {_md(summary.run_id)}", ""]
    lines += _md_table(["", ""], [[k, _md(v)] for k, v in summary.info])
    lines += ["", "### Health", "", *_md_health(h)]
    if h.checks:
        lines += ["", "### Checks", "", *_md_checks(h.checks)]
    lines += ["", "### Anomalies", "", *_md_anomalies(summary.anomalies)]
    lines += ["", "### Largest parameter changes", "", *_md_change(h, summary.change)]
    return "\n".join(lines) + "\n"


def write_report(
    run: Run, out: str, *, progress: ProgressCallback | None = None, tensors: str | None = None
) -> str:
    """Write the report of ``run`` to ``out`` (one self-contained HTML file); returns out.

    ``progress``, ``tensors``: see :func:`render_report`."""
    text = render_report(run, progress=progress, tensors=tensors)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out
