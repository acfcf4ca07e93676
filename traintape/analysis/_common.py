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


class LayerGroups:
    """The tensors of one kind grouped by layer, layers in forward order.

    :meth:`reduce` turns a per-tensor matrix ``[rows, tensor]`` (tensor axis in the
    store's order) into a per-layer one ``[rows, layer]`` with one vectorised pass
    (``ufunc.reduceat`` over the tensors sorted by layer).
    """

    def __init__(self, run: Run, kind: Kind | str) -> None:
        kind = Kind(kind)
        self.names: list[str] = run.tensor_names(kind)
        self.layers: list[str] = ordered_layers(run, kind)
        col = {layer: i for i, layer in enumerate(self.layers)}
        self.owner = np.array([col[layer_of(n)] for n in self.names], dtype=np.intp)
        self.perm = np.argsort(self.owner, kind="stable")
        counts = np.bincount(self.owner, minlength=len(self.layers))
        self.starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.intp)
        self.identity = bool(np.array_equal(self.perm, np.arange(len(self.owner))))
        self.single = bool((counts == 1).all())

    def members(self, layer: str) -> np.ndarray:
        """Tensor indices (store order) of ``layer``."""
        return np.flatnonzero(self.owner == self.layers.index(layer))

    def reduce(self, x: np.ndarray, how: str) -> np.ndarray:
        """``x [rows, tensor]`` → ``[rows, layer]`` float64, NaN where no tensor of the
        layer has a value.

        ``how``: ``norm`` (``sqrt(Σ x²)``, for ``l2``), ``sum``, ``mean``, ``max``, ``min``
        (over the layer's tensors that have a value).
        """
        if how not in REDUCTIONS:
            raise ValueError(f"unknown layer reduction {how!r}; use one of {REDUCTIONS}")
        xs = x if self.identity else x[:, self.perm]
        if not len(self.layers):
            return np.zeros((x.shape[0], 0))
        if self.single:
            return np.abs(xs) if how == "norm" else np.array(xs, dtype=np.float64)
        with np.errstate(all="ignore"):
            nan = np.isnan(xs)
            if how in ("max", "min"):
                f = np.fmax if how == "max" else np.fmin
                return f.reduceat(xs, self.starts, axis=1)
            seen = np.add.reduceat(~nan, self.starts, axis=1, dtype=np.intp)
            v = np.where(nan, 0.0, xs * xs if how == "norm" else xs)
            out = np.add.reduceat(v, self.starts, axis=1)
            if how == "norm":
                out = np.sqrt(out)
            elif how == "mean":
                out = out / np.maximum(seen, 1)
            out[seen == 0] = np.nan
            return out


REDUCTIONS = ("norm", "sum", "mean", "max", "min")

SERIES_FLOAT64_MAX = 8 << 20
"""Per-layer series with at most this many values (rows × layers) are kept in float64,
larger ones in float32 (the analyses report 3 significant digits)."""


class Reducer:
    """One pass's worth of work over the row blocks of one kind's stats array.

    :meth:`update` gets each block ``[rows, tensor, stat]`` (float64, NaN where the kind
    was not recorded) with the index of its first row; :attr:`value` is the result.
    """

    kind: Kind
    value: Any = None

    def begin(self, cache: StatsCache) -> None:
        """Called once before the first block."""

    def update(self, start: int, block: np.ndarray) -> None:
        raise NotImplementedError


class LayerSeries(Reducer):
    """A statistic per layer over all rows: ``value`` is ``[rows, layer]`` (see
    :meth:`LayerGroups.reduce`; float64, or float32 beyond :data:`SERIES_FLOAT64_MAX`)."""

    def __init__(self, kind: Kind, stat: str, how: str) -> None:
        self.kind, self.stat, self.how = kind, stat, how

    def begin(self, cache: StatsCache) -> None:
        self.groups = cache.groups(self.kind)
        self.col = stat_index(cache.run, self.stat)
        n = cache.run.rows * len(self.groups.layers)
        dtype = np.float64 if n <= SERIES_FLOAT64_MAX else np.float32
        self.value = np.full((cache.run.rows, len(self.groups.layers)), np.nan, dtype=dtype)

    def update(self, start: int, block: np.ndarray) -> None:
        self.value[start : start + len(block)] = self.groups.reduce(block[:, :, self.col], self.how)


