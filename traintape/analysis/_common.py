"""Shared helpers of the analyses: layer grouping, forward order, per-layer norm series.

Forward order: a store holds tensors in sorted canonical order. Where the producer knows
the order in which layers run, it may store it as ``manifest.forward_order`` (a
list of layer paths or tensor names). Otherwise layers are ordered *naturally* by their
path (integer segments compare as numbers, so ``layers/2`` runs before ``layers/10``),
which is the forward order of the usual ``layers/<i>`` / ``block_<i>`` naming.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from traintape.schema import Kind, split_name

if TYPE_CHECKING:
    from traintape.core.reader import Run

KIND_RANK = {
    Kind.PARAM: 0,
    Kind.ACTIVATION: 1,
    Kind.GRAD: 2,
    Kind.UPDATE: 3,
    Kind.OPT_STATE: 4,
}
"""Order in which data flows within one step: θ_t → activations → gradients → update."""

_SPLIT = re.compile(r"(\d+)")

ProgressCallback = Callable[[str, int, int], None]
"""``callback(stage, done, total)``: ``done`` of ``total`` units of work are finished and
``stage`` says what is being done now. Units are what the analysis counts (row blocks of
stats arrays read, tensors or snapshots compared, report sections); ``total`` may grow
while an analysis discovers work, and ``done == total`` at the end."""


class Tracker:
    """Counts units of work and reports them to an optional :data:`ProgressCallback`.

    :meth:`child` hands out a callback for a nested analysis: its units are added to this
    tracker's (so a report can show one bar over the analyses it runs).
    """

    def __init__(self, callback: ProgressCallback | None = None, total: int = 0) -> None:
        self.callback = callback
        self.total = total
        self.done = 0
        self.stage_name = ""
        self._children: list[list[int]] = []

    def _emit(self) -> None:
        if self.callback is not None:
            done = self.done + sum(c[0] for c in self._children)
            total = self.total + sum(c[1] for c in self._children)
            self.callback(self.stage_name, done, max(total, done))

    def add(self, n: int) -> None:
        """Announce ``n`` more units of work."""
        self.total += n
        self._emit()

    def stage(self, name: str) -> None:
        """Say what is being done now."""
        self.stage_name = name
        self._emit()

    def advance(self, n: int = 1) -> None:
        """Mark ``n`` units finished."""
        self.done += n
        self._emit()

    def child(self) -> ProgressCallback:
        """A callback for a nested analysis whose units count towards this tracker."""
        slot = [0, 0]
        self._children.append(slot)

        def callback(stage: str, done: int, total: int) -> None:
            slot[0], slot[1] = done, total
            self.stage_name = stage
            self._emit()

        return callback

    def finish(self) -> None:
        """Mark all announced work finished."""
        for c in self._children:
            c[0] = c[1] = max(c)
        self.done = self.total = max(self.total, self.done)
        self._emit()


class StatsCache:
    """Reads the stats array of each kind once, in row blocks, and keeps it.

    Analyses that look at one kind several ways (health reads activations six times) go
    through one cache; each row block read is one unit of ``tracker``'s progress. A block
    is a whole number of the store's row chunks (at least ``block_rows`` rows).
    """

    def __init__(self, run: Run, tracker: Tracker | None = None, block_rows: int = 4096) -> None:
        self.run = run
        self.tracker = tracker or Tracker()
        chunk = run.manifest.layout.row_chunk
        self.block = chunk * max(1, -(-block_rows // chunk))
        self._data: dict[Kind, np.ndarray] = {}

    def blocks(self, kinds: Sequence[Kind | str] | None = None) -> int:
        """Units of work to read ``kinds`` (default: all kinds of the run) not yet cached."""
        ks = self.run.kinds() if kinds is None else [Kind(k) for k in kinds]
        per = -(-self.run.rows // self.block) if self.run.rows else 0
        return sum(
            per
            for k in ks
            if k in self.run.kinds() and k not in self._data and self.run.tensor_names(k)
        )

    def get(self, kind: Kind | str) -> np.ndarray:
        """Stats ``[row, tensor, stat]`` of ``kind`` (all committed rows)."""
        kind = Kind(kind)
        if kind not in self._data:
            self.tracker.stage(f"reading {kind.value} stats")
            parts = []
            for start in range(0, self.run.rows, self.block):
                stop = min(start + self.block, self.run.rows)
                parts.append(self.run.stats_array(kind, rows=slice(start, stop)))
                self.tracker.advance()
            self._data[kind] = (
                np.concatenate(parts, axis=0) if parts else self.run.stats_array(kind)
            )
        return self._data[kind]


def _stats(run: Run, kind: Kind, cache: StatsCache | None) -> np.ndarray:
    return cache.get(kind) if cache is not None else run.stats_array(kind)


def natural_key(name: str) -> tuple:
    """Sort key comparing digit runs as integers (``layers/2`` < ``layers/10``)."""
    parts = _SPLIT.split(name)
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts if p != "")


def layer_of(name: str) -> str:
    """Layer path of a canonical tensor name (everything before the role leaf; '' for a
    root-level tensor), as :func:`traintape.schema.split_name` splits it."""
    return split_name(name)[0]


def stat_index(run: Run, stat: str) -> int:
    """Column of statistic ``stat`` in ``run``'s stats arrays, looked up by name in the
    store's own ``manifest.stat_names`` (a store may carry other statistics)."""
    names = run.manifest.stat_names
    try:
        return names.index(stat)
    except ValueError:
        raise KeyError(f"{run.url}: no statistic {stat!r} in this store; it has {names}") from None


