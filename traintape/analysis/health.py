"""Gradient-flow health per layer and over time.

For every layer (tensors grouped by layer path, in forward order) the analysis reads
the stat vectors of ``grad``, ``param``, ``update`` and ``activation`` and computes:

- ``grad_norm``: median over steps of the layer's gradient L2 norm
  (``sqrt(Σ_tensors l2²)``), and its coefficient of variation over steps;
- ``rel_grad``: median of ``grad_norm / param_norm`` (scale-free gradient size);
- ``update_ratio``: median of ``‖θ_{t+1} − θ_t‖ / ‖θ_t‖`` (the update/param ratio);
- ``grad_growth``: median grad norm of the last quarter of steps / of the first quarter;
- ``act_zero_frac``: median zero fraction of the layer's activation;
- saturation of bounded activations (see :class:`HealthThresholds`).

Issues (each with a severity and a concrete recommendation): VANISHING, EXPLODING, DEAD,
SATURATED, DECAY_WITH_DEPTH, LAYER_IMBALANCE, ATTENTION_QKV_IMBALANCE; the architecture
checks of :mod:`~traintape.analysis.architecture` (BOTTLENECK, RESIDUAL_DECAY,
ATTENTION_FFN_IMBALANCE, ATTENTION_HEAD_IMBALANCE, GATE_SATURATION, FORGET_GATE_CLOSED,
over the whole run, their measures in :attr:`HealthReport.architecture`); per window of
steps (:mod:`~traintape.analysis.health_trend`) also TURBULENT, PRESSURE_SPIKE and
ACCELERATING. A layer's score is ``100 − Σ penalties`` (critical 60, warning 25, floored
at 0); status is ``critical`` with any critical issue, ``warning`` with any warning, else
``healthy``. :mod:`~traintape.analysis.health_compare` compares two runs' health.

**Frozen layers.** In a run that records gradients, a layer whose tensors are recorded as
``param`` but none as ``grad`` is *frozen* (``requires_grad=False``: a LoRA/PEFT base
model, a frozen encoder): the adapters record no gradient for it on purpose. It is
listed in :attr:`HealthReport.frozen` and marked :attr:`LayerHealth.frozen`, carries no
penalty, and is never VANISHING, DEAD or EXPLODING (SATURATED, an activation rule, still
applies). A gradient recorded as exact zeros is not frozen — that is DEAD (e.g. a
``detach`` by mistake). A layer with some tensors frozen is judged on its trainable ones.

**LoRA factors** (layer kind ``lora``: ``<layer>/lora_A``, ``<layer>/lora_B``, see
:func:`~traintape.analysis.change.lora_pairs`) are judged as parts of the layer they
adapt, whose weight is ``W = W_base + s·A·B``, not by their own ratios: ``B`` starts at
exactly 0 (an embedding adapter's ``A``), so ``‖ΔB‖/‖B‖`` is about ``1/t`` under Adam
whatever the learning rate and ``‖g_B‖/‖B‖`` is unbounded early, and ``A``'s gradient
``s·g_W·Bᵀ`` is proportional to ``B``. Per step, with ``u`` the update, ``g`` the
gradient and Frobenius norms (:class:`LoraHealth`, medians over steps):

- effective update ratio of ``A``: ``s·‖u_A‖·(‖B‖ + ‖u_B‖) / ‖W_base‖``, of ``B``:
  ``s·‖A‖·‖u_B‖ / ‖W_base‖`` — they add up to an upper bound of
  ``‖Δ(s·A·B)‖ / ‖W_base‖``, the step's relative change of the layer's effective weight
  (``A'B' − AB = u_A·B' + A·u_B``). It replaces ``update_ratio`` in the EXPLODING ratio
  rule; without a recorded base weight the rule is skipped for the factors (their own
  ratio is no measure: the zero-initialised factor — ``B``, or ``A`` of an embedding
  adapter — has a huge one, and with PEFT's ``A`` init ``‖u_A‖/‖A‖`` starts near
  ``lr·√(3·in)`` under Adam: 0.11 at lr 1e-3 on a 4096-wide layer).
- effective relative gradient: ``‖g_A‖ / (s·‖B‖·‖W_base‖)`` and
  ``‖g_B‖ / (s·‖A‖·‖W_base‖)``, each a lower bound of ``‖∂L/∂W‖ / ‖W_base‖`` (since
  ``g_A = s·g_W·Bᵀ``, ``g_B = s·Aᵀ·g_W``; undefined at steps where the partner is 0). The
  relative VANISHING rule compares a factor with the largest of the *same* factor of the
  other adapters (A with A, B with B: the two bounds are not equally tight), never with
  other layers, and LoRA factors are never the reference of other layers; the absolute
  rule (``vanishing_abs``) is unchanged. DECAY_WITH_DEPTH and LAYER_IMBALANCE are judged
  separately among other layers, among ``lora_A`` factors and among ``lora_B`` factors
  (with the effective measures).
- the EXPLODING growth rule reads the growth of ``‖g‖ / ‖partner‖``.

``s`` is PEFT's scaling from :func:`~traintape.analysis.change.lora_scale` (1 when the run
does not say: then the effective ratios are up to the scale); ``‖W_base‖`` is the base
layer's param norm (its median over the run: frozen weights are read only at some steps).
Non-finite gradients, the gradient-norm limit and DEAD (exactly zero gradients) apply to
factors as to any layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from traintape.analysis._common import (
    ProgressCallback,
    Reducer,
    StatsCache,
    TensorSeries,
    Tracker,
    _quiet,
    column_median,
    finite_float,
    forward_rank,
    layer_norms,
    layer_of,
    stat_index,
    tensor_rank,
)
from traintape.analysis.architecture import architecture
from traintape.analysis.change import LoraPair, component_of, lora_pairs, lora_scale
from traintape.analysis.health_model import (
    HealthReport,
    HealthThresholds,
    LayerFacts,
    LayerHealth,
    LoraHealth,
    RunContext,
)
from traintape.analysis.health_rules import RuleContext, judge
from traintape.analysis.issues import Issue, IssueType, Severity, Status, worst
from traintape.analysis.registry import run_checks
from traintape.schema import Kind

if TYPE_CHECKING:
    from traintape.core.reader import Run


def _med(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else None


_KINDS = (Kind.GRAD, Kind.PARAM, Kind.UPDATE, Kind.ACTIVATION)
_ACT_SERIES = (
    ("zero_frac", "max"), ("min", "mean"), ("max", "mean"), ("abs_mean", "mean"),
    ("mean", "mean"), ("std", "mean"),
)  # fmt: skip


class GradTotals(Reducer):
    """Per window of rows and layer of the grad kind: non-finite values (NaN + Inf), rows
    at which every gradient tensor of the layer is exactly zero, and rows recorded.

    ``starts``: the first row of each window, increasing (default: one window, all rows).
    ``value = (nonfinite [window, layer], zero_rows [window, layer], recorded_rows
    [window, layer])``."""

    kind = Kind.GRAD

    def __init__(self, starts: np.ndarray | None = None) -> None:
        self.starts = np.zeros(1, np.intp) if starts is None else np.asarray(starts, np.intp)

    def begin(self, cache: StatsCache) -> None:
        self.groups = cache.groups(Kind.GRAD)
        self.cols = [stat_index(cache.run, s) for s in ("nan_count", "inf_count", "zero_frac")]
        shape = (len(self.starts), len(self.groups.layers))
        self.value = (np.zeros(shape), np.zeros(shape, dtype=np.int64),
                      np.zeros(shape, dtype=np.int64))  # fmt: skip

    def update(self, start: int, block: np.ndarray) -> None:
        nonfinite, zero_rows, recorded = self.value
        wid = np.searchsorted(self.starts, start + np.arange(len(block)), side="right") - 1
        seg = np.flatnonzero(np.diff(wid, prepend=-1))  # first block row of each window
        win = wid[seg]
        nf = self.groups.reduce(block[:, :, self.cols[0]] + block[:, :, self.cols[1]], "sum")
        nonfinite[win] += np.add.reduceat(np.where(np.isnan(nf), 0.0, nf), seg, axis=0)
        zmin = self.groups.reduce(block[:, :, self.cols[2]], "min")  # NaN: not recorded
        rec = ~np.isnan(zmin)
        recorded[win] += np.add.reduceat(rec, seg, axis=0, dtype=np.int64)
        zero_rows[win] += np.add.reduceat(rec & (zmin >= 1.0), seg, axis=0, dtype=np.int64)


def _column_groups(n_rows: int, n_cols: int, max_values: int = 4 << 20) -> range:
    return range(0, n_cols, max(1, max_values // max(n_rows, 1)))


def _grad_measures(g: np.ndarray) -> dict[str, np.ndarray]:
    """Per column of grad norms ``g [rows, layer]`` over the finite values: ``median``,
    ``cv`` (std/mean; NaN with fewer than 2 values or mean 0), ``growth`` (median of the
    last quarter / of the first quarter of the values; NaN with fewer than 4) and
    ``max`` (NaN if none). Vectorised in groups of columns."""
    n_rows, n_cols = g.shape
    out = {k: np.full(n_cols, np.nan) for k in ("median", "cv", "growth", "max")}
    step = _column_groups(n_rows, n_cols).step
    for c0 in range(0, n_cols, step):
        x = np.asarray(g[:, c0 : c0 + step], dtype=np.float64)
        fin = np.isfinite(x)
        n = fin.sum(axis=0)
        xf = np.where(fin, x, np.nan)
        sl = slice(c0, c0 + x.shape[1])
        out["median"][sl] = column_median(xf)
        with _quiet(), np.errstate(all="ignore"):
            mean, std = np.nanmean(xf, axis=0), np.nanstd(xf, axis=0)
            out["max"][sl] = np.nanmax(xf, axis=0)
            out["cv"][sl] = np.where((n > 1) & (mean > 0), std / mean, np.nan)
        growth = np.full(x.shape[1], np.nan)
        dense = fin.all(axis=0) & (n >= 4)
        if dense.any() and n_rows >= 4:  # the same quarter rows for every full column
            q = max(1, n_rows // 4)
            first, last = column_median(x[:q, dense]), column_median(x[-q:, dense])
            with np.errstate(all="ignore"):
                growth[dense] = np.where(first > 0, last / first, np.nan)
        for c in np.flatnonzero(~dense & (n >= 4)):  # columns with gaps: their own quarters
            v = x[fin[:, c], c]
            q = max(1, len(v) // 4)
            first, last = np.median(v[:q]), np.median(v[-q:])
            growth[c] = last / first if first > 0 else np.nan
        out["growth"][sl] = growth
    return out


def _ratio_reduce(
    a: np.ndarray | None,
    a_layers: list[str],
    b: np.ndarray | None,
    b_layers: list[str],
    layers: list[str],
    reduce: Callable[[np.ndarray], np.ndarray] = column_median,
) -> np.ndarray:
    """Per layer of ``layers``: ``reduce`` (default: median) over rows of
    ``a[:, layer] / b[:, layer]`` (NaN where either series lacks the layer)."""  # fmt: skip
    out = np.full(len(layers), np.nan)
    if a is None or b is None:
        return out
    acol = {x: i for i, x in enumerate(a_layers)}
    bcol = {x: i for i, x in enumerate(b_layers)}
    pairs = [(k, acol[x], bcol[x]) for k, x in enumerate(layers) if x in acol and x in bcol]
    if not pairs:
        return out
    step = _column_groups(a.shape[0], len(pairs)).step
    for s0 in range(0, len(pairs), step):
        grp = pairs[s0 : s0 + step]
        ia = [p[1] for p in grp]
        ib = [p[2] for p in grp]
        out[[p[0] for p in grp]] = reduce(_ratio(a[:, ia], b[: a.shape[0], ib]))
    return out


RUNNING_ROLES = ("running_mean", "running_var")


def running_stat_tensors(run: Run) -> list[str]:
    """The normalisation layers' running statistics recorded as ``param`` (BatchNorm's
    ``running_mean`` / ``running_var``)."""
    if Kind.PARAM not in set(run.kinds()):
        return []
    return [s.name for s in run.manifest.specs(Kind.PARAM) if s.role in RUNNING_ROLES]


def want_health(run: Run, cache: StatsCache) -> None:
    """Declare the stats :func:`health` reads (so a report loads them in one pass)."""
    for kind in (Kind.GRAD, Kind.PARAM, Kind.UPDATE):
        cache.want(kind, "l2", "norm")
    cache.want_reducer(("grad_totals",), GradTotals())
    running = running_stat_tensors(run)
    if running:
        cache.want_reducer(("running_stats",), TensorSeries(Kind.PARAM, running, ("l2", "mean")))
    for stat, how in _ACT_SERIES:
        cache.want(Kind.ACTIVATION, stat, how)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(a, dtype=np.float64) / b


@dataclass
class _Series:
    """The per-layer series ``[rows, layer]`` the health rules read, from one run's
    cache: grad, param and update L2 norms (None where the kind is not recorded) and the
    activation statistics of ``_ACT_SERIES``; ``layers`` is every layer in forward order."""

    steps: np.ndarray
    g_layers: list[str]
    g: np.ndarray
    p_layers: list[str]
    p: np.ndarray | None
    u_layers: list[str]
    u: np.ndarray | None
    a_layers: list[str]
    act: dict[str, np.ndarray]
    layers: list[str]
    frozen: set[str] = field(default_factory=set)
    lora: dict[str, _LoraFactor] = field(default_factory=dict)
    running: dict[str, np.ndarray] = field(default_factory=dict)
    """Per normalisation layer, its running statistics' ``[rows, tensor, (l2, mean)]``."""