class TensorSeries(Reducer):
    """Some statistics of some tensors over all rows: ``value`` is
    ``[rows, len(tensors), len(stats)]`` float64."""

    def __init__(self, kind: Kind, tensors: Sequence[str], stats: Sequence[str]) -> None:
        self.kind, self.tensors, self.stats = kind, list(tensors), list(stats)

    def begin(self, cache: StatsCache) -> None:
        names = cache.run.tensor_names(self.kind)
        self.idx = np.array([names.index(t) for t in self.tensors], dtype=np.intp)
        self.cols = np.array([stat_index(cache.run, s) for s in self.stats], dtype=np.intp)
        self.value = np.full((cache.run.rows, len(self.idx), len(self.cols)), np.nan)

    def update(self, start: int, block: np.ndarray) -> None:
        self.value[start : start + len(block)] = block[:, self.idx][:, :, self.cols]


class FirstPositive(Reducer):
    """Per tensor, the first row where statistic ``stat`` (a count such as ``nan_count``)
    is positive: ``value = (first_row [tensor] (-1: never), value_there [tensor],
    rows_positive [tensor])``."""

    def __init__(self, kind: Kind, stat: str) -> None:
        self.kind, self.stat = kind, stat

    def begin(self, cache: StatsCache) -> None:
        self.col = stat_index(cache.run, self.stat)
        n = len(cache.run.tensor_names(self.kind))
        self.value = (np.full(n, -1, dtype=np.int64), np.zeros(n), np.zeros(n, dtype=np.int64))

    def update(self, start: int, block: np.ndarray) -> None:
        first, at, count = self.value
        cnt = block[:, :, self.col]
        bad = np.nan_to_num(cnt, nan=0.0) > 0
        count += bad.sum(axis=0)
        new = (first < 0) & bad.any(axis=0)
        if new.any():
            j = np.flatnonzero(new)
            r = np.argmax(bad[:, j], axis=0)
            first[j] = start + r
            at[j] = cnt[r, j]


