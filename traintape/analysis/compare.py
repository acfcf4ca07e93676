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
- **numeric** differences per (tensor, kind) over the common steps: max absolute and max
  relative error of the stat vectors and of the snapshots, the minimum cosine similarity of
  snapshots, and the first step at which the tensor leaves tolerance; metrics likewise.
  A value ``a`` (run A) agrees with ``b`` (run B) when ``|a − b| <= atol + rtol·|b|``;
  NaN agrees with NaN and ±Inf with the same Inf. The layout signature ``sig`` is
  scale-free (a signed sum over ``l2``: its absolute error is about the data's relative
  error), so it is held to ``|a − b| <= max(atol, rtol) + rtol·|b|``. Statistics one
  store does not record (``sig`` in a store older than schema 1.4.0) are skipped, with
  a note.
- ``first_divergence``: the tensor that left tolerance first — ordered by step, then by
  kind in the order data flows within a step (param, activation, grad, update, opt_state),
  then forward order of the layer where known, else name.

It streams: stats are read ``block_rows`` rows at a time, snapshots one at a time; a
store is never loaded whole.

Default tolerances (:data:`DEFAULT_TOLERANCES`), chosen for float32 runs of equivalent
models whose only difference is reduction order (error grows with the number of summed
terms and compounds over steps):

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

from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import (
    KIND_RANK,
    ProgressCallback,
    Tracker,
    finite_float,
    forward_rank,
    natural_key,
    tensor_rank,
)
from traintape.schema import Kind

if TYPE_CHECKING:
    import os

    from traintape.core.reader import Run


class Tolerance(BaseModel):
    atol: float
    rtol: float


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


_COVERAGE = {"kind", "tensor", "metrics", "steps", "snapshots"}
"""Structural differences about what one run holds and the other does not."""
_HINT_FIELDS = {"layer_kind", "role", "layer"}
"""Spec fields that describe a tensor rather than its data."""


class StructuralDiff(BaseModel):
    """One structural difference (``what``: 'tensor', 'kind', 'spec', 'steps', 'snapshots',
    'metrics', 'manifest')."""

    what: str
    kind: str | None = None
    tensor: str | None = None
    field: str | None = None
    a: Any = None
    b: Any = None
    message: str


class TensorDiff(BaseModel):
    """Numeric comparison of one tensor of one kind (or one metric, kind ``metrics``)."""

    tensor: str
    kind: str
    steps_compared: int = 0
    snapshots_compared: int = 0
    max_abs: float | None = Field(None, description="max |a − b| over stats and snapshots")
    max_rel: float | None = Field(None, description="max |a − b| / |b| (where b ≠ 0)")
    worst_stat: str | None = Field(None, description="stat (or 'snapshot') of the max_abs")
    min_cosine: float | None = Field(None, description="lowest snapshot cosine similarity")
    first_step_out: int | None = Field(None, description="first step leaving tolerance")
    first_out_via: str | None = Field(None, description="stat or 'snapshot' that left it")
    within: bool = True
    atol: float
    rtol: float


class CompareReport(BaseModel):
    a: str
    b: str
    identical: bool
    verdict: str = Field(description="'identical' or 'differs'")
    mode: str = Field(
        "shared",
        description="'shared': the verdict judges the data both runs hold; 'strict': the "
        "stores must also be identical in structure",
    )
    structural: list[StructuralDiff] = Field(
        default_factory=list, description="structural differences that make the runs differ"
    )
    not_compared: list[StructuralDiff] = Field(
        default_factory=list,
        description="what only one run holds (shared mode; in strict mode these are "
        "structural differences)",
    )
    notes: list[str] = Field(default_factory=list)
    tensors: list[TensorDiff] = Field(default_factory=list)
    first_divergence: TensorDiff | None = None
    tolerances: dict[str, Tolerance]
    common_steps: int = 0

    def diff(self, tensor: str, kind: str) -> TensorDiff:
        for t in self.tensors:
            if t.tensor == tensor and t.kind == kind:
                return t
        raise KeyError((tensor, kind))


def _open(x: Run | str | os.PathLike[str]) -> Run:
    from traintape.core.reader import Run, open_run

    return x if isinstance(x, Run) else open_run(x)


SCALE_FREE = frozenset({"sig"})
"""Statistics normalised by the tensor's own scale (``sig`` = signed sum / l2): their
absolute error is about the data's *relative* error, so they are held to
``|a − b| <= max(atol, rtol) + rtol·|b|``."""


def _close(
    a: np.ndarray, b: np.ndarray, tol: Tolerance, labels: list[str] | str | None = None
) -> np.ndarray:
    atol: float | np.ndarray = tol.atol
    if isinstance(labels, list) and SCALE_FREE & set(labels):
        atol = np.array([max(tol.atol, tol.rtol) if n in SCALE_FREE else tol.atol for n in labels])
    with np.errstate(all="ignore"):
        ok = np.abs(a - b) <= atol + tol.rtol * np.abs(b)
    same_nonfinite = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
    return ok | same_nonfinite


