"""Export a run's stats and metrics to Parquet, CSV or NPZ.

- ``parquet`` / ``csv``: a directory with ``stats_<kind>.<ext>`` (long table: step, tensor,
  one column per stat) per kind, and ``metrics.<ext>`` (step + one column per metric).
- ``npz``: one file with ``steps`` [rows], ``stats_<kind>`` [row, tensor, stat],
  ``tensors_<kind>`` (names), ``stat_names`` and ``metric_<name>`` [rows]; with
  ``snapshots=True`` also ``snapshot/<kind>/<name>`` [snapshot, *shape] and their steps.

Stats are read one kind at a time; snapshots one tensor at a time.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

import numpy as np

from traintape.schema import STAT_NAMES

if TYPE_CHECKING:
    from traintape.core.reader import Run

Format = Literal["parquet", "csv", "npz"]


def export(
    run: Run, out: str | os.PathLike[str], format: Format = "parquet", *, snapshots: bool = False
) -> list[str]:
    """Export ``run`` to ``out`` (a directory for parquet/csv, a file for npz); returns paths."""
    out = os.fspath(out)
    written: list[str] = []
    if format == "npz":
        arrays: dict[str, np.ndarray] = {"steps": run.steps, "stat_names": np.asarray(STAT_NAMES)}
        for kind in run.kinds():
            arrays[f"stats_{kind.value}"] = run.stats_array(kind)
            arrays[f"tensors_{kind.value}"] = np.asarray(run.tensor_names(kind))
            if snapshots and kind in run.manifest.commit.snapshots:
                for n in run.tensor_names(kind):
                    st = run.snapshot_steps(n, kind)
                    if len(st):
                        arrays[f"snapshot/{kind.value}/{n}"] = np.asarray(
                            run.snapshots(n, kind).read().result()
                        )
                        arrays[f"snapshot_steps/{kind.value}/{n}"] = st
        met = run.metrics().reindex(run.steps)
        for c in met.columns:
            arrays[f"metric_{c}"] = met[c].to_numpy()
        path = out if out.endswith(".npz") else out + ".npz"
        np.savez_compressed(path, **arrays)  # type: ignore[arg-type]
        return [path]
    if format not in ("parquet", "csv"):
        raise ValueError(f"unknown export format {format!r}: use parquet, csv or npz")
    os.makedirs(out, exist_ok=True)
    for kind in run.kinds():
        df = run.stats(kind)
        path = os.path.join(out, f"stats_{kind.value}.{format}")
        if format == "parquet":
            df.to_parquet(path, index=False)
        else:
            df.to_csv(path, index=False)
        written.append(path)
    met = run.metrics().reset_index()
    path = os.path.join(out, f"metrics.{format}")
    if format == "parquet":
        met.to_parquet(path, index=False)
    else:
        met.to_csv(path, index=False)
    written.append(path)
    return written
