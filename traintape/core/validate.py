"""Store validation: is this a complete, uncorrupted traintape store?

Checks, in order: the manifest parses and its schema version is readable; every array
the manifest implies exists with the declared shape, dtype and chunking; steps are
strictly increasing and agree with the commit mark; every chunk in the committed range
passes its crc32c checksum (TensorStore verifies it on decode); snapshot steps are
recorded steps; no array exists that the manifest does not account for (orphans).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from traintape.core import layout as L
from traintape.core.errors import NotAStoreError, StoreError
from traintape.core.kvstore import KvStore, Location, local_path, normalize_url
from traintape.core.plausible import check_rows, chunk_count, read, stored_chunks
from traintape.core.store import (
    inspect_location,
    open_array,
    read_manifest,
    stale_lock_files,
    storage_dtype,
)
from traintape.schema import Kind, Manifest, SchemaVersionError


@dataclass
class ValidationReport:
    """Result of :func:`validate`: ``ok`` and one human-readable line per problem."""

    url: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    arrays_checked: int = 0
    chunks_checked: int = 0
    lock_files: list[str] = field(default_factory=list)
    """Temporary ``*.__lock`` files left by interrupted writes (local stores)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok


def validate(url: Location, progress: Callable[[int, int], None] | None = None) -> ValidationReport:
    """Validate the store at ``url``; never raises for a bad store, reports instead.

    ``progress(chunks_checked, total_chunks)`` is called as chunks are read (for progress
    bars; the total is known once every array is opened).
    """
    u = normalize_url(url)
    report = ValidationReport(u)
    if local_path(u) is not None:  # a remote location is diagnosed by its manifest read
        loc = inspect_location(u)
        if not loc.exists:
            report.problems.append(f"{loc.path}: no such directory")
            return report
    try:
        m = read_manifest(u)
    except (NotAStoreError, SchemaVersionError) as e:
        report.problems.append(str(e))
        return report
    except Exception as e:  # an unusable URL, an unreachable kvstore
        report.problems.append(f"{u}: cannot read the store: {type(e).__name__}: {e}")
        return report
    report.manifest = m
    _Checker(u, m, report, progress).run()
    locks = stale_lock_files(u)
    if locks:
        report.notes.append(
            f"{len(locks)} temporary *.__lock file(s) of interrupted writes (e.g. "
            f"{locks[0]}): not data; `traintape validate --repair` or the next writer "
            f"removes them"
        )
    report.lock_files = locks
    return report


