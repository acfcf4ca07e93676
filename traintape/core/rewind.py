"""Rewind: continue a run from an earlier step (a job restarted from a checkpoint).

``Recorder(url, resume_step=N)`` on a store whose committed history reaches past step
``N``: the rows of steps ``>= N`` and the snapshots of those steps are *abandoned* — the
new history replaces them — but not destroyed:

1. they are first copied, as a complete traintape store of their own (same run id with
   ``-abandoned-<k>``, same policy, specs and metrics), to ``<url>/abandoned/<k>``
   (``k``: the first index without a finished copy), readable with
   ``open_run(f"{url}/abandoned/{k}")``;
2. then one manifest write moves the commit mark back to the last row before ``N``, drops
   the abandoned steps' events (the copy keeps them) and adds a ``rewind`` event at ``N``
   that names the copy.

A process killed during (1) leaves the old history and an unfinished copy (its manifest
is not ``closed``), which the next rewind replaces; killed after (2), the new one. Never a
mix: the commit mark is the only thing readers follow, and it is written once. A finished
copy is never overwritten, even when a deeper rewind abandons the event that named it.
"""

from __future__ import annotations

import numpy as np

from traintape.core.kvstore import KvStore, join
from traintape.core.reader import Run
from traintape.core.store import read_manifest
from traintape.schema import Event, EventType, Kind, Manifest, Severity

ABANDONED = "abandoned"
REWIND = EventType.REWIND


def abandoned_url(url: str, k: int) -> str:
    return join(url, f"{ABANDONED}/{k}")


def abandoned_copies(url: str) -> dict[int, bool]:
    """The copies under ``<url>/abandoned/``: index → finished (its manifest says
    ``closed``; an unfinished one is what a rewind killed during its copy left)."""
    found: dict[int, bool] = {}
    for key in KvStore(url).list(ABANDONED + "/"):
        seg = key.split("/")[1] if key.count("/") >= 1 else ""
        if seg.isdigit() and int(seg) not in found:
            try:
                found[int(seg)] = read_manifest(abandoned_url(url, int(seg))).status == "closed"
            except Exception:  # no or unreadable manifest: unfinished
                found[int(seg)] = False
    return found


def rewind(url: str, m: Manifest, step: int) -> Manifest:
    """Abandon the committed steps ``>= step`` of the store ``url`` (manifest ``m``, as
    committed): copy them to :func:`abandoned_url`, return the manifest of the kept
    history (not yet written: the caller writes it once, under its writer claim).
    Returns ``m`` unchanged when no committed step is ``>= step``."""
    run = Run(url)
    steps = run.steps
    keep = int(np.searchsorted(steps, step, side="left"))
    if keep == len(steps):
        return m
    copies = abandoned_copies(url)
    k = next(i for i in range(len(copies) + 1) if not copies.get(i, False))
    dest = abandoned_url(url, k)
    if k in copies:  # unfinished: left by a rewind killed during its copy
        KvStore(dest).delete_all()
    _copy_rows(run, keep, dest, f"{m.run_id}-abandoned-{k}")
    out = m.model_copy(deep=True)
    out.commit.rows = keep
    out.commit.last_step = int(steps[keep - 1]) if keep else None
    for kind in list(out.commit.snapshots):
        snap_steps = np.asarray(run.snapshot_steps(run.manifest.specs(kind)[0].name, kind))
        out.commit.snapshots[kind] = int(np.searchsorted(snap_steps, step, side="left"))
    out.events = [e for e in out.events if e.step < step]
    out.events.append(
        Event(
            step=step,
            type=REWIND,
            severity=Severity.WARNING,
            message=(
                f"resumed at step {step}: steps {int(steps[keep])}..{int(steps[-1])} "
                f"({len(steps) - keep} rows) of the earlier history were abandoned; they are "
                f"readable at {dest}"
            ),
            data={
                "abandoned": dest,
                "first_step": int(steps[keep]),
                "last_step": int(steps[-1]),
                "rows": len(steps) - keep,
            },
        )
    )
    return out


def _copy_rows(run: Run, start: int, dest: str, run_id: str) -> None:
    """Rows ``start..`` of ``run`` (stats, metrics, snapshots of those steps, events) as a
    new closed store at ``dest``."""
    from traintape.core.recorder import Recorder

    m = run.manifest
    steps = run.steps[start:]
    first = int(steps[0])
    rec = Recorder(dest, m.policy, run_id=run_id, producer=m.producer, user=dict(m.user),
                   flush_every_steps=m.layout.row_chunk, system_metrics=False)  # fmt: skip
    try:
        rec.declare([s.model_copy() for s in m.tensors], in_forward_order=False)
        stats = {k: run.stats_array(k, rows=slice(start, run.rows)) for k in m.kinds()}
        metrics = run.metrics().join(run.system(), how="outer").loc[first:] if m.metrics else None
        snap_at = {
            k: set(int(s) for s in run.snapshot_steps(m.specs(k)[0].name, k))
            for k in m.commit.snapshots
        }
        for i, t in enumerate(int(s) for s in steps):
            for kind in m.kinds():
                vecs = stats[kind][i]
                if np.isnan(vecs).all():
                    continue  # the kind was not recorded at this step
                names = m.tensor_names(kind)
                snaps = None
                if t in snap_at.get(kind, ()):
                    snaps = {n: _as_spec_dtype(run.snapshot(n, kind, t), run, n, kind)
                             for n in names}  # fmt: skip
                rec.record_stats(t, kind, vecs, names=names, snapshots=snaps)
            if metrics is not None and t in metrics.index:
                row = {str(k): float(v) for k, v in metrics.loc[t].items() if not np.isnan(v)}
                if row:
                    rec._log_checked(t, row)  # system metrics too: the original run's
        for e in m.events:  # first NaN/Inf events are found again by the copy itself
            if e.step >= first and e.type not in ("nan", "inf"):
                rec.event(e.step, e.type, e.message, severity=e.severity, tensor=e.tensor,
                          kind=e.kind, **e.data)  # fmt: skip
    finally:
        rec.close()


def _as_spec_dtype(a: np.ndarray, run: Run, name: str, kind: Kind) -> np.ndarray:
    """Snapshots are stored in their storage dtype (bfloat16 widened to float32)."""
    dtype = run.spec(name, kind).dtype
    if a.dtype.name == dtype:
        return a
    if dtype == "bfloat16":
        import ml_dtypes

        return a.astype(ml_dtypes.bfloat16)
    return a.astype(dtype)
