"""Health over time: the rules of :func:`~traintape.analysis.health` per window of steps.

Window ``k`` of a ``window`` of N steps covers optimizer steps ``[k·N, (k+1)·N)`` (aligned
to multiples of N, so ``--window 100`` gives 0..99, 100..199, ...); windows without a
recorded row are left out, and a window's ``first_step`` / ``last_step`` are the first
and last steps recorded in it. Within each window every layer gets the measures and
issues of :func:`~traintape.analysis.health` computed over that window's rows only, and:

- ``turbulence``: the coefficient of variation (std / mean) of the layer's gradient norm
  over the window (unitless; the window's ``grad_norm_cv``);
- ``max_pressure``: the largest per-step ``grad_norm / param_norm`` of the window (the
  hardest push the gradient gave the layer's weights; unitless);
- ``velocity``: ``d ln‖g‖ / d step`` at the window's centre, from a least-squares fit of
  ``ln(grad norm)`` by a quadratic in the step (per step: 0.01 ≈ growing 1 % a step);
- ``acceleration``: ``d² ln‖g‖ / d step²`` of the same fit (per step²).

These drive three issue types judged per window (thresholds in
:class:`~traintape.analysis.HealthThresholds`): TURBULENT (turbulence), PRESSURE_SPIKE
(max_pressure against the median grad/param ratio) and ACCELERATING (velocity rising
within the window). A layer's consecutive windows with the same issue form one
:class:`TrendIssue` (its worst window's message and evidence, with the steps it spans),
and :attr:`LayerTrend.changes` lists where the layer's status changed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import (
    ProgressCallback,
    StatsCache,
    Tracker,
)
from traintape.analysis.health import (
    GradTotals,
    LayerFacts,
    LayerHealth,
    _col_max,
    _load_series,
    _measure,
    _ratio_reduce,
    _score,
    _Series,
    run_context,
    want_health,
)
from traintape.analysis.health_model import HealthThresholds
from traintape.analysis.health_rules import RuleContext, judge
from traintape.analysis.issues import Issue, IssueType, Severity, Status, worst

if TYPE_CHECKING:
    from traintape.core.reader import Run


class StepWindow(BaseModel):
    """One window of steps: ``[index·N, (index+1)·N)``, of which ``rows`` are recorded."""

    index: int
    first_step: int = Field(description="first recorded step in the window")
    last_step: int = Field(description="last recorded step in the window")
    rows: int


class StatusChange(BaseModel):
    """A layer's status differs from the window before (``step``: the window's first)."""

    step: int
    before: Status
    after: Status
    issues: list[IssueType | str] = Field(default_factory=list, description="issues at ``step``")


TrendIssue = Issue
"""An issue of one layer (or of the run) over consecutive windows — the one
:class:`~traintape.analysis.issues.Issue` model with ``first_step``, ``last_step`` and
``windows`` set: severity, message and evidence of its worst window (the first of them
at that severity)."""


class LayerTrend(BaseModel):
    """One layer's health per window (lists are in window order, None: not measured)."""

    layer: str
    depth: int = Field(description="position in forward order, 0 = first")
    status: list[Status]
    score: list[float]
    grad_norm: list[float | None] = Field(description="median grad norm")
    rel_grad: list[float | None] = Field(description="median grad_norm / param_norm")
    update_ratio: list[float | None] = Field(description="median ‖Δθ‖/‖θ‖ per step")
    act_zero_frac: list[float | None]
    turbulence: list[float | None] = Field(description="grad-norm std / mean")
    max_pressure: list[float | None] = Field(description="max grad_norm / param_norm")
    velocity: list[float | None] = Field(description="d ln‖g‖ / d step at the centre")
    acceleration: list[float | None] = Field(description="d² ln‖g‖ / d step²")
    changes: list[StatusChange] = Field(default_factory=list)
    issues: list[TrendIssue] = Field(default_factory=list)