class _Acc:
    """Running max errors of one tensor."""

    def __init__(self, tensor: str, kind: str, tol: Tolerance) -> None:
        self.d = TensorDiff(tensor=tensor, kind=kind, atol=tol.atol, rtol=tol.rtol)
        self.tol = tol

    def add(
        self, a: np.ndarray, b: np.ndarray, step_of: np.ndarray, labels: list[str] | str
    ) -> None:
        """a, b: [n, m] values at steps ``step_of`` [n]; ``labels`` name the m columns."""
        both = np.isfinite(a) & np.isfinite(b)
        with np.errstate(all="ignore"):
            err = np.where(both, np.abs(a - b), 0.0)
            rel = np.where(both & (b != 0), err / np.abs(b), 0.0)
        if err.size:
            i = np.unravel_index(int(np.argmax(err)), err.shape)
            if self.d.max_abs is None or err[i] > self.d.max_abs:
                self.d.max_abs = float(err[i])
                self.d.worst_stat = labels if isinstance(labels, str) else labels[i[1]]
            r = float(rel.max())
            self.d.max_rel = r if self.d.max_rel is None else max(self.d.max_rel, r)
        bad = ~_close(a, b, self.tol, labels)
        rows = np.flatnonzero(bad.any(axis=1))
        if rows.size:
            r0 = rows[0]
            st = int(step_of[r0])
            if self.d.first_step_out is None or st < self.d.first_step_out:
                self.d.first_step_out = st
                col = int(np.flatnonzero(bad[r0])[0])
                self.d.first_out_via = labels if isinstance(labels, str) else labels[col]
            self.d.within = False


def _structure(ra: Run, rb: Run, out: list[StructuralDiff], notes: list[str]) -> None:
    ma, mb = ra.manifest, rb.manifest
    da = ma.model_dump(mode="json")
    db = mb.model_dump(mode="json")
    # forward_order is an ordering hint adapters write when they know it (Linen, torch,
    # Keras; not NNX): equivalent models may have it on one side only
    fa = da.pop("forward_order", None)
    fb = db.pop("forward_order", None)
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


def _has_snapshots(ra: Run, rb: Run, kind: Kind) -> bool:
    return bool(ra.manifest.commit.snapshots.get(kind) or rb.manifest.commit.snapshots.get(kind))