class StatsCache:
    """Streams the stats arrays in row blocks and keeps what the analyses asked for.

    Analyses declare what they need (:meth:`want` a per-layer series, :meth:`want_reducer`
    any :class:`Reducer`); :meth:`load` then reads each kind's stats array **once**, one
    row block at a time (each block is dropped after its reducers have seen it, and the
    next block is read while the current one is reduced), so memory holds the results —
    per-layer series ``[rows, layer]`` — never a whole ``[rows, tensor, stat]`` array.
    A block is a whole number of the store's row chunks, at most ``block_rows`` rows and
    about ``block_bytes``. Each block read is one unit of ``tracker``'s progress. The
    report shares one cache between its sections, so each array is read once.
    """

    def __init__(
        self,
        run: Run,
        tracker: Tracker | None = None,
        block_rows: int = 4096,
        block_bytes: int = 32 << 20,
    ) -> None:
        self.run = run
        self.tracker = tracker or Tracker()
        self.chunk = run.manifest.layout.row_chunk
        self.block = self.chunk * max(1, -(-block_rows // self.chunk))
        self.block_bytes = block_bytes
        self._groups: dict[Kind, LayerGroups] = {}
        self._done: dict[tuple, Reducer] = {}
        self._pending: dict[tuple, Reducer] = {}

    def groups(self, kind: Kind | str) -> LayerGroups:
        kind = Kind(kind)
        if kind not in self._groups:
            self._groups[kind] = LayerGroups(self.run, kind)
        return self._groups[kind]

    def rows_per_block(self, kind: Kind | str) -> int:
        """Rows read at a time for ``kind``: whole chunks, ≤ ``block_rows``, ≈ block_bytes."""
        per_row = 8 * max(1, len(self.run.tensor_names(kind))) * len(self.run.manifest.stat_names)
        fit = self.chunk * max(1, self.block_bytes // (per_row * self.chunk))
        return min(self.block, fit)

    def _has(self, kind: Kind) -> bool:
        return kind in self.run.kinds() and bool(self.run.tensor_names(kind))

    def want_reducer(self, key: tuple, reducer: Reducer) -> None:
        """Ask for ``reducer`` (under ``key``) in the next :meth:`load`."""
        if self._has(reducer.kind) and key not in self._done and key not in self._pending:
            self._pending[key] = reducer

    def want(self, kind: Kind | str, stat: str, how: str) -> None:
        """Ask for the per-layer series of ``stat`` reduced by ``how`` (see
        :meth:`LayerGroups.reduce`)."""
        kind = Kind(kind)
        self.want_reducer(("layer", kind, stat, how), LayerSeries(kind, stat, how))

    def pending_blocks(self) -> int:
        """Units of work (row blocks) the next :meth:`load` reads."""
        kinds = {r.kind for r in self._pending.values()}
        return sum(-(-self.run.rows // self.rows_per_block(k)) for k in kinds if self.run.rows)

    def load(self) -> None:
        """Read every kind with pending requests once, block by block, feeding them."""
        by_kind: dict[Kind, list[tuple[tuple, Reducer]]] = {}
        for key, red in self._pending.items():
            by_kind.setdefault(red.kind, []).append((key, red))
        self._pending = {}
        from traintape.core.layout import stats_path

        for kind in sorted(by_kind, key=lambda k: KIND_RANK[k]):
            reds = by_kind[kind]
            for _, red in reds:
                red.begin(self)
            self.tracker.stage(f"reading {kind.value} stats")
            rows, step = self.run.rows, self.rows_per_block(kind)
            arr = self.run.array(stats_path(kind)) if rows else None
            starts = list(range(0, rows, step))
            fut = arr[0 : min(step, rows)].read() if starts and arr is not None else None
            for i, start in enumerate(starts):
                assert fut is not None and arr is not None
                block = np.asarray(fut.result(), dtype=np.float64)
                if i + 1 < len(starts):  # read ahead while this block is reduced
                    nxt = starts[i + 1]
                    fut = arr[nxt : min(nxt + step, rows)].read()
                for _, red in reds:
                    red.update(start, block)
                del block
                self.tracker.advance()
            for key, red in reds:
                self._done[key] = red

    def result(self, key: tuple, reducer: Reducer | None = None) -> Any:
        """The value of the reducer under ``key`` (asked for and loaded if needed)."""
        if key not in self._done:
            if reducer is not None:
                self.want_reducer(key, reducer)
            if key in self._pending:
                self.load()
        if key not in self._done:
            raise KeyError(f"{self.run.url}: nothing recorded for {key}")
        return self._done[key].value

    def series(self, kind: Kind | str, stat: str, how: str) -> np.ndarray:
        """Per-layer series ``[rows, layer]`` of ``stat`` reduced by ``how``."""
        kind = Kind(kind)
        return self.result(("layer", kind, stat, how), LayerSeries(kind, stat, how))


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
    recorded at a row. Layers are in forward order. Streams the stats array of ``kind``
    (through ``cache`` when given, which keeps the result).
    """
    return layer_stat(run, kind, "l2", "norm", cache)


def layer_stat(
    run: Run, kind: Kind | str, stat: str, reduce: str = "mean", cache: StatsCache | None = None
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """A stat per layer over steps, combining a layer's tensors by ``reduce`` (norm, mean,
    max, min, sum; see :meth:`LayerGroups.reduce`): ``(steps, layers, values [rows, layer])``."""
    kind = Kind(kind)
    layers = ordered_layers(run, kind)
    if not run.tensor_names(kind) or run.rows == 0:
        return run.steps, layers, np.zeros((run.rows, len(layers)))
    cache = cache or StatsCache(run)
    return run.steps, layers, cache.series(kind, stat, reduce)


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


def _median_sorted(srt: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Median along the last axis of ``srt`` (sorted, NaNs last) with ``n`` finite values
    per lane (NaN where ``n == 0``)."""
    lo = np.maximum((n - 1) // 2, 0)[..., None]
    hi = np.maximum(n // 2 - (n == 0), 0)[..., None]
    with np.errstate(all="ignore"):
        med = 0.5 * (
            np.take_along_axis(srt, lo, axis=-1)[..., 0]
            + np.take_along_axis(srt, hi, axis=-1)[..., 0]
        )
    return np.where(n > 0, med, np.nan)


def column_median(
    x: np.ndarray, rows: slice | None = None, max_values: int = 4 << 20
) -> np.ndarray:
    """Median over rows of each column of ``x [rows, col]``, ignoring NaN/Inf (NaN for a
    column without finite values). Vectorised: columns are sorted in groups of at most
    ``max_values`` values (a partition when a group has no missing values)."""
    x = x if rows is None else x[rows]
    if x.ndim == 1:
        return column_median(x[:, None], None, max_values)[0]
    n_rows, n_cols = x.shape
    out = np.full(n_cols, np.nan)
    if n_rows == 0:
        return out
    step = max(1, max_values // n_rows)
    for c in range(0, n_cols, step):
        blk = np.asarray(x[:, c : c + step], dtype=np.float64).T  # [cols, rows]
        fin = np.isfinite(blk)
        if fin.all():
            out[c : c + step] = np.median(blk, axis=1)
            continue
        blk = np.where(fin, blk, np.nan)
        out[c : c + step] = _median_sorted(np.sort(blk, axis=1), fin.sum(axis=1))
    return out


def rolling_median_mad(
    x: np.ndarray, window: int, max_values: int = 4 << 20
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Median, MAD and count of the finite values among the *preceding* ``window`` values.

    ``x`` is ``[rows]`` or ``[rows, col]`` (columns independent); returns three arrays of
    ``x``'s shape: ``median[t]``, ``mad[t]`` over ``x[t-window .. t-1]`` and the number of
    finite values there. Vectorised with ``sliding_window_view``, in row blocks of at most
    ``max_values`` window values (one sort per block for the median, one for the MAD).
    """
    if window < 1:
        raise ValueError(f"rolling window must be >= 1, got {window}")
    x = np.asarray(x, dtype=np.float64)
    shape = x.shape
    x2 = x.reshape(len(x), -1)
    n_rows, n_cols = x2.shape
    med = np.full((n_rows, n_cols), np.nan)
    mad = np.full((n_rows, n_cols), np.nan)
    cnt = np.zeros((n_rows, n_cols), dtype=np.int64)
    if n_rows == 0 or n_cols == 0:
        return med.reshape(shape), mad.reshape(shape), cnt.reshape(shape)
    xp = np.concatenate([np.full((window, n_cols), np.nan), np.where(np.isfinite(x2), x2, np.nan)])
    views = np.lib.stride_tricks.sliding_window_view(xp, window, axis=0)  # [rows+1, col, w]
    step = max(1, max_values // (n_cols * window))
    for s in range(0, n_rows, step):
        e = min(n_rows, s + step)
        w = np.sort(views[s:e], axis=-1)
        n = np.isfinite(w).sum(axis=-1)
        m = _median_sorted(w, n)
        with np.errstate(all="ignore"):
            dev = np.sort(np.abs(w - m[..., None]), axis=-1)
        med[s:e], mad[s:e], cnt[s:e] = m, _median_sorted(dev, n), n
    return med.reshape(shape), mad.reshape(shape), cnt.reshape(shape)


def robust_z(x: np.ndarray, window: int, min_periods: int | None = None) -> np.ndarray:
    """Robust rolling z-score of each value against the *preceding* ``window`` values.

    ``z_t = (x_t - median(x_{t-w..t-1})) / (1.4826 * MAD + eps)``, eps scaled to the
    window's magnitude so perfectly flat series don't divide by zero. NaN where fewer
    than ``min_periods`` (default: ``window``, a full history — the warm-up) finite
    predecessors exist or ``x_t`` is not finite. ``x`` is ``[rows]`` or ``[rows, col]``.
    """
    return robust_z_median(x, window, min_periods)[0]


def robust_z_median(
    x: np.ndarray, window: int, min_periods: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`robust_z` and the rolling median it is taken against (``x``'s shape)."""
    need = window if min_periods is None else min(min_periods, window)
    x = np.asarray(x, dtype=np.float64)
    med, mad, n = rolling_median_mad(x, window)
    eps = 1e-3 * (np.abs(med) + 1e-12)
    with np.errstate(all="ignore"):
        z = (x - med) / (1.4826 * mad + eps)
    return np.where((n >= max(need, 1)) & np.isfinite(x), z, np.nan), med


def finite_float(v: float | np.floating) -> float | None:
    """A JSON-safe float (None for NaN/Inf)."""
    f = float(v)
    return f if np.isfinite(f) else None
