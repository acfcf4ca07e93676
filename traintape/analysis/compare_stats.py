"""The stats pass of ``compare``: per block of common steps, every kind's stat vectors
judged with the tolerances and noise floors of :mod:`.compare_numerics`.

Within a block the kinds are judged in the order their numerics depend on each other:
``grad`` (its allowed difference and noise status feed the next two), ``opt_state``,
``update`` (gain from ``opt_state`` or ``grad``), ``param`` (accumulates the updates'
allowances over steps), then ``activation``. What the snapshot comparison needs (the
absolute tolerance and noise status of a tensor at a snapshot step) is kept per
(kind, tensor, step) for the steps that have snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from traintape.analysis.compare_judge import Judge, judged_mask, stat_tolerances
from traintape.analysis.compare_models import KindNumerics
from traintape.analysis.compare_numerics import (
    ADAM_NOISE_SHARE,
    ASSUMED_EPS,
    ELEMENT_ROUNDING,
    FIRST_MOMENTS,
    NOISE_FACTOR,
    SECOND_MOMENTS,
    UNIT_ROUNDOFF,
    Precision,
    field_groups,
    gain,
    global_norm,
    kind_tolerance,
)
from traintape.schema import Kind

if TYPE_CHECKING:
    from traintape.analysis._common import Tracker
    from traintape.core.reader import Run

ORDER = (Kind.GRAD, Kind.OPT_STATE, Kind.UPDATE, Kind.PARAM, Kind.ACTIVATION)


@dataclass
class KindPlan:
    """What one kind compares: the common tensors and where they sit in each store."""

    kind: Kind
    names: list[str]
    ja: list[int]
    jb: list[int]
    groups_a: np.ndarray | None
    groups_b: np.ndarray | None
    numel: np.ndarray
    base: tuple[float, float]
    precision: Precision
    judges: list[Judge]
    floor_u: float = 0.0
    """Unit roundoff of the noise floor: the precision's; ``param``: its stored dtype's."""
    snap_steps: set[int] = field(default_factory=set)
    summary: KindNumerics | None = None


@dataclass
class Block:
    """One kind's numbers on one block of rows (n steps, T common tensors)."""

    a: np.ndarray  # [n, T, S] common stats, run A
    b: np.ndarray  # [n, T, S] run B
    l2: np.ndarray  # [2, n, T]
    recorded: np.ndarray  # [2, n, T] a row holds the tensor (not all NaN)
    floor: np.ndarray  # [n, T]
    atol: np.ndarray  # [n, T]
    rtol: np.ndarray  # [n]
    within: np.ndarray  # [n, T] within noise in both runs
    grad_allow: np.ndarray | None = None  # [n, T] grad: allowed l2 difference δg
    elem_extra: np.ndarray | None = None  # [n, T] update: snapshots' atol - stats' atol


@dataclass
class Cols:
    """Column indices of the common stats in each store, and of l2."""

    labels: list[str]
    ca: list[int]
    cb: list[int]
    l2a: int
    l2b: int


def _numel(run: Run, kind: Kind, names: list[str]) -> np.ndarray:
    out = []
    for n in names:
        dims = [d for d in run.spec(n, kind).shape if d is not None]
        known = len(dims) == len(run.spec(n, kind).shape)
        out.append(float(np.prod(np.array(dims, dtype=np.float64))) if known else np.nan)
    return np.array(out, dtype=np.float64)


def _floor_u(run: Run, kind: Kind, names: list[str], precision: Precision) -> float:
    if kind != Kind.PARAM:
        return precision.unit_roundoff
    dtypes = {run.spec(n, kind).dtype for n in names}
    stored = UNIT_ROUNDOFF["fp64"] if dtypes <= {"float64"} else UNIT_ROUNDOFF["fp32"]
    if dtypes & {"bfloat16", "float16"}:
        stored = UNIT_ROUNDOFF["bf16" if "bfloat16" in dtypes else "fp16"]
    return min(precision.unit_roundoff, stored) if precision.mode else stored