class HealthTrend(BaseModel):
    url: str
    window: int = Field(description="steps per window")
    steps: int = Field(description="recorded rows")
    windows: list[StepWindow]
    status: list[Status] = Field(description="the run's status per window")
    score: list[float] = Field(description="the run's score per window")
    layers: list[LayerTrend]
    run_issues: list[TrendIssue] = Field(default_factory=list)
    thresholds: HealthThresholds

    @property
    def worst(self) -> Status:
        """The worst status of any window."""
        return worst(self.status)

    def issues(self) -> list[TrendIssue]:
        """All issues, run-level first then per layer in forward order."""
        return [*self.run_issues, *(i for lt in self.layers for i in lt.issues)]

    def has(self, type: IssueType | str, layer: str | None = None, *, info: bool = False) -> bool:
        """Whether an issue of ``type`` (on ``layer``, if given) was raised in some window;
        ``info`` issues count only with ``info=True``."""
        return any(
            i.type == type and (layer is None or i.layer == layer)
            and (info or i.severity != Severity.INFO)
            for i in self.issues()
        )  # fmt: skip

    def layer(self, name: str) -> LayerTrend:
        for lt in self.layers:
            if lt.layer == name:
                return lt
        raise KeyError(f"{self.url}: no layer {name!r}")


def window_rows(steps: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first row, window index)`` of each window of ``window`` steps holding a row of
    ``steps`` (increasing optimizer steps, one per row)."""
    if window < 1:
        raise ValueError(f"window must be at least 1 step, got {window}")
    k = np.asarray(steps, dtype=np.int64) // window
    first = np.flatnonzero(np.diff(k, prepend=k[:1] - 1))
    return first, k[first]


def default_window(steps: np.ndarray, windows: int = 10, min_rows: int = 10) -> int:
    """A round window (1, 2 or 5 × 10^k steps) giving at most about ``windows`` windows
    over the recorded ``steps``, each holding about ``min_rows`` recorded steps at least
    (one window for a run shorter than that: no 1-step windows on a 6-step run)."""
    span = int(steps[-1] - steps[0] + 1) if len(steps) else 1
    per_row = span / max(len(steps), 1)  # steps per recorded row (recording every N)
    raw = max(1, -(-span // windows), math.ceil(min_rows * per_row))
    if len(steps) <= min_rows:
        raw = max(raw, span)
    mag = 10 ** (len(str(raw)) - 1)
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def want_health_trend(run: Run, cache: StatsCache, window: int) -> None:
    """Declare the stats :func:`health_trend` reads (so a report loads them in one pass)."""
    want_health(run, cache)
    starts, _ = window_rows(run.steps, window)
    cache.want_reducer(("grad_totals", window), GradTotals(starts))


def _log_quadratic(
    t: np.ndarray, g: np.ndarray, min_values: int = 5
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least-squares fit ``ln g ≈ a + b·τ + c·τ²`` of each column of ``g [rows, col]``
    over its finite positive values, ``τ`` the step ``t [rows]`` from the centre of
    ``t``'s span. Returns per column the velocity ``b`` (d ln g / d step at the centre,
    1/step), the acceleration ``2c`` (1/step²) and the t-statistic of ``c`` (NaN with fewer
    than ``min_values`` values).
    Vectorised: one 3×3 normal-equation system per column."""
    n_col = g.shape[1]
    vel, acc, tstat = (np.full(n_col, np.nan) for _ in range(3))
    if len(t) < min_values or n_col == 0:
        return vel, acc, tstat
    half = max((float(t[-1]) - float(t[0])) / 2, 0.5)
    x = (np.asarray(t, dtype=np.float64) - (float(t[0]) + float(t[-1])) / 2) / half  # [-1, 1]
    with np.errstate(all="ignore"):
        y = np.log(np.asarray(g, dtype=np.float64))
    m = np.isfinite(y)
    y = np.where(m, y, 0.0)
    powers = np.stack([x**k for k in range(5)])  # [5, rows]
    s = powers @ m  # Σ τ^k over each column's values, [5, col]
    rhs = powers[:3] @ y  # [3, col]
    ok = s[0] >= min_values
    if not ok.any():
        return vel, acc, tstat
    mat = np.stack([s[i : i + 3] for i in range(3)])[:, :, ok].transpose(2, 0, 1)  # [col, 3, 3]
    inv = np.linalg.inv(mat)
    r = rhs[:, ok].T  # [col, 3]
    beta = np.einsum("cij,cj->ci", inv, r)
    rss = np.maximum((y[:, ok] ** 2).sum(axis=0) - (beta * r).sum(axis=1), 0.0)
    with np.errstate(all="ignore"):
        se_c = np.sqrt(rss / np.maximum(s[0, ok] - 3, 1) * inv[:, 2, 2])
        tstat[ok] = beta[:, 2] / se_c
    vel[ok] = beta[:, 1] / half
    acc[ok] = 2 * beta[:, 2] / half**2
    return vel, acc, tstat


