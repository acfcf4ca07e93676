"""Self-contained HTML report of a run (one file, no network: figures are base64 PNGs).

Sections: run info; metric curves; layer × step heatmaps of gradient norm and of the
update/param ratio (log10); weight-distribution evolution (mean ± std and min/max of each
kernel over steps); health table and each layer's health per window of steps (about
:data:`TREND_WINDOWS` windows); anomalies; parameter change (with LoRA runs' effective
update ΔW = s·A·B per adapted layer). Every name read from the store is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING

import numpy as np

from traintape.analysis._common import (
    ProgressCallback,
    StatsCache,
    TensorSeries,
    Tracker,
    _quiet,
    layer_norms,
    natural_key,
)
from traintape.analysis.anomalies import AnomalyReport, anomalies, want_anomalies
from traintape.analysis.change import LoraDelta, change_from_stats, parameter_change
from traintape.analysis.health import HealthReport, health
from traintape.analysis.health_trend import (
    HealthTrend,
    default_window,
    health_trend,
    want_health_trend,
)
from traintape.schema import Kind

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from traintape.core.reader import Run

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}.healthy{color:#1a7f37}.warning{color:#9a6700}.critical,.error{color:#cf222e;font-weight:600}
img{max-width:100%;display:block;margin:8px 0}.muted{color:#777}code{font-size:12px}
"""


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img(src: str, alt: str) -> str:
    return f'<img src="{src}" alt="{html.escape(alt)}">'


def _e(x: object) -> str:
    return html.escape(str(x))


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.3g}"


HEATMAP_ROWS = 96
"""Most layer rows a heatmap draws (more layers are averaged in consecutive groups)."""
HEATMAP_COLS = 1200
"""Most step columns a heatmap draws (more steps are averaged in consecutive bins)."""


def _bin_mean(z: np.ndarray, axis: int, most: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean (NaN-aware) over consecutive groups along ``axis`` so at most ``most``
    remain; also each group's first index."""
    n = z.shape[axis]
    if n <= most:
        return z, np.arange(n)
    k = -(-n // most)
    starts = np.arange(0, n, k)
    pad = len(starts) * k - n
    zz = np.moveaxis(z, axis, 0)
    zz = np.concatenate([zz, np.full((pad, *zz.shape[1:]), np.nan, dtype=zz.dtype)])
    zz = zz.reshape(len(starts), k, *zz.shape[1:])
    with np.errstate(all="ignore"), _quiet():
        out = np.nanmean(zz, axis=1)
    return np.moveaxis(out, 0, axis), starts


def _heatmap(steps: np.ndarray, layers: list[str], values: np.ndarray, title: str) -> str:
    """log10 of ``values [rows, layer]`` as layer × step; large runs are averaged (in
    log space) into at most :data:`HEATMAP_ROWS` × :data:`HEATMAP_COLS` cells, so the
    figure's size and memory do not grow with the run."""
    import matplotlib.pyplot as plt

    with np.errstate(all="ignore"):
        z = np.log10(np.where(values > 0, values, np.nan).astype(np.float32)).T
    z, _ = _bin_mean(z, 1, HEATMAP_COLS)
    z, first = _bin_mean(z, 0, HEATMAP_ROWS)
    if len(first) < len(layers):
        ends = [*(first[1:] - 1), len(layers) - 1]
        labels = [f"{layers[a]} … {layers[b]}" if b > a else layers[a]
                  for a, b in zip(first, ends, strict=True)]  # fmt: skip
        title += f" ({len(layers)} layers in {len(labels)} groups)"
    else:
        labels = list(layers)
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(labels) + 1.6))
    ext = (
        (float(steps[0]) - 0.5, float(steps[-1]) + 0.5, len(labels) - 0.5, -0.5)
        if len(steps)
        else None
    )
    im = ax.imshow(
        np.ma.masked_invalid(z), aspect="auto", cmap="viridis", interpolation="nearest", extent=ext
    )
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("step")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="log10")
    return _png(fig)


def _metrics_fig(run: Run) -> str | None:
    import matplotlib.pyplot as plt

    met = run.metrics()
    if not len(met.columns):
        return None
    cols = list(met.columns)
    fig, axes = plt.subplots(1, len(cols), figsize=(min(5 * len(cols), 15), 3), squeeze=False)
    for ax, c in zip(axes[0], cols, strict=True):
        s = met[c].dropna()
        ax.plot(s.index, s.to_numpy(), lw=1.5)
        if len(s) and (s > 0).all() and s.max() / max(s.min(), 1e-30) > 50:
            ax.set_yscale("log")
        ax.set_title(c)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _png(fig)