@dataclass
class _LoraFactor:
    """A LoRA factor layer's place: its part, its adapter, its partner factor's layer, the
    scale and the base weight's norm (None when not recorded)."""

    part: str
    pair: LoraPair
    partner: str
    scale: float
    scale_source: str | None
    base_norm: float | None


def _lora_factors(run: Run, p_layers: list[str], p: np.ndarray | None) -> dict[str, _LoraFactor]:
    """The LoRA factor layers of ``run`` (both factors recorded as param), by layer."""
    out: dict[str, _LoraFactor] = {}
    pcol = {x: i for i, x in enumerate(p_layers)}
    for pair in lora_pairs(run):
        scale, src = lora_scale(run, pair)
        base = None
        if p is not None and pair.base_layer in pcol:
            col = np.asarray(p[:, pcol[pair.base_layer]], dtype=np.float64)
            base = _med(col)
        base = base if base is not None and base > 0 else None
        for part, layer, partner in (("lora_A", pair.a_layer, pair.b_layer),
                                     ("lora_B", pair.b_layer, pair.a_layer)):  # fmt: skip
            out[layer] = _LoraFactor(part, pair, partner, scale, src, base)
    return out


def _load_series(run: Run, cache: StatsCache) -> _Series:
    """The series of :func:`want_health` (loaded by ``cache``)."""
    kinds = set(run.kinds())
    if Kind.GRAD in kinds:
        steps, g_layers, g = layer_norms(run, Kind.GRAD, cache)
    else:
        steps, g_layers, g = run.steps, [], np.zeros((run.rows, 0))
    p_layers: list[str] = []
    p: np.ndarray | None = None
    if Kind.PARAM in kinds:
        _, p_layers, p = layer_norms(run, Kind.PARAM, cache)
    u_layers: list[str] = []
    u: np.ndarray | None = None
    if Kind.UPDATE in kinds:
        _, u_layers, u = layer_norms(run, Kind.UPDATE, cache)
    layers = list(g_layers) + [x for x in p_layers if x not in set(g_layers)]
    a_layers: list[str] = []
    act: dict[str, np.ndarray] = {}
    if Kind.ACTIVATION in kinds:
        a_layers = cache.groups(Kind.ACTIVATION).layers
        act = {stat: cache.series(Kind.ACTIVATION, stat, how) for stat, how in _ACT_SERIES}
        seen = set(layers)
        layers += [x for x in a_layers if x not in seen]
    graded = set(g_layers)
    frozen = {x for x in p_layers if x not in graded} if graded else set()
    lora = _lora_factors(run, p_layers, p) if p is not None else {}
    running: dict[str, np.ndarray] = {}
    names = running_stat_tensors(run)
    if names:
        vals = cache.result(("running_stats",))
        for c, name in enumerate(names):
            layer = layer_of(name)
            running[layer] = (np.concatenate([running[layer], vals[:, c : c + 1]], axis=1)
                              if layer in running else vals[:, c : c + 1])  # fmt: skip
    return _Series(steps, g_layers, g, p_layers, p, u_layers, u, a_layers, act, layers,
                   frozen, lora, running)  # fmt: skip