def plan_kind(
    ra: Run, rb: Run, kind: Kind, names: list[str], base: tuple[float, float], precision: Precision
) -> KindPlan:
    """The plan of one kind over its common, not excluded, tensors ``names``."""
    names_a, names_b = ra.tensor_names(kind), rb.tensor_names(kind)
    opt = kind == Kind.OPT_STATE
    return KindPlan(
        kind=kind,
        names=names,
        ja=[names_a.index(n) for n in names],
        jb=[names_b.index(n) for n in names],
        groups_a=field_groups(names_a) if opt else None,
        groups_b=field_groups(names_b) if opt else None,
        numel=_numel(rb, kind, names),
        base=base,
        precision=precision,
        judges=[Judge(n, kind.value, *base) for n in names],
        summary=KindNumerics(kind=kind.value),
        floor_u=_floor_u(rb, kind, names, precision),
    )


def read_block(
    ra: Run, rb: Run, plan: KindPlan, cols: Cols, rows: tuple, position: np.ndarray
) -> Block:
    """Read one block of rows of ``plan``'s kind and derive its own numerics (floors,
    base tolerances, noise status); cross-kind terms are added by :class:`StatsPass`."""
    sl_a, sl_b, ia, ib = rows
    full_a = ra.stats_array(plan.kind, rows=sl_a)[ia]
    full_b = rb.stats_array(plan.kind, rows=sl_b)[ib]
    ga = global_norm(full_a[..., cols.l2a], plan.groups_a)
    gb = global_norm(full_b[..., cols.l2b], plan.groups_b)
    if plan.groups_a is not None:  # per field: [n, T] → the common tensors
        g = np.maximum(ga[:, plan.ja], gb[:, plan.jb])
    else:
        g = np.repeat(np.maximum(ga, gb)[:, None], len(plan.names), axis=1)
    a = full_a[:, plan.ja][:, :, cols.ca]
    b = full_b[:, plan.jb][:, :, cols.cb]
    l2 = np.stack([full_a[:, plan.ja, cols.l2a], full_b[:, plan.jb, cols.l2b]])
    recorded = np.stack([~np.isnan(a).all(axis=2), ~np.isnan(b).all(axis=2)])
    floor = NOISE_FACTOR * plan.floor_u * g
    atol, rtol = kind_tolerance(plan.kind.value, plan.precision, position, g, plan.base)
    with np.errstate(invalid="ignore"):
        within = (np.fmax.reduce(l2, axis=0) <= floor) & recorded.all(0)
    _summarise(plan.summary, g, floor, atol, rtol, recorded.all(0))
    return Block(a=a, b=b, l2=l2, recorded=recorded, floor=floor, atol=atol, rtol=rtol,
                 within=within)  # fmt: skip


def _summarise(s: KindNumerics | None, g, floor, atol, rtol, both) -> None:
    if s is None or not both.any():
        return

    def span(old, v):
        v = v[np.isfinite(v)]
        if not v.size:
            return old
        lo, hi = float(v.min()), float(v.max())
        return (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))

    s.global_norm = span(s.global_norm, g[both])
    s.noise_floor = span(s.noise_floor, floor[both])
    s.atol = span(s.atol, atol[both])
    s.rtol = span(s.rtol, np.asarray(rtol, dtype=np.float64))


def _param_of(kind: Kind, name: str) -> str:
    return name.rpartition("/")[0] if kind == Kind.OPT_STATE else name


@dataclass
class _Grad:
    allow: np.ndarray  # [n] δg: the l2 difference the grad comparison allows
    within: np.ndarray  # [n]
    l2: np.ndarray  # [2, n]
    rms: np.ndarray  # [n] l2 / sqrt(numel), the larger run


def _abs_max(blk: Block, labels: list[str], t: int) -> np.ndarray:
    """[n] the largest |element| of tensor t in either run (from min and max)."""
    cols = [labels.index(c) for c in ("min", "max") if c in labels]
    if not cols:
        return np.full(blk.a.shape[0], np.nan)
    v = np.abs(np.concatenate([blk.a[:, t, cols], blk.b[:, t, cols]], axis=1))
    return np.fmax.reduce(v, axis=1)


