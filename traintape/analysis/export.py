"""Export a run's stats and metrics to Parquet, CSV or NPZ.

- ``parquet`` / ``csv``: a directory with ``stats_<kind>.<ext>`` (long table: step, tensor,
  one column per stat) per kind, and ``metrics.<ext>`` (step + one column per metric).
- ``npz``: one file with ``steps`` [rows], ``stats_<kind>`` [row, tensor, stat],
  ``tensors_<kind>`` (names), ``stat_names`` and ``metric_<name>`` [rows]; with
  ``snapshots=True`` also ``snapshot/<kind>/<name>`` [snapshot, *shape] and their steps.

Parquet/CSV stats are streamed in blocks of rows (memory holds one block); NPZ holds a
kind's stats array at once; snapshots one tensor at a time.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

import numpy as np

from traintape.analysis._common import ProgressCallback, Tracker

if TYPE_CHECKING:
    import pandas as pd

    from traintape.core.reader import Run
    from traintape.schema import Kind

Format = Literal["parquet", "csv", "npz"]


def export(
    run: Run,
    out: str | os.PathLike[str],
    format: Format = "parquet",
    *,
    snapshots: bool = False,
    progress: ProgressCallback | None = None,
) -> list[str]:
    """Export ``run`` to ``out`` (a directory for parquet/csv, a file for npz); returns paths.

    ``progress(stage, done, total)`` is called as work is done; a unit is one kind's stats,
    the metrics, one tensor's snapshots (npz with ``snapshots``) or writing the npz file.
    """
    if format not in ("parquet", "csv", "npz"):
        raise ValueError(f"unknown export format {format!r}: use parquet, csv or npz")
    out = os.fspath(out)
    written: list[str] = []
    tracker = Tracker(progress)
    tracker.add(len(run.kinds()) + 1)
    if format == "npz":
        snap_kinds = [k for k in run.kinds() if snapshots and k in run.manifest.commit.snapshots]
        tracker.add(sum(len(run.tensor_names(k)) for k in snap_kinds) + 1)
        arrays: dict[str, np.ndarray] = {
            "steps": run.steps,
            "stat_names": np.asarray(run.manifest.stat_names),
        }
        for kind in run.kinds():
            tracker.stage(f"{kind.value} stats")
            arrays[f"stats_{kind.value}"] = run.stats_array(kind)
            arrays[f"tensors_{kind.value}"] = np.asarray(run.tensor_names(kind))
            tracker.advance()
            if kind in snap_kinds:
                tracker.stage(f"{kind.value} snapshots")
                for n in run.tensor_names(kind):
                    st = run.snapshot_steps(n, kind)
                    if len(st):
                        arrays[f"snapshot/{kind.value}/{n}"] = np.asarray(
                            run.snapshots(n, kind).read().result()
                        )
                        arrays[f"snapshot_steps/{kind.value}/{n}"] = st
                    tracker.advance()
        tracker.stage("metrics")
        met = run.metrics().reindex(run.steps)
        for c in met.columns:
            arrays[f"metric_{c}"] = met[c].to_numpy()
        tracker.advance()
        tracker.stage("writing npz")
        path = out if out.endswith(".npz") else out + ".npz"
        np.savez_compressed(path, **arrays)  # type: ignore[arg-type]
        tracker.finish()
        return [path]
    os.makedirs(out, exist_ok=True)
    for kind in run.kinds():
        tracker.stage(f"{kind.value} stats")
        written.append(_write_stats(run, kind, out, format))
        tracker.advance()
    tracker.stage("metrics")
    written.append(_write_table(run.metrics().reset_index(), out, "metrics", format))
    tracker.finish()
    return written


BLOCK_VALUES = 1 << 20
"""(row, tensor) pairs per block when streaming a kind's stats to parquet/csv."""


def _write_stats(run: Run, kind: Kind, out: str, format: str) -> str:
    """``stats_<kind>.<format>``: the long table of :meth:`Run.stats`, written block by
    block of rows (one parquet row group per block), so memory holds one block."""
    path = os.path.join(out, f"stats_{kind.value}.{format}")
    per = max(1, BLOCK_VALUES // max(1, len(run.tensor_names(kind))))
    if format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
    writer = None
    try:
        for start in range(0, max(run.rows, 1), per):
            df = run.stats(kind, rows=slice(start, min(start + per, run.rows)))
            if format == "csv":
                df.to_csv(path, index=False, mode="w" if start == 0 else "a", header=start == 0)
                continue
            table = pa.Table.from_pandas(df, preserve_index=False)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()
    return path


def _write_table(df: pd.DataFrame, out: str, stem: str, format: str) -> str:
    """Write ``df`` as ``<out>/<stem>.<format>`` (parquet or csv), without the index."""
    path = os.path.join(out, f"{stem}.{format}")
    if format == "parquet":
        df.to_parquet(path, index=False)
    else:
        df.to_csv(path, index=False)
    return path