def _window_dynamics(
    out: list[LayerHealth], s: _Series, rows: slice
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float]]]:
    """Measure turbulence, max_pressure, velocity and acceleration of every layer of
    ``out`` over ``rows``: per measure an array over ``s.layers`` (NaN: not measured),
    and per layer with a gradient the dict the window rules read
    (:attr:`~traintape.analysis.health_rules.RuleContext.dynamics`)."""
    t = s.steps[rows]
    g = s.g[rows]
    p = None if s.p is None else s.p[rows]
    pressure = _ratio_reduce(g, s.g_layers, p, s.p_layers, s.g_layers, reduce=_col_max)
    vel, acc, tstat = _log_quadratic(t, g)
    span = float(t[-1] - t[0]) if len(t) else 0.0
    n = len(s.layers)
    res = {
        k: np.full(n, np.nan) for k in ("turbulence", "max_pressure", "velocity", "acceleration")
    }
    dyn: dict[str, dict[str, float]] = {}
    gcol = {x: i for i, x in enumerate(s.g_layers)}
    for k, lh in enumerate(out):
        res["turbulence"][k] = np.nan if lh.grad_norm_cv is None else lh.grad_norm_cv
        if lh.layer not in gcol:
            continue
        c = gcol[lh.layer]
        res["max_pressure"][k], res["velocity"][k], res["acceleration"][k] = (
            pressure[c], vel[c], acc[c],
        )  # fmt: skip
        dyn[lh.layer] = {"max_pressure": float(pressure[c]), "velocity": float(vel[c]),
                         "acceleration": float(acc[c]), "t_stat": float(tstat[c]),
                         "span": span, "rows": float(len(t))}  # fmt: skip
    return res, dyn


def _column(x: np.ndarray) -> list[Any]:
    """A float column as a JSON-safe list (None for NaN/Inf)."""
    obj = x.astype(object)
    obj[~np.isfinite(x)] = None
    return list(obj.tolist())


_ORDER = {Status.HEALTHY: 0, Status.WARNING: 1, Status.CRITICAL: 2}
_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


def _episodes(per_window: list[list[Issue]], windows: list[StepWindow]) -> list[TrendIssue]:
    """Merge each (layer, type)'s issues of consecutive windows into one episode."""
    done: list[TrendIssue] = []
    open_: dict[tuple[str | None, str], TrendIssue] = {}
    for issues, win in zip(per_window, windows, strict=True):
        seen: set[tuple[str | None, str]] = set()
        for i in issues:
            key = (i.layer, str(i.type))
            if key in seen:
                continue
            seen.add(key)
            ep = open_.get(key)
            if ep is None:
                ep = i.model_copy(update={"first_step": win.first_step,
                                          "last_step": win.last_step, "windows": 1})  # fmt: skip
                open_[key] = ep
                continue
            ep.last_step, ep.windows = win.last_step, (ep.windows or 0) + 1
            if _RANK[i.severity] > _RANK[ep.severity]:
                ep.severity, ep.message, ep.evidence = i.severity, i.message, i.evidence
        for key in [k for k in open_ if k not in seen]:
            done.append(open_.pop(key))
    done.extend(open_.values())
    return sorted(done, key=lambda e: e.first_step or 0)


def _whole_facts(s: _Series) -> LayerFacts:
    """The whole-run facts :func:`run_context` reads (the global grad norm)."""
    return _measure(s, slice(None), None)[1]


