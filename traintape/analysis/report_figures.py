"""The report's figures: matplotlib drawn to self-contained PNG data URIs.

Each function reads what it draws (through the shared stats cache where the data are
stats) and returns ``data:image/png;base64,...`` or None when there is nothing to draw.
:func:`~traintape.analysis.summary.summarize` calls them once per report; the HTML
renderer only places them.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING

import numpy as np

from traintape.analysis._common import StatsCache, TensorSeries, _quiet, natural_key
from traintape.analysis.anomalies import AnomalyReport
from traintape.schema import Kind

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from traintape.core.reader import Run


def png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


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


def heatmap(steps: np.ndarray, layers: list[str], values: np.ndarray, title: str) -> str:
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
    return png(fig)


def _curves_fig(
    frame: pd.DataFrame,
    titles: dict[str, str] | None = None,
    scale: dict[str, float] | None = None,
    marks: dict[str, list[int]] | None = None,
    per_row: int = 3,
) -> str | None:
    """One small line plot per column of ``frame`` (index = step), ``per_row`` a row;
    ``titles``/``scale`` rename and rescale columns, ``marks`` draws vertical lines at
    steps of a column (e.g. memory spikes). None when ``frame`` has no columns."""
    import matplotlib.pyplot as plt

    cols = list(frame.columns)
    if not cols:
        return None
    n_rows = -(-len(cols) // per_row)
    width = min(len(cols), per_row)
    fig, axes = plt.subplots(n_rows, width, figsize=(min(5 * width, 15), 3 * n_rows), squeeze=False)
    for ax in axes.flat[len(cols) :]:
        ax.set_visible(False)
    for ax, c in zip(axes.flat, cols, strict=False):
        s = frame[c].dropna() * (scale or {}).get(c, 1.0)
        ax.plot(s.index, s.to_numpy(), lw=1.5)
        if len(s) and (s > 0).all() and s.max() / max(s.min(), 1e-30) > 50:
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # values as they are, no "+2.26e4"
        for step in (marks or {}).get(c, []):
            ax.axvline(step, color="#c0392b", lw=1, ls="--")
        ax.set_title((titles or {}).get(c, c))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return png(fig)


def metrics_fig(run: Run) -> str | None:
    """A curve per metric logged at two steps or more (one-point metrics are no curve:
    :func:`single_metrics` lists them)."""
    frame = run.metrics()
    many = [c for c in frame.columns if frame[c].notna().sum() >= 2]
    return _curves_fig(frame[many])


def single_metrics(run: Run) -> dict[str, tuple[int, float]]:
    """Metrics logged at one step only (HF's ``train/total_flos``, a final evaluation):
    ``{name: (step, value)}`` — a table, not an empty chart."""
    frame = run.metrics()
    out: dict[str, tuple[int, float]] = {}
    for c in frame.columns:
        col = frame[c].dropna()
        if len(col) == 1:
            out[c] = (int(col.index[0]), float(col.iloc[0]))
    return out


_SYSTEM_UNITS: dict[str, tuple[str, float]] = {
    "sys/step_time": ("step time (s)", 1.0),
    "sys/samples_per_s": ("samples / s", 1.0),
    "sys/cpu_percent": ("process CPU (%)", 1.0),
    "sys/rss_bytes": ("RSS (MiB)", 2.0**-20),
    "sys/mem_available_bytes": ("host memory available (MiB)", 2.0**-20),
    "sys/gpu_mem_allocated_bytes": ("GPU memory allocated (MiB)", 2.0**-20),
    "sys/gpu_mem_reserved_bytes": ("GPU memory reserved (MiB)", 2.0**-20),
    "sys/gpu_util_percent": ("GPU utilisation (%)", 1.0),
    "sys/bytes_written": ("traintape bytes written (MiB)", 2.0**-20),
}
"""System metrics the report plots (title, factor); ``sys/time`` is not plotted."""


def system_fig(run: Run, an: AnomalyReport) -> str | None:
    """Step time, throughput, CPU, memory (with ``memory_spike`` anomalies marked), GPU
    and bytes written, one plot each, for the system metrics the run has."""
    sysm = run.system()
    cols = [c for c in _SYSTEM_UNITS if c in sysm.columns and sysm[c].notna().any()]
    marks: dict[str, list[int]] = {}
    for a in an.of_type("memory_spike"):
        marks.setdefault(str(a.evidence.get("metric")), []).append(a.step)
    return _curves_fig(
        sysm[cols],
        titles={c: _SYSTEM_UNITS[c][0] for c in cols},
        scale={c: _SYSTEM_UNITS[c][1] for c in cols},
        marks=marks,
    )


WEIGHT_STATS = ("mean", "std", "min", "max")


def weight_tensors(run: Run, max_tensors: int = 8) -> list[str]:
    """The param tensors whose distributions the report draws (kernels first)."""
    names = run.tensor_names(Kind.PARAM)
    pick = [n for n in names if n.endswith(("kernel", "embedding", "kernel_ih"))] or names
    return sorted(pick, key=natural_key)[:max_tensors]


def weights_fig(run: Run, cache: StatsCache, max_tensors: int = 8) -> str | None:
    import matplotlib.pyplot as plt

    if Kind.PARAM not in run.kinds() or not run.rows:
        return None
    pick = weight_tensors(run, max_tensors)
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
    return png(fig)


def change_fig(steps: np.ndarray, layers: list[str], ratio: np.ndarray) -> str | None:
    """Per-step relative change ``‖update‖/‖param‖`` of (at most 12) layers, log scale."""
    import matplotlib.pyplot as plt

    if not layers or not len(steps):
        return None
    fig, ax = plt.subplots(figsize=(11, 3))
    for c, layer in enumerate(layers[:12]):
        ax.plot(steps, ratio[:, c], lw=1, label=layer)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title("per-step relative change ‖update‖/‖param‖ by layer")
    ax.legend(fontsize=7, ncol=4)
    ax.grid(alpha=0.3)
    return png(fig)


def want_weights(run: Run, cache: StatsCache) -> None:
    """Declare the param stats :func:`weights_fig` draws."""
    if Kind.PARAM in run.kinds():
        pick = weight_tensors(run)
        cache.want_reducer(("weights", tuple(pick)), TensorSeries(Kind.PARAM, pick, WEIGHT_STATS))


DIST_TENSORS = 6
"""Most tensors per kind whose distributions over time the report draws."""
DIST_STEPS = 40
"""Most snapshot steps a distribution figure reads per tensor (evenly spread)."""
DIST_BINS = 60
"""Value bins of a distribution figure."""
DIST_BYTES = 256 << 20
"""Most snapshot bytes the distribution figures read in all."""


def pick_tensors(run: Run, kind: Kind, pattern: str | None) -> list[str]:
    """The tensors of ``kind`` with snapshots whose distributions to draw: those matching
    the ``fnmatch`` ``pattern`` (default: :func:`weight_tensors`' choice), in natural
    order, at most :data:`DIST_TENSORS`."""
    import fnmatch

    if kind not in run.kinds():
        return []
    names = run.tensor_names(kind)
    if pattern:
        pick = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    else:
        pick = [n for n in names if n.endswith(("kernel", "embedding", "kernel_ih"))] or names
    pick = [n for n in sorted(pick, key=natural_key) if len(run.snapshot_steps(n, kind))]
    return pick[:DIST_TENSORS]


def distribution_fig(run: Run, kind: Kind, tensors: list[str]) -> str | None:
    """Per tensor, the histogram of its values' magnitudes ``log10 |x|`` at each snapshot
    step (at most :data:`DIST_STEPS` steps, :data:`DIST_BYTES` bytes in all) as a
    heatmap: one column per snapshot step, bins between the 0.5 and 99.5 percentiles over
    the steps read, colour = log10 of the fraction of values (exact zeros are counted in
    the caption). Magnitudes, because a gradient's scale moves by orders of magnitude
    over a run. None when no tensor has two snapshot steps."""
    import matplotlib.pyplot as plt

    budget = DIST_BYTES
    panels: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, float]] = []
    for name in tensors:
        steps = run.snapshot_steps(name, kind)
        if len(steps) < 2:
            continue
        steps = steps[np.unique(np.linspace(0, len(steps) - 1, DIST_STEPS).astype(int))]
        mags, zeros = [], 0.0
        for step in steps:
            x = np.asarray(run.snapshot(name, kind, int(step)), np.float64).ravel()
            budget -= x.nbytes
            if budget < 0:
                break
            a = np.abs(x[np.isfinite(x)])
            zeros = max(zeros, float((a == 0).mean()) if len(a) else 0.0)
            with np.errstate(divide="ignore"):
                mags.append(np.log10(a[a > 0]))
        if len(mags) < 2:
            break
        allv = np.concatenate(mags)
        lo, hi = np.percentile(allv, [0.5, 99.5]) if len(allv) else (0.0, 1.0)
        hi = hi if hi > lo else lo + 1.0
        edges = np.linspace(lo, hi, DIST_BINS + 1)
        hist = np.stack([np.histogram(v, edges)[0] / max(len(v), 1) for v in mags])
        panels.append((name, steps[: len(mags)], edges, hist, zeros))
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.9 * len(panels)), squeeze=False)
    for ax, (name, steps, edges, hist, zeros) in zip(axes[:, 0], panels, strict=True):
        with np.errstate(divide="ignore"):
            z = np.log10(np.where(hist > 0, hist, np.nan)).T
        ax.imshow(z, aspect="auto", origin="lower", cmap="magma", interpolation="nearest",
                  extent=(-0.5, len(steps) - 0.5, edges[0], edges[-1]))  # fmt: skip
        ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 10)).astype(int))
        ax.set_xticks(ticks, [str(int(steps[t])) for t in ticks])
        extra = f"; up to {zeros:.0%} exact zeros" if zeros > 0 else ""
        ax.set_title(f"{kind.value} {name}: log10 |value| per snapshot step{extra}", fontsize=8)
        ax.set_ylabel("log10 |x|", fontsize=7)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("snapshot step")
    fig.tight_layout()
    return png(fig)


def grad_norm_lines_fig(
    steps: np.ndarray, layers: list[str], g: np.ndarray, most: int = 12
) -> str | None:
    """Per-layer gradient L2 norm over steps, one line each (log scale; the ``most``
    layers with the largest median norm when there are more)."""
    import matplotlib.pyplot as plt

    if not layers or not len(steps):
        return None
    g = np.asarray(g, np.float64)
    with _quiet(), np.errstate(all="ignore"):
        med = np.nanmedian(np.where(g > 0, g, np.nan), axis=0)
    order = np.argsort(-np.nan_to_num(med, nan=-np.inf))[:most]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for c in sorted(order.tolist()):
        y = np.where(g[:, c] > 0, g[:, c], np.nan)
        ax.plot(steps, y, lw=1, label=layers[c])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    title = "gradient L2 norm by layer"
    if len(layers) > most:
        title += f" (the {most} largest of {len(layers)})"
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=4)
    ax.grid(alpha=0.3)
    return png(fig)
