"""Run comparison: are two stores identical (docs/store-format.md, "Identical stores"), and if not, where first?

``compare(a, b)`` judges **the data both runs have** (the default) or, with
``strict=True``, also that the stores are identical in structure (what the conformance
suite uses). Either way it reports

- **structural** differences: tensors or kinds present in one run only; spec differences
  (shape, dtype, role, layer, layer_kind, snapshot shape); step sets; snapshot step sets;
  manifest differences outside ``producer``, ``run_id``, ``created_at``, ``updated_at``,
  ``writer``, ``status``, ``events`` (and the commit mark's bookkeeping, which only
  restates the step/snapshot sets). Physical ``layout`` choices (chunking, compression)
  are reported as notes and do not make runs differ, as is ``forward_order``.
  By default only differences in what both runs hold make them differ (a shared
  tensor's shape or dtype): kinds, tensors, metrics, steps and snapshots present in one
  run only are listed in ``not_compared`` (never silently ignored), and metadata hints
  (layer kind, role, layer path of a shared tensor, manifest fields such as the policy
  or user metadata) become notes. ``strict=True`` counts all of them as differences.
- **numeric** differences per (tensor, kind) over the common steps, each number named
  by the statistic behind it: max absolute error, max relative error (only where the
  relative part of the tolerance dominates, so never an absurd ratio of two values near
  zero), the worst ratio of an error to its tolerance, the minimum cosine similarity of
  snapshots, and the first step at which the tensor leaves tolerance, with both values
  and the tolerance there; metrics likewise. A value ``a`` (run A) agrees with ``b`` (run
  B) when ``|a − b| <= atol + rtol·|b|``; NaN agrees with NaN and ±Inf with the same Inf.
  Statistics one store does not record (``sig`` before schema 1.4.0) are skipped, with a
  note. Steps at which a tensor is recorded in one run only are listed as not compared
  (strict mode: a difference).
- **numerics** (:mod:`.compare_numerics`, ``docs/compare.md``): a tensor whose l2 is
  below its noise floor (``u·G_k(t)``, ``G_k`` the kind's global norm at that step,
  ``u`` the unit roundoff) in both runs is equal there (only its NaN/Inf counts are
  compared); the scale-free ``sig`` and ``zero_frac`` are judged only above the floor;
  ``update`` and ``opt_state`` tolerances grow with the optimizer's gain (Adam's
  lr/(√v̂ + ε), from the recorded ``opt_state``) times the gradient's allowed difference;
  ``param`` tolerances accumulate the updates'. A precision mode (``bf16``, ``fp16``,
  ``tf32``, ``fp32``, ``fp64``; given, or recorded in a store) derives every tolerance
  from the format's unit roundoff and the step count. ``explain`` and ``numerics`` in the
  report state the rules and the numbers used per kind.
- ``first_divergence``: the tensor that left tolerance first — ordered by step, then by
  kind in the order data flows within a step (param, activation, grad, update, opt_state),
  then computation order where the run records its forward order (activations forward,
  gradients backward from the head), else name.

It streams: stats are read ``block_rows`` rows at a time, snapshots one at a time; a
store is never loaded whole.

Default tolerances (:data:`DEFAULT_TOLERANCES`, the base of every kind without a
precision mode), chosen for float32 runs of equivalent models whose only difference is
reduction order (error grows with the number of summed terms and compounds over steps):

=============  ========  ========
kind           atol      rtol
=============  ========  ========
param          1e-6      1e-5
grad           1e-6      1e-4
update         1e-7      1e-4
activation     1e-5      1e-4
opt_state      1e-7      1e-4
metrics        1e-6      1e-5
=============  ========  ========
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from traintape.analysis._common import (
    KIND_RANK,
    ProgressCallback,
    Tracker,
    finite_float,
    forward_rank,
    natural_key,
    tensor_rank,
)
from traintape.analysis.compare_judge import SCALE_FREE, Judge
from traintape.analysis.compare_models import (
    CompareReport,
    KindNumerics,
    StructuralDiff,
    TensorDiff,
    Tolerance,
)
from traintape.analysis.compare_numerics import (
    Precision,
    excluded,
    explain_rules,
    kind_tolerance,
    resolve_precision,
)
from traintape.analysis.compare_stats import Cols, KindPlan, StatsPass, plan_kind
from traintape.core.system import is_system
from traintape.schema import Kind

if TYPE_CHECKING:
    import os

    from traintape.core.reader import Run

__all__ = [
    "DEFAULT_TOLERANCES",
    "SCALE_FREE",
    "CompareReport",
    "KindNumerics",
    "StructuralDiff",
    "TensorDiff",
    "Tolerance",
    "compare",
]

DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "param": Tolerance(atol=1e-6, rtol=1e-5),
    "grad": Tolerance(atol=1e-6, rtol=1e-4),
    "update": Tolerance(atol=1e-7, rtol=1e-4),
    "activation": Tolerance(atol=1e-5, rtol=1e-4),
    "opt_state": Tolerance(atol=1e-7, rtol=1e-4),
    "metrics": Tolerance(atol=1e-6, rtol=1e-5),
}

_IGNORED_MANIFEST = {
    "producer", "run_id", "created_at", "updated_at", "writer", "status", "events", "tensors",
    "commit", "layout",
}  # fmt: skip


_COVERAGE = {"kind", "tensor", "metrics", "steps", "snapshots", "rows"}
"""Structural differences about what one run holds and the other does not."""
_HINT_FIELDS = {"layer_kind", "role", "layer"}
"""Spec fields that describe a tensor rather than its data."""


def _open(x: Run | str | os.PathLike[str]) -> Run:
    from traintape.core.reader import Run, open_run

    return x if isinstance(x, Run) else open_run(x)


def _structure(ra: Run, rb: Run, out: list[StructuralDiff], notes: list[str]) -> None:
    ma, mb = ra.manifest, rb.manifest
    da = ma.model_dump(mode="json")
    db = mb.model_dump(mode="json")
    # forward_order is an ordering hint adapters write when they know it (Linen, torch,
    # Keras; not NNX): equivalent models may have it on one side only
    fa = da.pop("forward_order", None)
    fb = db.pop("forward_order", None)
    # system metrics (sys/*) describe the machine, not the model: which of them a run
    # holds depends on how long it ran (cpu_percent needs two samples), never compared
    for d in (da, db):
        d["metrics"] = [n for n in d.get("metrics") or [] if not is_system(n)]
    if fa is not None and fb is not None and fa != fb:
        notes.append(f"forward order differs: {fa} vs {fb}")
    for key in sorted(set(da) | set(db)):
        if key in _IGNORED_MANIFEST:
            continue
        if da.get(key) != db.get(key):
            out.append(StructuralDiff(what="manifest", field=key, a=da.get(key), b=db.get(key),
                                      message=f"manifest field {key!r} differs"))  # fmt: skip
    if da.get("layout") != db.get("layout"):
        notes.append(f"physical layout differs (not a difference in content): "
                     f"{da.get('layout')} vs {db.get('layout')}")  # fmt: skip
    ka, kb = set(ra.kinds()), set(rb.kinds())
    for k in sorted(ka ^ kb, key=lambda k: KIND_RANK[k]):
        where = "A" if k in ka else "B"
        out.append(
            StructuralDiff(what="kind", kind=k.value, message=f"kind {k.value} only in run {where}")
        )
    for k in sorted(ka & kb, key=lambda k: KIND_RANK[k]):
        sa = {s.name: s for s in ma.specs(k)}
        sb = {s.name: s for s in mb.specs(k)}
        for n in sorted(set(sa) ^ set(sb), key=natural_key):
            where = "A" if n in sa else "B"
            out.append(StructuralDiff(what="tensor", kind=k.value, tensor=n,
                                      message=f"{k.value} {n} only in run {where}"))  # fmt: skip
        for n in sorted(set(sa) & set(sb), key=natural_key):
            for f in ("shape", "dtype", "role", "layer", "layer_kind", "snapshot_shape"):
                va, vb = getattr(sa[n], f), getattr(sb[n], f)
                if va != vb:
                    out.append(StructuralDiff(what="spec", kind=k.value, tensor=n, field=f, a=va, b=vb,
                                              message=f"{k.value} {n}: {f} {va} vs {vb}"))  # fmt: skip
            if k in ma.commit.snapshots or k in mb.commit.snapshots:
                pa = ra.snapshot_steps(n, k).tolist()
                pb = rb.snapshot_steps(n, k).tolist()
                if pa != pb:
                    out.append(StructuralDiff(what="snapshots", kind=k.value, tensor=n, a=pa[:20], b=pb[:20],
                                              message=f"{k.value} {n}: snapshot steps differ"))  # fmt: skip
    st_a, st_b = ra.steps, rb.steps
    if not np.array_equal(st_a, st_b):
        only_a = np.setdiff1d(st_a, st_b)
        only_b = np.setdiff1d(st_b, st_a)
        out.append(StructuralDiff(what="steps", a=only_a[:20].tolist(), b=only_b[:20].tolist(),
                                  message=f"step sets differ: {len(only_a)} steps only in A, "
                                  f"{len(only_b)} only in B"))  # fmt: skip


_MIXED = {"float32", "bfloat16", "float16"}


def _mixed_dtypes(
    structural: list[StructuralDiff], prec: Precision, notes: list[str]
) -> list[StructuralDiff]:
    """Under a reduced-precision mode (bf16, fp16, tf32) a tensor held in float32 in one
    run and in the reduced format in the other (autocast activations) is expected: a
    note, not a difference."""
    if prec.mode not in ("bf16", "fp16", "tf32"):
        return structural
    kept = []
    for sd in structural:
        if sd.what == "spec" and sd.field == "dtype" and {sd.a, sd.b} <= _MIXED:
            notes.append(f"{sd.message} (expected under {prec.mode} mixed precision)")
        else:
            kept.append(sd)
    return kept


def _has_snapshots(ra: Run, rb: Run, kind: Kind) -> bool:
    return bool(ra.manifest.commit.snapshots.get(kind) or rb.manifest.commit.snapshots.get(kind))


def _row_blocks(sa: np.ndarray, sb: np.ndarray, block: int):
    """Yield ((rows_a slice, rows_b slice, idx_a, idx_b), steps, positions) over the
    common steps (positions: index among the common steps)."""
    common, ia, ib = np.intersect1d(sa, sb, assume_unique=True, return_indices=True)
    for s in range(0, len(common), block):
        a_idx, b_idx = ia[s : s + block], ib[s : s + block]
        rows = (
            slice(int(a_idx.min()), int(a_idx.max()) + 1),
            slice(int(b_idx.min()), int(b_idx.max()) + 1),
            a_idx - a_idx.min(),
            b_idx - b_idx.min(),
        )
        yield rows, common[s : s + block], np.arange(s, s + len(a_idx))


def _tolerances(
    atol: float | None, rtol: float | None, tolerances: dict | None
) -> tuple[dict[str, Tolerance], set[str]]:
    """Per-kind base tolerances and the kinds whose tolerances the caller set (those
    stay constant: a precision mode does not replace them)."""
    tols = {k: v.model_copy() for k, v in DEFAULT_TOLERANCES.items()}
    fixed: set[str] = set()
    for k, v in (tolerances or {}).items():
        if k not in tols:
            raise ValueError(f"tolerances: unknown kind {k!r} (kinds: {sorted(tols)})")
        tols[k] = v if isinstance(v, Tolerance) else Tolerance(**{**tols[k].model_dump(), **v})
        fixed.add(k)
    for k in tols:
        if atol is not None:
            tols[k].atol = atol
        if rtol is not None:
            tols[k].rtol = rtol
    if atol is not None or rtol is not None:
        fixed |= set(tols)
    return tols, fixed


def _columns(ra: Run, rb: Run, notes: list[str]) -> Cols:
    """Statistics are matched by name (each store records its own ``stat_names``)."""
    labels = [n for n in ra.manifest.stat_names if n in set(rb.manifest.stat_names)]
    for run, other in ((ra, rb), (rb, ra)):
        lacks = [n for n in other.manifest.stat_names if n not in set(run.manifest.stat_names)]
        if lacks:  # an older store (schema < 1.4.0 has no sig): compared on the rest
            notes.append(
                f"statistics {lacks} not compared: {run.url} (schema "
                f"{run.manifest.schema_version}) does not record them"
            )
    return Cols(
        labels=labels,
        ca=[ra.manifest.stat_names.index(n) for n in labels],
        cb=[rb.manifest.stat_names.index(n) for n in labels],
        l2a=ra.manifest.stat_names.index("l2"),
        l2b=rb.manifest.stat_names.index("l2"),
    )


def _plans(
    ra: Run,
    rb: Run,
    kinds: list[Kind],
    exclude: tuple[str, ...],
    tols: dict[str, Tolerance],
    fixed: set[str],
    precision: Precision,
    gone: list[str],
) -> dict[Kind, KindPlan]:
    """A plan per kind with common, not excluded tensors (excluded ones go to ``gone``)."""
    plans = {}
    for kind in kinds:
        names_b = set(rb.tensor_names(kind))
        common = [n for n in ra.tensor_names(kind) if n in names_b]
        gone += [f"{kind.value} {n}" for n in common if excluded(n, exclude)]
        common = [n for n in common if not excluded(n, exclude)]
        if not common:
            continue
        tol = tols[kind.value]
        prec = Precision(mode=None, unit_roundoff=precision.unit_roundoff, source="set by caller") \
            if kind.value in fixed else precision  # fmt: skip
        plans[kind] = plan_kind(ra, rb, kind, common, (tol.atol, tol.rtol), prec)
        if _has_snapshots(ra, rb, kind):
            steps: set[int] = set()
            for n in common:
                steps |= set(np.intersect1d(ra.snapshot_steps(n, kind),
                                            rb.snapshot_steps(n, kind)).tolist())  # fmt: skip
            plans[kind].snap_steps = steps
    return plans


def _snapshots(ra: Run, rb: Run, plan: KindPlan, sp: StatsPass, tracker: Tracker) -> None:
    """Every common full snapshot, element by element, against the tolerance of its
    tensor at that step (within noise: equal, as its stats)."""
    kind = plan.kind
    for j in plan.judges:
        n, d = j.d.tensor, j.d
        if ra.spec(n, kind).snapshot_shape != rb.spec(n, kind).snapshot_shape:
            tracker.advance()
            continue
        for st in np.intersect1d(ra.snapshot_steps(n, kind), rb.snapshot_steps(n, kind)):
            atol, rtol, within = sp.snap.get((kind, n, int(st)), (d.atol, d.rtol, False))
            xa = ra.snapshot(n, kind, int(st)).astype(np.float64).ravel()[None, :]
            xb = rb.snapshot(n, kind, int(st)).astype(np.float64).ravel()[None, :]
            tol = atol + rtol * np.abs(xb)
            judged = np.full(xa.shape, not within)
            j.add(xa, xb, tol, judged, np.array([st]), "snapshot", np.array([rtol]))
            fa, fb = (np.nan_to_num(x[0], posinf=0, neginf=0) for x in (xa, xb))
            na, nb = np.linalg.norm(fa), np.linalg.norm(fb)
            cos = float(fa @ fb / (na * nb)) if na > 0 and nb > 0 else float(na == nb)
            d.min_cosine = cos if d.min_cosine is None else min(d.min_cosine, cos)
            d.snapshots_compared += 1
        tracker.advance()


def _metrics(
    ra: Run,
    rb: Run,
    tol: Tolerance,
    precision: Precision,
    exclude: tuple[str, ...],
    gone: list[str],
    structural: list[StructuralDiff],
) -> list[Judge]:
    """Every common metric over the steps both runs logged it at."""
    ma, mb = ra.metrics(), rb.metrics()
    common_steps = np.intersect1d(ra.steps, rb.steps)
    out = []
    for c in [c for c in ma.columns if c in set(mb.columns)]:
        if excluded(c, exclude):
            gone.append(f"metric {c}")
            continue
        j = (
            ma[[c]]
            .merge(mb[[c]], how="inner", left_index=True, right_index=True, suffixes=("_a", "_b"))
            .dropna(how="all")
        )
        judge = Judge(c, "metrics", tol.atol, tol.rtol)
        if len(j):
            steps = j.index.to_numpy()
            pos = np.searchsorted(common_steps, steps)
            a, b = j[[f"{c}_a"]].to_numpy(), j[[f"{c}_b"]].to_numpy()
            atol, rtol = kind_tolerance(
                "metrics", precision, pos, np.ones(len(j)), (tol.atol, tol.rtol)
            )
            t = atol[:, None] + rtol[:, None] * np.abs(b)
            judge.add(a, b, t, np.ones(a.shape, bool), steps, ["value"], rtol)
            judge.d.steps_compared = len(j)
        out.append(judge)
    for c in sorted(set(ma.columns) ^ set(mb.columns)):
        if excluded(c, exclude):
            continue
        where = "A" if c in set(ma.columns) else "B"
        structural.append(
            StructuralDiff(what="metrics", tensor=c, message=f"metric {c} only in run {where}")
        )
    return out


def compare(
    run_a: Run | str | os.PathLike[str],
    run_b: Run | str | os.PathLike[str],
    atol: float | None = None,
    rtol: float | None = None,
    *,
    tolerances: dict[str, Tolerance | dict[str, float]] | None = None,
    snapshots: bool = True,
    block_rows: int = 256,
    progress: ProgressCallback | None = None,
    strict: bool = False,
    exclude: Iterable[str] = (),
    precision: str | None = None,
) -> CompareReport:
    """Compare two runs (see module docstring). ``atol``/``rtol`` override every kind's
    tolerances; ``tolerances`` sets them per kind (``{'grad': {'atol': .., 'rtol': ..}}``);
    tolerances set either way are constant (a precision mode does not replace them).
    ``strict``: the stores must be identical in structure too (kinds, tensors, metrics,
    steps, snapshot steps, specs and manifest fields), not only in the data both hold.
    ``exclude``: ``fnmatch`` globs of tensor and metric names left out (listed in
    ``excluded``). ``precision``: ``'bf16'``, ``'fp16'``, ``'tf32'``, ``'fp32'`` or
    ``'fp64'`` (default: what the stores record, else the default tolerances).

    ``progress(stage, done, total)`` is called as work is done; a unit is one block of
    ``block_rows`` common rows of the stats, one tensor's snapshots, or the metrics.
    """
    ra, rb = _open(run_a), _open(run_b)
    exclude = tuple(exclude)
    prec = resolve_precision([ra, rb], precision)
    tols, fixed = _tolerances(atol, rtol, tolerances)
    structural: list[StructuralDiff] = []
    notes: list[str] = []
    gone: list[str] = []
    _structure(ra, rb, structural, notes)
    structural = [s for s in structural if not (s.tensor and excluded(s.tensor, exclude))]
    structural = _mixed_dtypes(structural, prec, notes)
    cols = _columns(ra, rb, notes)
    n_common = len(np.intersect1d(ra.steps, rb.steps))
    kinds = sorted(set(ra.kinds()) & set(rb.kinds()), key=lambda k: KIND_RANK[k])
    plans = _plans(ra, rb, kinds, exclude, tols, fixed, prec, gone)
    tracker = Tracker(progress)
    tracker.add(-(-n_common // block_rows) * len(plans) + 1)
    if snapshots:
        tracker.add(sum(len(p.names) for p in plans.values() if _has_snapshots(ra, rb, p.kind)))
    sp = StatsPass(plans, cols)
    for rows, steps, pos in _row_blocks(ra.steps, rb.steps, block_rows):
        sp.block(ra, rb, rows, steps, pos, tracker)
    judges = [j for k in kinds if k in plans for j in plans[k].judges]
    if snapshots:
        for kind in kinds:
            if kind in plans and _has_snapshots(ra, rb, kind):
                tracker.stage(f"{kind.value} snapshots")
                _snapshots(ra, rb, plans[kind], sp, tracker)
    tracker.stage("metrics")
    mprec = prec if "metrics" not in fixed else Precision(
        mode=None, unit_roundoff=prec.unit_roundoff, source="set by caller")  # fmt: skip
    judges += _metrics(ra, rb, tols["metrics"], mprec, exclude, gone, structural)
    tracker.advance()
    tracker.finish()
    numerics = {k.value: p.summary for k, p in plans.items() if p.summary is not None}
    return _report(ra, rb, strict, structural, notes, judges, tols, n_common, prec, numerics,
                   gone)  # fmt: skip


def _report(
    ra: Run,
    rb: Run,
    strict: bool,
    structural: list[StructuralDiff],
    notes: list[str],
    judges: list[Judge],
    tols: dict[str, Tolerance],
    n_common: int,
    prec: Precision,
    numerics: dict[str, KindNumerics],
    gone: list[str],
) -> CompareReport:
    """The verdict: split what one run holds from real differences, pick the first
    divergence, and say which rules were used."""
    for j in judges:
        d = j.d
        if d.steps_one_sided:
            structural.append(StructuralDiff(
                what="rows", kind=d.kind, tensor=d.tensor,
                message=f"{d.kind} {d.tensor}: {d.steps_one_sided} common steps recorded in "
                "one run only"))  # fmt: skip
    not_compared: list[StructuralDiff] = []
    if not strict:
        kept = []
        for sd in structural:
            if sd.what in _COVERAGE or _snapshots_one_sided(sd):
                not_compared.append(sd)
            elif sd.what == "manifest" or (sd.what == "spec" and sd.field in _HINT_FIELDS):
                notes.append(f"{sd.message} (metadata, not compared)")
            else:
                kept.append(sd)
        structural = kept
    diffs = [j.d for j in judges]
    for d in diffs:
        d.max_abs = finite_float(d.max_abs) if d.max_abs is not None else None
    out_of_tol = [d for d in diffs if not d.within and d.first_step_out is not None]
    first = _first_divergence(out_of_tol, forward_rank(ra), ra.manifest.forward_order is not None)
    identical = not structural and not out_of_tol
    explain = explain_rules(prec, {k: _explain_numbers(v) for k, v in numerics.items()})
    return CompareReport(
        a=ra.url, b=rb.url, identical=identical,
        verdict="identical" if identical else "differs",
        mode="strict" if strict else "shared", structural=structural,
        not_compared=not_compared, notes=notes, tensors=diffs, first_divergence=first,
        tolerances=tols, common_steps=n_common, precision=prec, numerics=numerics,
        excluded=gone, explain=explain,
    )  # fmt: skip


def _first_divergence(
    out_of_tol: list[TensorDiff], rank: dict[str, int], order_known: bool
) -> TensorDiff | None:
    """The tensor that left tolerance first, in the order the step computes it: by step,
    then kind (param, activation, grad, update, opt_state; metrics last), then within a
    kind by computation order — activations forward, gradients *backward* (the head's
    gradient is computed first: a mistake in the loss shows there before it reaches the
    first layer) where the run knows its forward order, else by name."""

    def within_kind(d: TensorDiff) -> int:
        r = tensor_rank(rank, d.tensor)
        if d.kind == Kind.GRAD.value and order_known and r <= len(rank):
            return -r
        return r

    if not out_of_tol:
        return None
    return min(
        out_of_tol,
        key=lambda d: (
            d.first_step_out,
            KIND_RANK.get(Kind(d.kind), 5) if d.kind != "metrics" else 9,
            within_kind(d),
            natural_key(d.tensor),
        ),
    )


def _snapshots_one_sided(sd: StructuralDiff) -> bool:
    """A snapshot shape set in one store and not the other: one run took snapshots of
    the tensor, the other did not — what one run holds, not a difference in data."""
    return sd.what == "spec" and sd.field == "snapshot_shape" and (sd.a is None) != (sd.b is None)


def _explain_numbers(k: KindNumerics) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("global_norm", "noise_floor", "atol", "rtol"):
        v = getattr(k, name)
        if v is not None:
            out[name] = list(v)
    if k.max_gain is not None:
        out["max gain"] = k.max_gain
        out["gain from"] = k.gain_from
    if k.tensors_within_noise:
        shown = k.tensors_within_noise[:6]
        more = len(k.tensors_within_noise) - len(shown)
        out["within noise"] = ", ".join(shown) + (f" (+{more})" if more > 0 else "")
    return out
