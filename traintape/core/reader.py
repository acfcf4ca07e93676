"""Reading a run store: :func:`open_run` returns a :class:`Run`.

A Run shows committed data only: it reads the manifest once (or on :meth:`Run.refresh`)
and never looks past its commit mark, so it is safe to use while another process is
still writing the store.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import tensorstore as ts

from traintape.core import layout as L
from traintape.core.errors import NotAStoreError
from traintape.core.kvstore import Location, local_path, normalize_url
from traintape.core.plausible import check_rows, read
from traintape.core.store import inspect_location, open_array, read_manifest
from traintape.core.system import is_system
from traintape.schema import Event, Kind, Manifest, TensorSpec

if TYPE_CHECKING:
    import xarray as xr


def open_run(url: Location) -> Run:
    """Open a traintape store for reading (local path or TensorStore kvstore URL).

    Raises:
        NotAStoreError: nothing (or something else) is at ``url``.
        SchemaVersionError: the store was written by a newer major schema version.
    """
    u = normalize_url(url)
    if local_path(u) is not None:  # a remote location is diagnosed by its manifest read
        loc = inspect_location(u)
        if not loc.exists:
            raise NotAStoreError(f"no traintape store at {loc.path}: directory does not exist")
    return Run(u)


class Run:
    """A committed view of one run store."""

    def __init__(self, url: str, *, check: bool = True) -> None:
        self.url = normalize_url(url)
        self.manifest: Manifest = read_manifest(self.url)
        self._arrays: dict[str, ts.TensorStore] = {}
        if check:
            self._check()

    def _check(self) -> None:
        """Refuse implausible metadata before anything is read (:mod:`traintape.core.plausible`)."""
        if self.manifest.commit.rows:
            check_rows(self.url, self.manifest, self.array(L.STEPS))

    def refresh(self) -> Run:
        """Re-read the manifest: pick up rows another process committed since."""
        self.manifest = read_manifest(self.url)
        self._arrays.clear()
        for attr in ("steps",):
            self.__dict__.pop(attr, None)
        self._check()
        return self

    # ------------------------------------------------------------------ arrays
    def array(self, path: str) -> ts.TensorStore:
        """The TensorStore handle of an array in the store (e.g. ``'stats/grad'``)."""
        arr = self._arrays.get(path)
        if arr is None:
            arr = open_array(self.url, path, read_only=True, recheck_cached_metadata=True)
            self._arrays[path] = arr
        return arr

    @property
    def rows(self) -> int:
        return self.manifest.commit.rows

    @cached_property
    def steps(self) -> np.ndarray:
        """Optimizer step of every committed row, int64 ``[rows]`` (strictly increasing)."""
        if self.rows == 0:
            return np.zeros(0, dtype=np.int64)
        return read(L.STEPS, self.array(L.STEPS)[: self.rows])

    def tensor_names(self, kind: Kind | str | None = None) -> list[str]:
        """Canonical names (of one kind, in stats-axis order; or all, sorted)."""
        return self.manifest.tensor_names(kind)

    def spec(self, name: str, kind: Kind | str) -> TensorSpec:
        return self.manifest.spec(name, kind)

    def kinds(self) -> list[Kind]:
        return self.manifest.kinds()

    # ------------------------------------------------------------------ stats
    def stats_array(
        self, kind: Kind | str, tensors: list[str] | None = None, rows: slice | None = None
    ) -> np.ndarray:
        """Stat vectors ``[row, tensor, stat]`` float64 (NaN where a row lacks the kind)."""
        kind = Kind(kind)
        names = self.tensor_names(kind)
        if not names:
            raise KeyError(f"no tensors of kind {kind.value} in {self.url}")
        r = rows or slice(0, self.rows)
        start, stop, _ = r.indices(self.rows)
        if stop <= start:
            return np.zeros(
                (0, len(names) if tensors is None else len(tensors), len(self.manifest.stat_names))
            )
        arr = self.array(L.stats_path(kind))[start:stop]
        if tensors is not None:
            idx = [names.index(t) for t in tensors]
            arr = arr[:, idx] if len(idx) != len(names) else arr
        return read(L.stats_path(kind), arr)

    def stats(
        self,
        kind: Kind | str,
        tensors: list[str] | None = None,
        rows: slice | None = None,
        *,
        lazy: bool = False,
        block_rows: int | None = None,
    ) -> pd.DataFrame:
        """Long table: one row per (step, tensor) with a column per stat.

        Columns: ``step``, ``tensor``, then the store's statistics (``manifest.stat_names``).
        Rows where the kind was not recorded are dropped. ``rows``: only these committed
        rows (a slice of the row axis; to stream a large store block by block).

        ``lazy``: a dask DataFrame instead (needs ``dask[dataframe]``), one partition per
        block of ``block_rows`` store rows (default: whole row chunks, about 64 MiB of
        stat vectors); nothing is read until it is computed, and a computation reads only
        the blocks it needs — for stores whose long table does not fit in memory.
        """
        if lazy:
            from traintape.core.lazy import lazy_stats

            return lazy_stats(self, kind, tensors, rows, block_rows)
        kind = Kind(kind)
        names = tensors if tensors is not None else self.tensor_names(kind)
        data = self.stats_array(kind, tensors, rows=rows)
        start = (rows or slice(0, self.rows)).indices(self.rows)[0]
        n_rows, n_t, n_s = data.shape
        df = pd.DataFrame(data.reshape(n_rows * n_t, n_s), columns=list(self.manifest.stat_names))
        df.insert(0, "tensor", np.tile(np.asarray(names, dtype=object), n_rows))
        df.insert(0, "step", np.repeat(self.steps[start : start + n_rows], n_t))
        present = ~np.isnan(data).all(axis=2).reshape(-1)
        return df[present].reset_index(drop=True)

    def dataset(self, *, lazy: bool = False, block_rows: int | None = None) -> xr.Dataset:
        """All committed stats and metrics as an xarray Dataset (dims row/tensor/stat).

        Variables ``stats_<kind>`` have dims ``(step, tensor_<kind>, stat)``; metrics are
        ``metric_<name>`` over ``step``. ``lazy``: the stats variables are dask arrays
        chunked by ``block_rows`` store rows (see :meth:`stats`), read on compute.
        """
        import xarray as xr

        coords: dict[str, Any] = {"step": self.steps, "stat": list(self.manifest.stat_names)}
        data_vars: dict[str, Any] = {}
        for kind in self.kinds():
            dim = f"tensor_{kind.value}"
            coords[dim] = self.tensor_names(kind)
            if lazy:
                from traintape.core.lazy import lazy_stats_array

                values: Any = lazy_stats_array(self, kind, block_rows)
            else:
                values = self.stats_array(kind)
            data_vars[f"stats_{kind.value}"] = (("step", dim, "stat"), values)
        for name, col in self.metrics().items():
            data_vars[f"metric_{name}"] = ("step", col.reindex(self.steps).to_numpy())
        return xr.Dataset(data_vars, coords=coords, attrs={"run_id": self.manifest.run_id})

    # ------------------------------------------------------------------ metrics/events
    def metrics(self) -> pd.DataFrame:
        """Scalar training metrics (what was logged: loss, learning rate, ...), a
        DataFrame indexed by ``step`` (a column per metric; rows where none was logged
        left out). System metrics are in :meth:`system`."""
        return self._metric_frame([n for n in self.manifest.metrics if not is_system(n)])

    def system(self) -> pd.DataFrame:
        """System metrics (``sys/time``, ``sys/step_time``, ``sys/rss_bytes``, ...; see
        :mod:`traintape.core.system`), a DataFrame indexed by ``step``; empty for a run
        recorded without them."""
        return self._metric_frame([n for n in self.manifest.metrics if is_system(n)])

    def _metric_frame(self, names: list[str]) -> pd.DataFrame:
        cols = {}
        for name in names:
            path = L.metric_path(name)
            cols[name] = read(path, self.array(path)[: self.rows])
        df = pd.DataFrame(cols, index=pd.Index(self.steps, name="step"))
        return df.dropna(how="all") if len(df.columns) else df

    def events(self) -> list[Event]:
        return list(self.manifest.events)

    # ------------------------------------------------------------------ snapshots
    def snapshot_steps(self, name: str, kind: Kind | str) -> np.ndarray:
        """Steps at which ``name`` (of ``kind``) has a committed full snapshot."""
        kind = Kind(kind)
        self.spec(name, kind)
        n = self.manifest.commit.snapshots.get(kind, 0)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        return read(L.snapshot_steps_path(kind), self.array(L.snapshot_steps_path(kind))[:n])

    def _snapshot_index(self, name: str, kind: Kind | str, step: int) -> int:
        steps = self.snapshot_steps(name, kind)
        hits = np.flatnonzero(steps == step)
        if hits.size == 0:
            raise KeyError(
                f"no snapshot of {Kind(kind).value} {name!r} at step {step}; "
                f"snapshot steps: {steps.tolist()[:20]}"
            )
        return int(hits[0])

    def snapshot(self, name: str, kind: Kind | str, step: int) -> np.ndarray:
        """The full tensor ``name`` of ``kind`` at ``step``, canonical layout (numpy)."""
        i = self._snapshot_index(name, kind, step)
        return read(L.snapshot_path(kind, name), self.array(L.snapshot_path(kind, name))[i])

    def snapshots(self, name: str, kind: Kind | str) -> ts.TensorStore:
        """Lazy handle ``[snapshot, *shape]`` over the committed snapshots of one tensor."""
        n = len(self.snapshot_steps(name, kind))
        return self.array(L.snapshot_path(kind, name))[:n]

    def trajectory(
        self, name: str, kind: Kind | str, index: tuple[int, ...]
    ) -> tuple[np.ndarray, np.ndarray]:
        """One element's value over all snapshots: ``(steps, values)``.

        Reads only the inner chunks holding that element, never whole tensors.
        """
        steps = self.snapshot_steps(name, kind)
        if len(steps) == 0:
            return steps, np.zeros(0)
        arr = self.array(L.snapshot_path(kind, name))
        sel: Any = (slice(0, len(steps)), *index)
        values = read(L.snapshot_path(kind, name), arr[sel])
        return steps, values

    def __repr__(self) -> str:
        p = self.manifest.producer
        return (
            f"Run({self.url!r}, run_id={self.manifest.run_id}, rows={self.rows}, "
            f"framework={p.framework}, status={self.manifest.status})"
        )