_WEIGHT_STATS = ("mean", "std", "min", "max")


def _weight_tensors(run: Run, max_tensors: int = 8) -> list[str]:
    """The param tensors whose distributions the report draws (kernels first)."""
    names = run.tensor_names(Kind.PARAM)
    pick = [n for n in names if n.endswith(("kernel", "embedding", "kernel_ih"))] or names
    return sorted(pick, key=natural_key)[:max_tensors]


def _weights_fig(run: Run, cache: StatsCache, max_tensors: int = 8) -> str | None:
    import matplotlib.pyplot as plt

    if Kind.PARAM not in run.kinds() or not run.rows:
        return None
    pick = _weight_tensors(run, max_tensors)
    data = cache.result(("weights", tuple(pick)))  # [rows, tensor, (mean, std, min, max)]
    steps = run.steps[: data.shape[0]]
    cols = min(4, len(pick))
    rows = int(np.ceil(len(pick) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.6 * rows), squeeze=False)
    for k, n in enumerate(pick):
        ax = axes[k // cols][k % cols]
        mean, std = data[:, k, 0], data[:, k, 1]
        ax.fill_between(
            steps,
            data[:, k, 2],
            data[:, k, 3],
            alpha=0.15,
            label="min..max",
        )
        ax.fill_between(steps, mean - std, mean + std, alpha=0.4, label="mean±std")
        ax.plot(steps, mean, lw=1)
        ax.set_title(n, fontsize=8)
        ax.tick_params(labelsize=7)
    for k in range(len(pick), rows * cols):
        axes[k // cols][k % cols].axis("off")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def _health_html(h: HealthReport) -> str:
    rows = []
    for lh in h.layers:
        iss = "; ".join(f"{i.type.value}: {i.message}" for i in lh.issues) or ""
        rows.append(
            f"<tr><td>{_e(lh.layer)}</td><td>{lh.score:.0f}</td>"
            f'<td class="{lh.status.value}">{lh.status.value}</td><td>{_fmt(lh.grad_norm)}</td>'
            f"<td>{_fmt(lh.rel_grad)}</td><td>{_fmt(lh.update_ratio)}</td>"
            f"<td>{_fmt(lh.act_zero_frac)}</td><td>{_e(iss)}</td></tr>"
        )
    run_iss = "".join(
        f'<li class="{i.severity.value}">{_e(i.type.value)}: {_e(i.message)} — '
        f'<span class="muted">{_e(i.recommendation)}</span></li>'
        for i in h.run_issues
    )
    recos = "".join(
        f"<li><b>{_e(i.type.value)}</b> ({_e(i.layer)}): {_e(i.recommendation)}</li>"
        for lh in h.layers
        for i in lh.issues[:1]
    )
    return (
        f'<p>Overall: <span class="{h.status.value}">{h.status.value}</span>, score {h.score:.0f}/100</p>'
        "<table><tr><th>layer</th><th>score</th><th>status</th><th>grad norm</th>"
        "<th>grad/param</th><th>update/param</th><th>act zero frac</th><th>issues</th></tr>"
        + "".join(rows)
        + "</table>"
        + (f"<ul>{run_iss}</ul>" if run_iss else "")
        + (f"<p>Recommendations:</p><ul>{recos}</ul>" if recos else "")
    )


TREND_WINDOWS = 10
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
            types = [i.type.value for i in lt.issues
                     if i.first_step <= w.first_step and w.last_step <= i.last_step]  # fmt: skip
            tip = ", ".join(types) or st.value
            cells.append(f'<td class="{st.value}" title="{_e(tip)}">{_MARK[st.value]}</td>')
        rows.append(f"<tr><td>{_e(lt.layer)}</td>{''.join(cells)}</tr>")
    changes = "".join(
        f"<li>{_e(lt.layer)}: <span class='{c.before.value}'>{c.before.value}</span> → "
        f"<span class='{c.after.value}'>{c.after.value}</span> at step {c.step}"
        + (f" ({_e(', '.join(i.value for i in c.issues))})" if c.issues else "")
        + "</li>"
        for lt in tr.layers
        for c in lt.changes
    )
    issues = "".join(
        f'<li class="{i.severity.value}">{_e(i.type.value)} {_e(i.layer or "run")}, steps '
        f"{i.first_step}..{i.last_step}: {_e(i.message)} — "
        f'<span class="muted">{_e(i.recommendation)}</span></li>'
        for i in sorted(tr.issues(), key=lambda i: i.first_step)
    )
    return (
        f"<h3>Health over time (windows of {tr.window} steps; columns: first step)</h3>"
        f"<table><tr><th>layer</th>{head}</tr>" + "".join(rows) + "</table>"
        + (f"<p>Status changes:</p><ul>{changes}</ul>" if changes else
           "<p>No layer changed status.</p>")
        + (f"<ul>{issues}</ul>" if issues else "")
    )  # fmt: skip


def _anomalies_html(a: AnomalyReport, limit: int = 100) -> str:
    if not a.anomalies:
        return "<p>No anomalies.</p>"
    rows = "".join(
        f'<tr><td>{x.step}</td><td>{_e(x.type)}</td><td class="{x.severity.value}">{x.severity.value}</td>'
        f"<td>{_e(x.kind.value if x.kind else '')}</td><td>{_e(x.tensor or x.layer or '')}</td>"
        f"<td>{_e(x.message)}</td></tr>"
        for x in a.anomalies[:limit]
    )
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
    return (
        first
        + "<table><tr><th>step</th><th>type</th><th>severity</th><th>kind</th><th>tensor/layer</th>"
        "<th>message</th></tr>" + rows + "</table>" + more
    )


def _change_html(run: Run, cache: StatsCache) -> tuple[str, str | None]:
    import matplotlib.pyplot as plt

    pc = parameter_change(run, max_pairs=20, progress=cache.tracker.child(), cache=cache)
    parts = []
    if pc.pairs:
        thr = [f"{t:g}" for t in pc.thresholds]
        rows = "".join(
            f"<tr><td>{p.step_old}→{p.step_new}</td><td>{_fmt(p.total.l2)}</td><td>{_fmt(p.total.relative)}</td>"
            f"<td>{_fmt(p.total.max)}</td>"
            + "".join(f"<td>{p.total.sparsity[t]:.3f}</td>" for t in thr)
            + "<td>"
            + _e(", ".join(f"{k}: {_fmt(v.relative)}" for k, v in p.per_component.items()))
            + "</td></tr>"
            for p in pc.pairs
        )
        parts.append(
            "<p>From full snapshots (Δ = θ_new − θ_old):</p><table><tr><th>steps</th><th>‖Δ‖₂</th>"
            "<th>relative</th><th>max |Δ|</th>"
            + "".join(f"<th>sparsity ≤{_e(t)}</th>" for t in thr)
            + "<th>relative by component</th></tr>"
            + rows
            + "</table>"
        )
    if pc.lora is not None and pc.lora.per_layer:
        parts.append(_lora_html(pc.lora))
    steps, layers, r = change_from_stats(run, cache)
    fig_src = None
    if layers and len(steps):
        fig, ax = plt.subplots(figsize=(11, 3))
        for c, layer in enumerate(layers[:12]):
            ax.plot(steps, r[:, c], lw=1, label=layer)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title("per-step relative change ‖update‖/‖param‖ by layer")
        ax.legend(fontsize=7, ncol=4)
        ax.grid(alpha=0.3)
        fig_src = _png(fig)
    if not parts:
        parts.append("<p class='muted'>No param snapshots: change shown from stats only.</p>")
    return "".join(parts), fig_src


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
    rows = "".join(
        f"<tr><td>{_e(k)}</td><td>{_e(x.component)}</td><td>{x.rank}</td><td>{_fmt(x.scale)}</td>"
        f"<td>{_fmt(x.norm)}</td><td>{_fmt(x.relative)}</td><td>{_fmt(x.effective_rank)}</td>"
        f"<td>{_fmt(x.energy[0] if x.energy else None)}</td><td>{_fmt(x.norm_bound)}</td></tr>"
        for k, x in layers[:LORA_ROWS]
    )
    more = (f"<p class='muted'>{len(layers) - LORA_ROWS} more adapters not shown</p>"
            if len(layers) > LORA_ROWS else "")  # fmt: skip
    comp = _e(", ".join(f"{k}: {_fmt(v.norm if v.norm is not None else v.norm_bound)}"
                        for k, v in d.per_component.items()))  # fmt: skip
    return (
        f"<p>LoRA effective update ΔW = s·A·B per adapted layer, {_e(where)}.{scale}</p>"
        "<table><tr><th>layer</th><th>component</th><th>r</th><th>s</th><th>‖ΔW‖_F</th>"
        "<th>‖ΔW‖/‖W_base‖</th><th>effective rank</th><th>σ₁² share</th>"
        "<th>bound s·‖A‖·‖B‖</th></tr>"
        + rows
        + "</table>"
        + more
        + f"<p>‖ΔW‖ by component (root-sum-square): {comp}</p>"
    )


_FIGURES = 5  # metrics, grad heatmap, ratio heatmap, weights, change curves


def render_report(run: Run, *, progress: ProgressCallback | None = None) -> str:
    """The HTML text of the report of ``run``.

    ``progress(stage, done, total)`` is called as work is done: a unit is one row block of
    a stats array read (each is read once, shared by all sections), one figure, one
    analysis (health, anomalies) and one tensor of a snapshot pair (parameter change).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    tracker = Tracker(progress)
    cache = StatsCache(run, tracker)
    # every section's stats are declared first, so each array is read once
    window = default_window(run.steps, TREND_WINDOWS)
    want_health_trend(run, cache, window)
    want_anomalies(run, cache)
    if Kind.PARAM in run.kinds():
        pick = _weight_tensors(run)
        cache.want_reducer(("weights", tuple(pick)), TensorSeries(Kind.PARAM, pick, _WEIGHT_STATS))
    tracker.add(cache.pending_blocks() + _FIGURES)
    cache.load()
    m = run.manifest
    p = m.producer
    steps = run.steps
    span = f"{int(steps[0])}..{int(steps[-1])}" if len(steps) else "none"
    info = (
        "<table>"
        + "".join(
            f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>"
            for k, v in [
                ("store", run.url),
                ("run id", m.run_id),
                ("status", m.status),
                (
                    "producer",
                    f"{p.framework or 'numpy'} {p.framework_version or ''} ({p.adapter or 'Recorder'})",
                ),
                ("steps", f"{run.rows} rows, steps {span}"),
                (
                    "tensors",
                    ", ".join(f"{k.value}: {len(run.tensor_names(k))}" for k in run.kinds()),
                ),
                ("metrics", ", ".join(m.metrics)),
                ("events", len(m.events)),
            ]
        )
        + "</table>"
    )
    body = [f"<h1>traintape report — {_e(m.run_id)}</h1>", "<h2>Run</h2>", info]
    tracker.stage("figures")
    mf = _metrics_fig(run)
    tracker.advance()
    body.append("<h2>Metrics</h2>" + (_img(mf, "metric curves") if mf else "<p>No metrics.</p>"))
    body.append("<h2>Gradient norm by layer</h2>")
    if Kind.GRAD in run.kinds() and run.rows:
        s, layers, g = layer_norms(run, Kind.GRAD, cache)
        body.append(
            _img(_heatmap(s, layers, g, "gradient L2 norm (log10), layer × step"), "grad heatmap")
        )
    else:
        body.append("<p>No gradients recorded.</p>")
    tracker.advance()
    body.append("<h2>Update / param ratio by layer</h2>")
    s, layers, r = change_from_stats(run, cache)
    if layers and run.rows:
        body.append(
            _img(_heatmap(s, layers, r, "‖update‖/‖param‖ (log10), layer × step"), "ratio heatmap")
        )
    else:
        body.append("<p>Needs param and update kinds.</p>")
    tracker.advance()
    wf = _weights_fig(run, cache)
    tracker.advance()
    body.append(
        "<h2>Weight distributions over steps</h2>"
        + (_img(wf, "weights") if wf else "<p>No params.</p>")
    )
    body.append(
        "<h2>Health</h2>"
        + _health_html(health(run, cache=cache))
        + _trend_html(health_trend(run, window, cache=cache))
    )
    body.append("<h2>Anomalies</h2>" + _anomalies_html(anomalies(run, cache=cache)))
    ch, chf = _change_html(run, cache)
    tracker.advance()
    body.append("<h2>Parameter change</h2>" + ch + (_img(chf, "parameter change") if chf else ""))
    tracker.finish()
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>traintape report {_e(m.run_id)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )


def write_report(run: Run, out: str, *, progress: ProgressCallback | None = None) -> str:
    """Write the report of ``run`` to ``out`` (one self-contained HTML file); returns out.

    ``progress``: see :func:`render_report`."""
    text = render_report(run, progress=progress)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out