class _Checker:
    def __init__(
        self,
        url: str,
        m: Manifest,
        report: ValidationReport,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.progress = progress
        self.total_chunks = 0
        self.url = url
        self.m = m
        self.r = report
        self.kv = KvStore(url)

    def problem(self, msg: str) -> None:
        self.r.problems.append(msg)

    def open(self, path: str) -> ts.TensorStore | None:
        try:
            return open_array(self.url, path, read_only=True)
        except Exception as e:
            self.problem(f"array {path}: missing or unreadable ({_short(e)})")
            return None

    def run(self) -> None:
        m = self.m
        rows = m.commit.rows
        expected: dict[str, tuple[str, tuple[int | None, ...], list[int] | None]] = {}
        shape: tuple[int | None, ...] | list[int] | list[int | None] | None
        if rows or m.tensors or m.metrics:
            expected[L.STEPS] = ("int64", (None,), [m.layout.row_chunk])
        for kind in m.kinds():
            n = len(m.specs(kind))
            n_stats = len(m.stat_names)  # an older store's own stat vector
            expected[L.stats_path(kind)] = (
                "float64",
                (None, n, n_stats),
                [m.layout.row_chunk, n, n_stats],
            )
        for name in m.metrics:
            expected[L.metric_path(name)] = ("float64", (None,), [m.layout.row_chunk])
        snap_kinds = {k: c for k, c in m.commit.snapshots.items() if c > 0}
        for kind in snap_kinds:
            expected[L.snapshot_steps_path(kind)] = ("int64", (None,), None)
            for spec in m.specs(kind):
                shape = spec.snapshot_shape or spec.shape
                dt = (
                    storage_dtype(np.dtype(spec.dtype)).name
                    if spec.dtype != "bfloat16"
                    else "float32"
                )
                expected[L.snapshot_path(kind, spec.name)] = (dt, (None, *shape), None)

        arrays: dict[str, ts.TensorStore] = {}
        for path, (dtype, shape, chunks) in expected.items():
            arr = self.open(path)
            if arr is None:
                continue
            self.r.arrays_checked += 1
            if arr.dtype.name != dtype:
                self.problem(f"array {path}: dtype {arr.dtype.name}, declared {dtype}")
            got = tuple(arr.shape)
            if len(got) != len(shape) or any(
                s is not None and g != s for g, s in zip(got[1:], shape[1:], strict=False)
            ):
                # its chunks are not enumerated: crafted metadata could make that endless
                self.problem(f"array {path}: shape {list(got)}, declared {list(shape)}")
                continue
            arrays[path] = arr
            need = rows if not path.startswith(("snapshot", "snapshots")) else None
            if need is None:
                kind = Kind(path.split("/")[1])
                need = snap_kinds.get(kind, 0)
            if got and got[0] < need:
                self.problem(f"array {path}: {got[0]} rows on disk, commit mark says {need}")
            if chunks is not None:
                cs = _shape(arr.chunk_layout.read_chunk)
                if cs != chunks:
                    self.problem(f"array {path}: chunk shape {cs}, declared {chunks}")

        plausible_rows = True
        if L.STEPS in arrays:
            try:
                check_rows(self.url, m, arrays[L.STEPS], self.kv)
            except StoreError as e:  # reading the rows would allocate what is not there
                self.problem(str(e))
                plausible_rows = False
        if plausible_rows:
            self.check_steps(arrays.get(L.STEPS))
        todo = []
        for path, arr in arrays.items():
            need = rows
            is_snap = path.startswith(L.SNAPSHOT_STEPS) or path.startswith(L.SNAPSHOTS + "/")
            if is_snap:
                need = snap_kinds.get(Kind(path.split("/")[1]), 0)
            elif not plausible_rows:
                continue
            n = min(need, arr.shape[0])
            if self.scan_bounded(path, arr, n):
                todo.append((path, arr, n))
        self.total_chunks = sum(_chunks(arr, n) for _, arr, n in todo)
        for path, arr, n in todo:
            self.check_chunks(path, arr, n)
        if m.layout.all_chunks_stored:
            for path, arr, n in todo:
                self.check_chunks_exist(path, arr, n)
        for kind in snap_kinds:
            arr = arrays.get(L.snapshot_steps_path(kind))
            if arr is not None and L.STEPS in arrays:
                self.check_snapshot_steps(kind, arr)
        self.check_orphans(set(expected))

    def scan_bounded(self, path: str, arr: ts.TensorStore, n: int) -> bool:
        """Whether the chunks of the first ``n`` entries of ``arr`` may be scanned: their
        count (computed, not enumerated) is plausible against the chunks stored — so
        validate's time follows what exists on disk, not what metadata declares."""
        count = _chunks(arr, n)
        if count <= SCAN_FREE:
            return True
        try:
            have = stored_chunks(self.kv, path)
        except Exception as e:
            self.problem(f"array {path}: cannot list chunks ({_short(e)})")
            return False
        if count <= SCAN_SLACK * have + SCAN_FREE:
            return True
        self.problem(
            f"array {path}: its committed range spans {count} chunks but {have} are stored; "
            f"not scanned (crafted or damaged metadata?)"
        )
        return False

    def check_steps(self, arr: ts.TensorStore | None) -> None:
        rows = self.m.commit.rows
        if arr is None or rows == 0:
            if rows == 0 and self.m.commit.last_step is not None:
                self.problem(f"commit mark: 0 rows but last_step {self.m.commit.last_step}")
            return
        try:
            steps = np.asarray(arr[:rows].read().result())
        except Exception as e:
            self.problem(f"array steps: unreadable ({_short(e)})")
            return
        if (steps < 0).any():
            i = int(np.flatnonzero(steps < 0)[0])
            self.problem(f"array steps: row {i} has negative step {int(steps[i])}")
        bad = np.flatnonzero(np.diff(steps) <= 0)
        if bad.size:
            i = int(bad[0]) + 1
            self.problem(
                f"array steps: not strictly increasing at row {i} "
                f"(step {int(steps[i - 1])} then {int(steps[i])})"
            )
        if int(steps[-1]) != self.m.commit.last_step:
            self.problem(
                f"commit mark: last_step {self.m.commit.last_step} but row {rows - 1} "
                f"holds step {int(steps[-1])}"
            )
        self._steps = steps

    def check_snapshot_steps(self, kind: Kind, arr: ts.TensorStore) -> None:
        n = self.m.commit.snapshots.get(kind, 0)
        steps = getattr(self, "_steps", None)
        if steps is None:
            return
        if n > arr.shape[0]:
            return  # reported with the array's shape
        try:
            s = read(L.snapshot_steps_path(kind), arr[:n])
        except StoreError as e:
            self.problem(str(e))
            return
        except Exception:
            return  # reported by check_chunks
        missing = sorted(set(s.tolist()) - set(steps.tolist()))
        if missing:
            self.problem(f"array {L.snapshot_steps_path(kind)}: steps {missing[:5]} have no row")
        if np.any(np.diff(s) <= 0):
            self.problem(f"array {L.snapshot_steps_path(kind)}: not strictly increasing")

    def check_chunks(self, path: str, arr: ts.TensorStore, n: int) -> None:
        """Read every chunk of the first ``n`` entries: crc32c is verified on decode."""
        for sel in _chunk_grid(arr, n):
            origin = [s.start for s in sel]
            self.r.chunks_checked += 1
            if self.progress is not None:
                self.progress(self.r.chunks_checked, self.total_chunks)
            try:
                arr[sel].read().result()
            except Exception as e:
                self.problem(
                    f"array {path}: chunk at {list(origin)} failed to decode ({_short(e)})"
                )

    def check_chunks_exist(self, path: str, arr: ts.TensorStore, n: int) -> None:
        """Every chunk of the first ``n`` entries is stored (a missing chunk would read as
        fill values: rows silently lost). Stores written with ``all_chunks_stored`` keep
        chunks equal to the fill value too, so a missing key is always a lost chunk."""
        chunk = _shape(arr.chunk_layout.write_chunk)
        prefix = f"{path}/c/"
        try:
            have = set(self.kv.list(prefix))
        except Exception as e:
            self.problem(f"array {path}: cannot list chunks ({_short(e)})")
            return
        for sel in _chunk_grid(arr, n):
            key = prefix + "/".join(str(s.start // c) for s, c in zip(sel, chunk, strict=True))
            if key not in have:
                origin = [s.start for s in sel]
                self.problem(f"array {path}: chunk at {origin} is missing ({key})")

    def check_abandoned(self, nodes: set[str]) -> set[str]:
        """The copies of abandoned histories (``abandoned/<k>``, see
        :mod:`traintape.core.rewind`): finished ones are validated as stores of their own;
        unfinished ones are left by a rewind killed during its copy. Returns the copies'
        node paths."""
        from traintape.core.rewind import ABANDONED, abandoned_copies, abandoned_url

        if not any(n.startswith(ABANDONED + "/") for n in nodes):
            return set()
        copies = set()
        for k, finished in sorted(abandoned_copies(self.url).items()):
            c = f"{ABANDONED}/{k}"
            copies.add(c)
            if not finished:
                self.r.notes.append(
                    f"{c}: copy of a rewind killed before it finished; the next rewind replaces it"
                )
                continue
            rep = validate(abandoned_url(self.url, k))
            self.r.problems += [f"{c}: {p}" for p in rep.problems]
        return copies

    def check_orphans(self, expected: set[str]) -> None:
        groups = L.parent_groups(list(expected))
        try:
            keys = self.kv.list()
        except Exception as e:
            self.problem(f"cannot list store keys: {_short(e)}")
            return
        nodes = {k[: -len("/zarr.json")] for k in keys if k.endswith("/zarr.json")}
        copies = self.check_abandoned(nodes)
        for node in sorted(nodes - expected - groups):
            if any(node.startswith(e + "/") for e in expected):
                continue
            if node == "abandoned" or any(node.startswith(c + "/") or node == c for c in copies):
                continue
            if L.is_layout_path(node):
                self.r.notes.append(
                    f"{node}: written but never committed (e.g. before a crash); "
                    f"ignored by readers, replaced on resume"
                )
            else:
                self.problem(f"orphan node {node}: not declared in the manifest")
        for g in sorted(groups - {""}):
            if g not in nodes:
                self.problem(f"group {g}: zarr.json missing (plain Zarr readers will not find it)")


def _shape(grid: ts.ChunkLayout.Grid) -> list[int]:
    """A chunk grid's shape (TensorStore types it optional; a zarr3 array always has one)."""
    return [0 if c is None else int(c) for c in grid.shape or ()]


SCAN_FREE = 100_000
"""Chunks validate scans without first comparing their count with what is stored."""
SCAN_SLACK = 4
"""A scan may visit at most this many times the stored chunks (+ SCAN_FREE): stores
without ``all_chunks_stored`` legitimately omit chunks equal to the fill value."""


def _chunks(arr: ts.TensorStore, n: int) -> int:
    """Write chunks of the first ``n`` entries of ``arr`` (computed, not enumerated)."""
    if n <= 0:
        return 0
    chunk = _shape(arr.chunk_layout.write_chunk)
    return chunk_count([n, *arr.shape[1:]], chunk)


def _chunk_grid(arr: ts.TensorStore, n: int) -> Iterator[tuple[slice, ...]]:
    """Selections of every write chunk of the first ``n`` entries of ``arr`` (lazily:
    count them with :func:`_chunks`)."""
    if n <= 0:
        return
    chunk = [max(c, 1) for c in _shape(arr.chunk_layout.write_chunk)]
    grids = [range(0, n, chunk[0])] + [
        range(0, s, c) for s, c in zip(arr.shape[1:], chunk[1:], strict=True)
    ]
    for origin in itertools.product(*grids):
        yield tuple(
            slice(o, min(o + c, (n if i == 0 else arr.shape[i])))
            for i, (o, c) in enumerate(zip(origin, chunk, strict=True))
        )


def _short(e: Any) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:200]