def _row_blocks(sa: np.ndarray, sb: np.ndarray, block: int):
    """Yield (rows_a slice, rows_b slice, idx_a, idx_b, steps) over the common steps."""
    common, ia, ib = np.intersect1d(sa, sb, assume_unique=True, return_indices=True)
    for s in range(0, len(common), block):
        a_idx, b_idx = ia[s : s + block], ib[s : s + block]
        yield (
            slice(int(a_idx.min()), int(a_idx.max()) + 1),
            slice(int(b_idx.min()), int(b_idx.max()) + 1),
            a_idx - a_idx.min(),
            b_idx - b_idx.min(),
            common[s : s + block],
        )


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
) -> CompareReport:
    """Compare two runs (see module docstring). ``atol``/``rtol`` override every kind's
    default; ``tolerances`` sets them per kind (``{'grad': {'atol': .., 'rtol': ..}}``).
    ``strict``: the stores must be identical in structure too (kinds, tensors, metrics,
    steps, snapshot steps, specs and manifest fields), not only in the data both hold.

    ``progress(stage, done, total)`` is called as work is done; a unit is one block of
    ``block_rows`` common rows of one kind's stats, one tensor's snapshots, or the metrics.
    """
    ra, rb = _open(run_a), _open(run_b)
    tols = {k: v.model_copy() for k, v in DEFAULT_TOLERANCES.items()}
    for k, v in (tolerances or {}).items():
        tols[k] = v if isinstance(v, Tolerance) else Tolerance(**{**tols[k].model_dump(), **v})
    for k in tols:
        if atol is not None:
            tols[k].atol = atol
        if rtol is not None:
            tols[k].rtol = rtol
    structural: list[StructuralDiff] = []
    notes: list[str] = []
    _structure(ra, rb, structural, notes)
    # statistics are matched by name (each store records its own ``stat_names``)
    labels = [n for n in ra.manifest.stat_names if n in set(rb.manifest.stat_names)]
    for run, other in ((ra, rb), (rb, ra)):
        lacks = [n for n in other.manifest.stat_names if n not in set(run.manifest.stat_names)]
        if lacks:  # an older store (schema < 1.4.0 has no sig): compared on the rest
            notes.append(
                f"statistics {lacks} not compared: {run.url} (schema "
                f"{run.manifest.schema_version}) does not record them"
            )
    ca = [ra.manifest.stat_names.index(n) for n in labels]
    cb = [rb.manifest.stat_names.index(n) for n in labels]
    accs: list[_Acc] = []
    sa, sb = ra.steps, rb.steps
    n_common = len(np.intersect1d(sa, sb))
    common_kinds = sorted(set(ra.kinds()) & set(rb.kinds()), key=lambda k: KIND_RANK[k])
    tracker = Tracker(progress)
    n_blocks = -(-n_common // block_rows)
    for kind in common_kinds:
        nc = len(set(ra.tensor_names(kind)) & set(rb.tensor_names(kind)))
        if nc:
            tracker.add(n_blocks)
            if snapshots and _has_snapshots(ra, rb, kind):
                tracker.add(nc)
    tracker.add(1)  # metrics
    for kind in common_kinds:
        names_a, names_b = ra.tensor_names(kind), rb.tensor_names(kind)
        common = [n for n in names_a if n in set(names_b)]
        if not common:
            continue
        tracker.stage(f"{kind.value} stats")
        ja = [names_a.index(n) for n in common]
        jb = [names_b.index(n) for n in common]
        tol = tols[kind.value]
        kacc = [_Acc(n, kind.value, tol) for n in common]
        for sl_a, sl_b, ia, ib, steps in _row_blocks(sa, sb, block_rows):
            A = ra.stats_array(kind, rows=sl_a)[ia][:, ja][:, :, ca]
            B = rb.stats_array(kind, rows=sl_b)[ib][:, jb][:, :, cb]
            present = ~(np.isnan(A).all(axis=2) & np.isnan(B).all(axis=2))
            for t, acc in enumerate(kacc):
                m = present[:, t]
                if m.any():
                    acc.add(A[m, t], B[m, t], steps[m], labels)
                    acc.d.steps_compared += int(m.sum())
            tracker.advance()
        if snapshots and _has_snapshots(ra, rb, kind):
            tracker.stage(f"{kind.value} snapshots")
            specs_a = {s.name: s for s in ra.manifest.specs(kind)}
            specs_b = {s.name: s for s in rb.manifest.specs(kind)}
            for acc in kacc:
                n = acc.d.tensor
                if specs_a[n].snapshot_shape != specs_b[n].snapshot_shape:
                    tracker.advance()
                    continue
                pa = ra.snapshot_steps(n, kind)
                pb = rb.snapshot_steps(n, kind)
                for st in np.intersect1d(pa, pb):
                    xa = ra.snapshot(n, kind, int(st)).astype(np.float64).ravel()
                    xb = rb.snapshot(n, kind, int(st)).astype(np.float64).ravel()
                    acc.add(xa[None, :], xb[None, :], np.array([st]), "snapshot")
                    fa, fb = (
                        np.nan_to_num(xa, posinf=0, neginf=0),
                        np.nan_to_num(xb, posinf=0, neginf=0),
                    )
                    na, nb = np.linalg.norm(fa), np.linalg.norm(fb)
                    cos = float(fa @ fb / (na * nb)) if na > 0 and nb > 0 else float(na == nb)
                    acc.d.min_cosine = (
                        cos if acc.d.min_cosine is None else min(acc.d.min_cosine, cos)
                    )
                    acc.d.snapshots_compared += 1
                tracker.advance()
        accs += kacc
    # metrics
    tracker.stage("metrics")
    mtol = tols["metrics"]
    ma, mb = ra.metrics(), rb.metrics()
    for c in [c for c in ma.columns if c in set(mb.columns)]:
        j = (
            ma[[c]]
            .merge(mb[[c]], how="inner", left_index=True, right_index=True, suffixes=("_a", "_b"))
            .dropna(how="all")
        )
        acc = _Acc(c, "metrics", mtol)
        if len(j):
            acc.add(
                j[[f"{c}_a"]].to_numpy(), j[[f"{c}_b"]].to_numpy(), j.index.to_numpy(), ["value"]
            )
            acc.d.steps_compared = len(j)
        accs.append(acc)
    for c in sorted(set(ma.columns) ^ set(mb.columns)):
        where = "A" if c in set(ma.columns) else "B"
        structural.append(
            StructuralDiff(what="metrics", tensor=c, message=f"metric {c} only in run {where}")
        )

    tracker.finish()
    not_compared: list[StructuralDiff] = []
    if not strict:
        kept = []
        for sd in structural:
            if sd.what in _COVERAGE:
                not_compared.append(sd)
            elif sd.what == "manifest" or (sd.what == "spec" and sd.field in _HINT_FIELDS):
                notes.append(f"{sd.message} (metadata, not compared)")
            else:
                kept.append(sd)
        structural = kept
    diffs = [a.d for a in accs]
    for d in diffs:
        d.max_abs = finite_float(d.max_abs) if d.max_abs is not None else None
    rank = {**forward_rank(ra)}
    out_of_tol = [d for d in diffs if not d.within and d.first_step_out is not None]
    first = None
    if out_of_tol:
        first = min(
            out_of_tol,
            key=lambda d: (
                d.first_step_out,
                KIND_RANK.get(Kind(d.kind), 5) if d.kind != "metrics" else 9,
                tensor_rank(rank, d.tensor),
                natural_key(d.tensor),
            ),
        )
    identical = not structural and not out_of_tol
    return CompareReport(
        a=ra.url,
        b=rb.url,
        identical=identical,
        verdict="identical" if identical else "differs",
        mode="strict" if strict else "shared",
        structural=structural,
        not_compared=not_compared,
        notes=notes,
        tensors=diffs,
        first_divergence=first,
        tolerances=tols,
        common_steps=n_common,
    )