class StatsPass:
    """Judges every planned kind block by block (blocks in step order)."""

    def __init__(self, plans: dict[Kind, KindPlan], cols: Cols) -> None:
        self.plans = plans
        self.cols = cols
        self.carry: dict[str, float] = {}
        self.snap: dict[tuple[Kind, str, int], tuple[float, float, bool]] = {}

    def block(
        self,
        ra: Run,
        rb: Run,
        rows: tuple,
        steps: np.ndarray,
        position: np.ndarray,
        tracker: Tracker | None = None,
    ) -> None:
        grads: dict[str, _Grad] = {}
        moments: dict[str, tuple[np.ndarray, int]] = {}  # param → (l2 [2, n], rank)
        allow_u: dict[str, np.ndarray] = {}
        second: dict[str, np.ndarray] = {}
        for kind in ORDER:
            plan = self.plans.get(kind)
            if plan is None:
                continue
            if tracker is not None:
                tracker.stage(f"{kind.value} stats")
            blk = read_block(ra, rb, plan, self.cols, rows, position)
            if kind == Kind.GRAD:
                lmax = np.fmax.reduce(blk.l2, axis=0)
                blk.grad_allow = (
                    blk.atol + blk.rtol[:, None] * lmax + np.where(blk.within, blk.floor, 0.0)
                )
                rms = lmax / np.sqrt(plan.numel)[None, :]
                for t, n in enumerate(plan.names):
                    grads[n] = _Grad(
                        blk.grad_allow[:, t], blk.within[:, t], blk.l2[:, :, t], rms[:, t]
                    )
            elif kind == Kind.OPT_STATE:
                self._opt_state(plan, blk, grads, moments, second)
            elif kind == Kind.UPDATE:
                self._update(plan, blk, grads, moments)
                self._adam(plan, blk, grads, second)
                lmax = np.fmax.reduce(blk.l2, axis=0)
                allow = np.where(blk.within, 2.0 * lmax, blk.atol + blk.rtol[:, None] * lmax)
                allow = np.where(np.isfinite(allow), allow, 0.0)
                allow_u.update({n: allow[:, t] for t, n in enumerate(plan.names)})
            elif kind == Kind.PARAM:
                self._param(plan, blk, allow_u)
            self._judge(plan, blk, steps)
            if tracker is not None:
                tracker.advance()

    def _opt_state(
        self, plan: KindPlan, blk: Block, grads: dict, moments: dict, second: dict
    ) -> None:
        for t, n in enumerate(plan.names):
            param, _, fld = n.rpartition("/")
            g = grads.get(param)
            if fld in FIRST_MOMENTS and (param not in moments or
                                         FIRST_MOMENTS.index(fld) < moments[param][1]):  # fmt: skip
                moments[param] = (blk.l2[:, :, t], FIRST_MOMENTS.index(fld))
            if fld in SECOND_MOMENTS and "min" in self.cols.labels:
                lo = np.minimum(blk.a[:, t, self.cols.labels.index("min")],
                                blk.b[:, t, self.cols.labels.index("min")])  # fmt: skip
                second[param] = np.maximum(lo, 0.0)
            if g is None:
                continue
            blk.within[:, t] |= g.within
            with np.errstate(all="ignore"):
                if fld in SECOND_MOMENTS:
                    extra = (
                        2.0
                        * g.allow
                        / np.fmax.reduce(g.l2, axis=0)
                        * np.fmax.reduce(blk.l2[:, :, t], axis=0)
                    )
                else:
                    extra = gain(blk.l2[:, :, t], g.l2) * g.allow
            blk.atol[:, t] += np.where(np.isfinite(extra), extra, 0.0)

    def _update(self, plan: KindPlan, blk: Block, grads: dict, moments: dict) -> None:
        s = plan.summary
        for t, n in enumerate(plan.names):
            g = grads.get(n)
            if g is not None:
                blk.within[:, t] |= g.within
                m = moments.get(n)
                gn = gain(blk.l2[:, :, t], m[0] if m is not None else g.l2)
                extra = gn * g.allow
                blk.atol[:, t] += np.where(np.isfinite(extra), extra, 0.0)
                if s is not None and gn.size and float(gn.max()) > (s.max_gain or 0.0):
                    s.max_gain = float(gn.max())
                    s.gain_from = "opt_state" if m is not None else "grad"

    def _adam(self, plan: KindPlan, blk: Block, grads: dict, second: dict) -> None:
        """Adam-like updates (an ``opt_state`` second moment recorded): the element with
        the smallest ``v`` amplifies its gradient's rounding most, by lr/(√v + ε). lr is
        estimated per step as the largest |update| of those tensors (Adam's |update| is
        at most about lr), ε as :data:`ASSUMED_EPS`; an element's rounding as
        ``ELEMENT_ROUNDING · u · rms(grad)``. The per-element allowance (at most 2·lr)
        widens the snapshots' atol; ``sqrt(numel)`` times it, at most
        :data:`ADAM_NOISE_SHARE` of the update's l2, the stats'."""
        idx = [t for t, n in enumerate(plan.names) if n in second and n in grads]
        if not idx:
            return
        lr = np.fmax.reduce(np.stack([_abs_max(blk, self.cols.labels, t) for t in idx]), axis=0)
        u = plan.precision.unit_roundoff
        blk.elem_extra = np.zeros_like(blk.atol)
        for t in idx:
            n = plan.names[t]
            gain_max = lr / (np.sqrt(second[n]) + ASSUMED_EPS)
            e = np.minimum(gain_max * ELEMENT_ROUNDING * u * grads[n].rms, 2.0 * lr)
            e = np.where(np.isfinite(e), e, 0.0)
            share = ADAM_NOISE_SHARE * np.fmax.reduce(blk.l2[:, :, t], axis=0)
            share = np.where(np.isfinite(share), share, 0.0)
            stats_extra = np.minimum(e * np.sqrt(plan.numel[t]), share)
            blk.atol[:, t] += stats_extra
            blk.elem_extra[:, t] = e - stats_extra  # snapshots: e per element
            s, top = plan.summary, float(np.fmax.reduce(gain_max)) if gain_max.size else 0.0
            if s is not None and top > (s.max_gain or 0.0):
                s.max_gain, s.gain_from = top, "opt_state (Adam: lr/(sqrt(v)+eps))"

    def _param(self, plan: KindPlan, blk: Block, allow_u: dict) -> None:
        for t, n in enumerate(plan.names):
            u = allow_u.get(n)
            if u is None:
                continue
            before = self.carry.get(n, 0.0) + np.concatenate([[0.0], np.cumsum(u)[:-1]])
            blk.atol[:, t] += before
            self.carry[n] = self.carry.get(n, 0.0) + float(u.sum())

    def _judge(self, plan: KindPlan, blk: Block, steps: np.ndarray) -> None:
        labels = self.cols.labels
        l2ref = np.fmax.reduce(np.where(blk.recorded, blk.l2, np.nan), axis=0)
        tol = stat_tolerances(labels, blk.b, l2ref, blk.atol, blk.rtol, plan.numel)
        judged = judged_mask(labels, blk.within)
        both: np.ndarray = np.asarray(blk.recorded.all(axis=0))
        one_sided: np.ndarray = np.asarray(blk.recorded.any(axis=0)) & ~both
        keep = [i for i, s in enumerate(steps) if int(s) in plan.snap_steps]
        for t, j in enumerate(plan.judges):
            m = both[:, t]
            d = j.d
            d.steps_one_sided += int(one_sided[:, t].sum())
            for i in keep:
                snap_atol = float(blk.atol[i, t])
                if blk.elem_extra is not None:  # per element, not the stats' allowance
                    snap_atol += float(blk.elem_extra[i, t])
                key = (plan.kind, d.tensor, int(steps[i]))
                self.snap[key] = (snap_atol, float(blk.rtol[i]), bool(blk.within[i, t]))
            if not m.any():
                continue
            within = blk.within[m, t]
            d.steps_within_noise += int(within.sum())
            if (
                within.any()
                and plan.summary is not None
                and d.tensor not in plan.summary.tensors_within_noise
            ):
                plan.summary.tensors_within_noise.append(d.tensor)
            fl = float(np.max(blk.floor[m, t]))
            d.noise_floor = fl if d.noise_floor is None else max(d.noise_floor, fl)
            j.add(blk.a[m, t], blk.b[m, t], tol[m, t], judged[m, t], steps[m], labels, blk.rtol[m])
            d.steps_compared += int(m.sum())
