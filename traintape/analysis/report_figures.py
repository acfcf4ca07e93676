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