def health_trend(
    run: Run,
    window: int,
    thresholds: HealthThresholds | None = None,
    *,
    progress: ProgressCallback | None = None,
    cache: StatsCache | None = None,
) -> HealthTrend:
    """Health of every layer of ``run`` per window of ``window`` optimizer steps (see
    the module docstring).

    Args:
        run: an open run (:func:`traintape.open_run`).
        window: steps per window (≥ 1); windows are aligned to multiples of it.
        thresholds: override the defaults of :class:`HealthThresholds`.
        progress: ``callback(stage, done, total)``; a unit is one row block of a stats
            array read, plus one per window analysed.
        cache: a shared stats cache (used by the report so that each array is read once);
            then its tracker counts the row blocks read, and the windows are part of the
            caller's own unit of work (the report's health section).

    Raises:
        ValueError: ``window`` < 1.
    """
    th = thresholds or HealthThresholds()
    starts, index = window_rows(run.steps, window)
    own = cache is None
    if cache is None:
        cache = StatsCache(run, Tracker(progress))
    tracker = cache.tracker
    want_health_trend(run, cache, window)
    tracker.add(cache.pending_blocks() + (len(starts) if own else 0))
    cache.load()
    s = _load_series(run, cache)
    totals = cache.result(("grad_totals", window)) if s.g_layers else None
    ctx = run_context(run, s, _whole_facts(s), th)
    ends = [*starts[1:].tolist(), run.rows][: len(starts)]
    windows = [
        StepWindow(index=int(k), first_step=int(s.steps[a]), last_step=int(s.steps[b - 1]),
                   rows=int(b - a))
        for k, a, b in zip(index.tolist(), starts.tolist(), ends, strict=True)
    ]  # fmt: skip
    n_win, n_lay = len(windows), len(s.layers)
    names = ("grad_norm", "rel_grad", "update_ratio", "act_zero_frac",
             "turbulence", "max_pressure", "velocity", "acceleration")  # fmt: skip
    cols = {k: np.full((n_win, n_lay), np.nan) for k in (*names, "score")}
    status = np.zeros((n_win, n_lay), dtype=np.int8)
    layer_issues: list[list[Issue]] = []
    run_issues: list[list[Issue]] = []
    run_status: list[Status] = []
    run_score: list[float] = []
    tracker.stage("analysing windows")
    for w, (a, b) in enumerate(zip(starts.tolist(), ends, strict=True)):
        rows = slice(a, b)
        tot = None if totals is None else (totals[0][w], totals[1][w], totals[2][w])
        out, facts = _measure(s, rows, tot)
        dyn, per_layer = _window_dynamics(out, s, rows)
        r_issues = judge(RuleContext(out, facts, th, ctx, span="the window", window=True,
                                     dynamics=per_layer, loss_rows=rows))  # fmt: skip
        score, st = _score(out, r_issues, th)
        for k in names[:4]:
            cols[k][w] = [np.nan if getattr(lh, k) is None else getattr(lh, k) for lh in out]
        for k in names[4:]:
            cols[k][w] = dyn[k]
        cols["score"][w] = [lh.score for lh in out]
        status[w] = [_ORDER[lh.status] for lh in out]
        layer_issues.append([i for lh in out for i in lh.issues])
        run_issues.append(r_issues)
        run_status.append(st)
        run_score.append(score)
        if own:
            tracker.advance()
    by_status = list(_ORDER)
    episodes = _episodes(layer_issues, windows)
    by_layer: dict[str | None, list[TrendIssue]] = {}
    for e in episodes:
        by_layer.setdefault(e.layer, []).append(e)
    types_at: dict[tuple[int, str], list[IssueType | str]] = {}
    for w, issues in enumerate(layer_issues):
        for i in issues:
            types_at.setdefault((w, i.layer or ""), []).append(i.type)
    layers: list[LayerTrend] = []
    for c, name in enumerate(s.layers):
        col = status[:, c]
        changes = [
            StatusChange(step=windows[w].first_step, before=by_status[col[w - 1]],
                         after=by_status[col[w]], issues=types_at.get((w, name), []))
            for w in (np.flatnonzero(np.diff(col)) + 1).tolist()
        ]  # fmt: skip
        layers.append(LayerTrend(
            layer=name, depth=c, status=[by_status[v] for v in col.tolist()],
            score=cols["score"][:, c].tolist(),
            **{k: _column(cols[k][:, c]) for k in names},
            changes=changes, issues=by_layer.get(name, []),
        ))  # fmt: skip
    return HealthTrend(url=run.url, window=window, steps=run.rows, windows=windows,
                       status=run_status, score=run_score, layers=layers,
                       run_issues=_episodes(run_issues, windows), thresholds=th)  # fmt: skip


class HealthTrendAnalysis:
    """:func:`health_trend` as an :class:`~traintape.analysis.protocol.Analysis`
    (``window``: steps per window; None: :func:`default_window` of the run)."""

    name = "health_trend"

    def __init__(
        self, window: int | None = None, thresholds: HealthThresholds | None = None
    ) -> None:
        self.window, self.thresholds = window, thresholds

    def _window(self, run: Run) -> int:
        th = self.thresholds or HealthThresholds()
        return self.window or default_window(run.steps, min_rows=th.trend_min_rows)

    def wants(self, cache: StatsCache) -> None:
        want_health_trend(cache.run, cache, self._window(cache.run))

    def compute(self, cache: StatsCache) -> HealthTrend:
        return health_trend(cache.run, self._window(cache.run), self.thresholds, cache=cache)