def forward_rank(run: Run) -> dict[str, int]:
    """Map layer path (and tensor name, when given so) → position in forward order."""
    user = run.manifest.forward_order
    layers = sorted({layer_of(s.name) for s in run.manifest.tensors}, key=natural_key)
    rank: dict[str, int] = {}
    if isinstance(user, Sequence) and not isinstance(user, str):
        for i, entry in enumerate(user):
            rank.setdefault(str(entry), i)
        base = len(rank)
        for j, layer in enumerate(x for x in layers if x not in rank):
            rank[layer] = base + j
        return rank
    return {layer: i for i, layer in enumerate(layers)}


def tensor_rank(rank: dict[str, int], name: str) -> int:
    """Forward position of a tensor: its own entry, its layer's, or after everything."""
    if name in rank:
        return rank[name]
    layer = layer_of(name)
    while layer:
        if layer in rank:
            return rank[layer]
        layer = layer_of(layer)
    return len(rank) + 1


def ordered_layers(run: Run, kind: Kind | str) -> list[str]:
    """Layers having tensors of ``kind``, in forward order."""
    rank = forward_rank(run)
    layers = {layer_of(n) for n in run.tensor_names(kind)}
    return sorted(layers, key=lambda x: (tensor_rank(rank, x + "/_"), natural_key(x)))


def layer_norms(
    run: Run, kind: Kind | str, cache: StatsCache | None = None
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Per-layer L2 norm over steps: ``(steps [rows], layers, norms [rows, layer])``.

    A layer's norm is ``sqrt(sum of its tensors' l2**2)``; NaN where the kind was not
    recorded at a row. Layers are in forward order. Reads the stats array of ``kind`` only
    (through ``cache`` when given).
    """
    kind = Kind(kind)
    names = run.tensor_names(kind)
    layers = ordered_layers(run, kind)
    if not names or run.rows == 0:
        return run.steps, layers, np.zeros((run.rows, len(layers)))
    data = _stats(run, kind, cache)
    l2 = data[:, :, stat_index(run, "l2")]
    missing = np.isnan(data).all(axis=2)
    out = np.full((data.shape[0], len(layers)), np.nan)
    col = {layer: i for i, layer in enumerate(layers)}
    sq = np.zeros_like(out)
    seen = np.zeros(out.shape, dtype=bool)
    for j, n in enumerate(names):
        c = col[layer_of(n)]
        sq[:, c] += np.where(missing[:, j], 0.0, l2[:, j] ** 2)
        seen[:, c] |= ~missing[:, j]
    out[seen] = np.sqrt(sq[seen])
    return run.steps[: data.shape[0]], layers, out


def layer_stat(
    run: Run, kind: Kind | str, stat: str, reduce: str = "mean", cache: StatsCache | None = None
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """A stat per layer over steps, combining a layer's tensors by ``reduce`` (mean/max/sum)."""
    kind = Kind(kind)
    names = run.tensor_names(kind)
    layers = ordered_layers(run, kind)
    if not names or run.rows == 0:
        return run.steps, layers, np.zeros((run.rows, len(layers)))
    data = _stats(run, kind, cache)[:, :, stat_index(run, stat)]
    out = np.full((data.shape[0], len(layers)), np.nan)
    for c, layer in enumerate(layers):
        idx = [j for j, n in enumerate(names) if layer_of(n) == layer]
        block = data[:, idx]
        with np.errstate(all="ignore"), _quiet():
            if reduce == "max":
                out[:, c] = np.nanmax(block, axis=1)
            elif reduce == "sum":
                out[:, c] = np.where(np.isnan(block).all(axis=1), np.nan, np.nansum(block, axis=1))
            else:
                out[:, c] = np.nanmean(block, axis=1)
    return run.steps[: data.shape[0]], layers, out


class _quiet:
    """Silence numpy's 'all-NaN slice' RuntimeWarnings inside a block."""

    def __enter__(self) -> None:
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: Any) -> None:
        self._w.__exit__(*exc)


def nanmedian(x: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    with _quiet():
        return np.nanmedian(x, axis=axis)


def robust_z(x: np.ndarray, window: int, min_periods: int = 5) -> np.ndarray:
    """Robust rolling z-score of each value against the *preceding* ``window`` values.

    ``z_t = (x_t - median(x_{t-w..t-1})) / (1.4826 * MAD + eps)``, eps scaled to the
    window's magnitude so perfectly flat series don't divide by zero. NaN where fewer
    than ``min_periods`` finite predecessors exist or ``x_t`` is not finite.
    """
    x = np.asarray(x, dtype=np.float64)
    z = np.full(x.shape, np.nan)
    for t in range(len(x)):
        if not np.isfinite(x[t]):
            continue
        w = x[max(0, t - window) : t]
        w = w[np.isfinite(w)]
        if len(w) < min_periods:
            continue
        med = np.median(w)
        mad = np.median(np.abs(w - med))
        eps = 1e-3 * (abs(med) + 1e-12)
        z[t] = (x[t] - med) / (1.4826 * mad + eps)
    return z


def finite_float(v: float | np.floating) -> float | None:
    """A JSON-safe float (None for NaN/Inf)."""
    f = float(v)
    return f if np.isfinite(f) else None