GradTotalsRow = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One window of :class:`GradTotals`: ``(nonfinite [layer], zero_rows [layer],
recorded_rows [layer])``."""


def _measure(
    s: _Series, rows: slice, totals: GradTotalsRow | None
) -> tuple[list[LayerHealth], LayerFacts]:
    """Every layer's measures over the rows ``rows`` of ``s`` (issues not yet judged);
    ``totals``: the grad totals of the same rows."""
    facts = LayerFacts()
    if totals is not None:
        nonfinite, zero_rows, recorded = totals
        for c, layer in enumerate(s.g_layers):
            facts.nonfinite[layer] = float(nonfinite[c])
            facts.zero_steps[layer] = float(zero_rows[c] / max(int(recorded[c]), 1))
    if s.act:
        ser = {k: v[rows] for k, v in s.act.items()}
        meds = {k: column_median(ser[k]) for k in ("zero_frac", "abs_mean", "mean", "std")}
        with _quiet():
            amin, amax = np.nanmin(ser["min"], axis=0), np.nanmax(ser["max"], axis=0)
        for c, layer in enumerate(s.a_layers):
            facts.act[layer] = {
                "zero_frac": finite_float(meds["zero_frac"][c]),
                "min": finite_float(amin[c]),
                "max": finite_float(amax[c]),
                "abs_mean": finite_float(meds["abs_mean"][c]),
                "mean": finite_float(meds["mean"][c]),
                "std": finite_float(meds["std"][c]),
            }
    g = s.g[rows]
    p = None if s.p is None else s.p[rows]
    u = None if s.u is None else s.u[rows]
    gm = _grad_measures(g)
    rel = _ratio_reduce(g, s.g_layers, p, s.p_layers, s.g_layers)
    upr = _ratio_reduce(u, s.u_layers, p, s.p_layers, s.u_layers)
    gcol = {x: i for i, x in enumerate(s.g_layers)}
    ucol = {x: i for i, x in enumerate(s.u_layers)}
    lora = _lora_measures(s, g, p, u)
    _update_facts(facts, s, u, p)
    for layer, vals in s.running.items():
        v = vals[rows]
        v = v[np.isfinite(v).all(axis=(1, 2))]
        if len(v) >= 3:
            facts.running_frozen[layer] = bool((v == v[0]).all())
    if g.shape[1]:
        with _quiet(), np.errstate(all="ignore"):
            gg = np.asarray(g, np.float64)
            tot = np.sqrt(np.nansum(gg * gg, axis=1))
            tot[np.isnan(gg).all(axis=1)] = np.nan
        facts.global_grad = tot.tolist()
        facts.grad_series = {x: gg[:, c] for c, x in enumerate(s.g_layers)}
        facts.grad_steps = np.asarray(s.steps[rows]).tolist()
    out: list[LayerHealth] = []
    for depth, layer in enumerate(s.layers):
        lh = LayerHealth(layer=layer, depth=depth, frozen=layer in s.frozen,
                         lora=lora.get(layer))  # fmt: skip
        if layer in gcol:
            gi = gcol[layer]
            lh.grad_norm = finite_float(gm["median"][gi])
            lh.grad_norm_cv = finite_float(gm["cv"][gi])
            lh.grad_growth = finite_float(gm["growth"][gi])
            lh.rel_grad = finite_float(rel[gi])
            facts.gmax[layer] = float(gm["max"][gi])
        if layer in ucol:
            lh.update_ratio = finite_float(upr[ucol[layer]])
        if layer in facts.act:
            lh.act_zero_frac = facts.act[layer]["zero_frac"]
        out.append(lh)
    return out, facts


def _update_facts(
    facts: LayerFacts, s: _Series, u: np.ndarray | None, p: np.ndarray | None
) -> None:
    """Per layer with a recorded update over the rows of ``u``: the largest
    update/param ratio (``umax``) and whether every recorded update is exactly 0
    (``update_zero``)."""
    if u is None or not s.u_layers:
        return
    umax = _ratio_reduce(u, s.u_layers, p, s.p_layers, s.u_layers, reduce=_col_max)
    uu = np.asarray(u, np.float64)
    rec = np.isfinite(uu)
    zero = (rec.sum(axis=0) > 0) & np.where(rec, uu == 0, True).all(axis=0)
    for c, layer in enumerate(s.u_layers):
        if np.isfinite(umax[c]):
            facts.umax[layer] = float(umax[c])
        facts.update_zero[layer] = bool(zero[c])


def _col_max(x: np.ndarray) -> np.ndarray:
    """Max over rows of each column, ignoring NaN/Inf (NaN where none is finite)."""
    with _quiet(), np.errstate(all="ignore"):
        return np.nanmax(np.where(np.isfinite(x), x, np.nan), axis=0)


def _lora_measures(
    s: _Series, g: np.ndarray, p: np.ndarray | None, u: np.ndarray | None
) -> dict[str, LoraHealth]:
    """The effective measures of every LoRA factor layer with a gradient (module
    docstring) over the rows of ``g``, ``p`` and ``u`` (the series' rows already sliced)."""
    if p is None or not s.lora:
        return {}
    gcol = {x: i for i, x in enumerate(s.g_layers)}
    pcol = {x: i for i, x in enumerate(s.p_layers)}
    ucol = {x: i for i, x in enumerate(s.u_layers)}
    nan = np.full(len(g), np.nan)

    def col(x: np.ndarray | None, c: dict[str, int], layer: str) -> np.ndarray:
        return nan if x is None or layer not in c else np.asarray(x[:, c[layer]], np.float64)

    layers = [x for x in s.lora if x in gcol and x in pcol and s.lora[x].partner in pcol]
    if not layers:
        return {}
    per_partner = np.stack(
        [_ratio(col(g, gcol, x), col(p, pcol, s.lora[x].partner)) for x in layers], axis=1
    )  # ‖g‖ / ‖partner‖ [rows, factor]
    gm = _grad_measures(per_partner)
    upd = []
    for x in layers:
        f = s.lora[x]
        own_u, partner = col(u, ucol, x), col(p, pcol, f.partner)
        if f.part == "lora_A":  # s·‖u_A‖·‖B_{t+1}‖, ‖B_{t+1}‖ ≤ ‖B_t‖ + ‖u_B‖
            upd.append(own_u * (partner + col(u, ucol, f.partner)))
        else:  # s·‖A_t‖·‖u_B‖
            upd.append(own_u * partner)
    upr = column_median(np.stack(upd, axis=1))
    out = {}
    for c, x in enumerate(layers):
        f = s.lora[x]
        base, sc = f.base_norm, abs(f.scale)
        with np.errstate(all="ignore"):
            rel = np.nan if base is None else gm["median"][c] / (sc * base)
            ur = np.nan if base is None else sc * upr[c] / base
        out[x] = LoraHealth(
            part=f.part, adapted=f.pair.key, scale=f.scale, scale_source=f.scale_source,
            rel_grad=finite_float(rel), update_ratio=finite_float(ur),
            grad_growth=finite_float(gm["growth"][c]),
        )  # fmt: skip
    return out


CLIP_METRIC = "grad/clip_factor"
"""The run metric an adapter logs when it sees gradient clipping (docs/store-format.md):
the applied factor, 1.0 = not clipped."""


def _metric_at_rows(run: Run, name: str, steps: np.ndarray) -> np.ndarray | None:
    """The metric ``name`` at each of ``steps`` (NaN where not logged); None if never."""
    try:
        df = run.metrics()
    except Exception:  # a store without metrics
        return None
    if name not in getattr(df, "columns", ()):
        return None
    col = df[name].astype(float)
    return np.asarray(col.reindex(np.asarray(steps)).to_numpy(), np.float64)


def _clipping(
    run: Run, s: _Series, facts: LayerFacts, th: HealthThresholds
) -> tuple[str | None, float]:
    """``(how, fraction of steps clipped)``: the ``grad/clip_factor`` metric below 1
    (``"metric"``), or a global grad norm sitting at its maximum at ``clip_capped_frac``
    of steps (``"capped"``: an adapter that recorded the clipped gradient); else None."""
    factor = _metric_at_rows(run, CLIP_METRIC, s.steps)
    if factor is not None:
        f = factor[np.isfinite(factor)]
        if len(f):
            frac = float((f < 1.0 - 1e-6).mean())
            return ("metric", frac) if frac > 0 else (None, 0.0)
    g = np.asarray(facts.global_grad, np.float64)
    g = g[np.isfinite(g)]
    if len(g) >= 5 and g.max() > 0:
        frac = float((g >= g.max() * (1 - 1e-3)).mean())
        if frac >= th.clip_capped_frac:
            return "capped", frac
    return None, 0.0


def _adaptive(run: Run, s: _Series) -> bool | None:
    """Whether the optimizer keeps a second moment: an ``opt_state`` tensor ``*/nu``
    (Adam-like: True; opt_state without one: False); without opt_state, the median
    ``‖u‖/‖g‖`` per layer: the same for every layer within 10% (``u = −lr·g``: SGD) gives
    False, spread over more than 10x (per-parameter step sizes) True; else None."""
    try:
        names = run.tensor_names(Kind.OPT_STATE)
    except Exception:
        names = []
    if names:
        return any(n.rsplit("/", 1)[-1] in ("nu", "nu_max") for n in names)
    if s.u is None or not s.g_layers:
        return None
    common = [x for x in s.u_layers if x in set(s.g_layers)]
    if len(common) < 2:
        return None
    ucol = {x: i for i, x in enumerate(s.u_layers)}
    gcol = {x: i for i, x in enumerate(s.g_layers)}
    with _quiet(), np.errstate(all="ignore"):
        ratio = [np.nanmedian(s.u[:, ucol[x]] / s.g[: len(s.u), gcol[x]]) for x in common]
    r = np.asarray(ratio, np.float64)
    r = r[np.isfinite(r) & (r > 0)]
    if len(r) >= 2 and r.max() / r.min() < 1.1:
        return False
    if len(r) >= 2 and r.max() / r.min() > 10:
        return True  # per-parameter step sizes: ‖u‖ no longer follows ‖g‖
    return None


def _roles(run: Run, layers: list[str]) -> dict[str, str]:
    """Each layer's component (:func:`~traintape.analysis.change.component_of` of its
    first parameter or gradient tensor): ``norm``, ``embedding``, ``attention/q``, ..."""
    out: dict[str, str] = {}
    want = set(layers)
    for kind in (Kind.PARAM, Kind.GRAD):
        if kind not in set(run.kinds()):
            continue
        for name in run.tensor_names(kind):
            layer = layer_of(name)
            if layer in want and layer not in out:
                out[layer] = component_of(run.spec(name, kind))
    return out


def run_context(run: Run, s: _Series, facts: LayerFacts, th: HealthThresholds) -> RunContext:
    """The :class:`~traintape.analysis.health_model.RunContext` of ``run`` (what it
    already does: clipping, optimizer, activations; its length, loss, roles, order)."""
    how, frac = _clipping(run, s, facts, th)
    bounded: bool | None = None
    if facts.act:
        bounded = any(
            a["min"] is not None and a["max"] is not None and a["min"] >= -1 and a["max"] <= 1
            for a in facts.act.values()
        )
    loss = _metric_at_rows(run, "loss", s.steps)
    rank = forward_rank(run)
    return RunContext(
        clipping=how, clip_frac=frac, adaptive=_adaptive(run, s),
        bounded_activations=bounded, steps=len(s.steps),
        loss=None if loss is None else loss.tolist(), roles=_roles(run, s.layers),
        order={x: tensor_rank(rank, x + "/_") for x in s.layers},
        loss_is_epoch_mean="keras" in (run.manifest.producer.adapter or ""),
    )  # fmt: skip


def _score(
    out: list[LayerHealth], run_issues: list[Issue], th: HealthThresholds
) -> tuple[float, Status]:
    """Set each layer's score and status from its issues; return the run's (score
    rounded to 0.1, status)."""
    for lh in out:
        pen = sum(th.critical_penalty if i.severity == Severity.CRITICAL
                  else th.warning_penalty if i.severity == Severity.WARNING else 0.0
                  for i in lh.issues)  # fmt: skip
        lh.score = float(max(0.0, 100.0 - pen))
        lh.status = worst(i.severity for i in lh.issues)
    score = float(np.mean([lh.score for lh in out])) if out else 100.0
    judged = [i for i in run_issues if i.severity != Severity.INFO]
    score = max(0.0, score - th.warning_penalty / 5 * len(judged))
    status = worst([*(i.severity for i in run_issues), *(lh.status for lh in out)])
    return round(score, 1), status


def health(
    run: Run,
    thresholds: HealthThresholds | None = None,
    *,
    progress: ProgressCallback | None = None,
    cache: StatsCache | None = None,
    checks: bool = True,
) -> HealthReport:
    """Gradient-flow health of every layer of ``run`` (see module docstring).

    Args:
        run: an open run (:func:`traintape.open_run`).
        thresholds: override the defaults of :class:`HealthThresholds`.
        progress: ``callback(stage, done, total)``; a unit is one row block of a stats
            array read (grad, param, update, activation), plus one for the analysis.
        cache: a shared stats cache (used by the report so that each array is read once).
        checks: run the registered user checks (:mod:`~traintape.analysis.registry`) into
            :attr:`HealthReport.checks`; a critical or warning issue of one sets the
            status at least that bad, a failed check is reported, never raised.
    """
    th = thresholds or HealthThresholds()
    if cache is None:
        cache = StatsCache(run, Tracker(progress))
    tracker = cache.tracker
    want_health(run, cache)
    tracker.add(cache.pending_blocks() + 1)
    cache.load()
    s = _load_series(run, cache)
    totals: GradTotalsRow | None = None
    if s.g_layers:
        nonfinite, zero_rows, recorded = cache.result(("grad_totals",))
        totals = (nonfinite[0], zero_rows[0], recorded[0])
    out, facts = _measure(s, slice(None), totals)
    tracker.stage("analysing layers")
    ctx = run_context(run, s, facts, th)
    run_issues = judge(RuleContext(out, facts, th, ctx))
    arch = architecture(run, th, cache=cache)
    by_layer = {lh.layer: lh for lh in out}
    for a in arch.issues:  # a layer's own issue, or run level (attention, block, stack)
        (by_layer[a.layer].issues if a.layer in by_layer else run_issues).append(a)
    score, status = _score(out, run_issues, th)
    tracker.advance()
    user = run_checks(run) if checks else []
    status = worst([status, *(r.status for r in user if r.status != "error")])
    return HealthReport(url=run.url, steps=len(s.steps), layers=out, run_issues=run_issues,
                        thresholds=th, score=score, status=status, checks=user,
                        frozen=[x for x in s.layers if x in s.frozen],
                        clipping=ctx.clipping, clip_frac=ctx.clip_frac,
                        adaptive_optimizer=ctx.adaptive,
                        architecture=arch)  # fmt: skip


class HealthAnalysis:
    """:func:`health` as an :class:`~traintape.analysis.protocol.Analysis`."""

    name = "health"

    def __init__(self, thresholds: HealthThresholds | None = None, *, checks: bool = True) -> None:
        self.thresholds, self.checks = thresholds, checks

    def wants(self, cache: StatsCache) -> None:
        want_health(cache.run, cache)

    def compute(self, cache: StatsCache) -> HealthReport:
        return health(cache.run, self.thresholds, cache=cache, checks=self.checks)


__all__ = [
    "GradTotals",
    "HealthAnalysis",
    "HealthReport",
    "HealthThresholds",
    "Issue",
    "IssueType",
    "LayerHealth",
    "LoraHealth",
    "Status",
    "health",
    "run_context",
    "want_health",
]
