"""The asynchronous store writer: a bounded queue, a background thread, commit marks.

The training thread hands finished rows and snapshots to :class:`StoreWriter` through
a bounded queue (it waits only when the queue is full; those stalls are counted in the
manifest). The writer thread buffers rows and, every ``flush_every_steps`` rows or
``flush_every_seconds`` seconds (and on flush/close), writes each row-axis array once
for the whole block, issues snapshot writes as they arrive, waits until every write is
durable, and only then rewrites the manifest with the new commit mark — atomically, as
a single kvstore write of the root ``zarr.json``. A process killed at any instant
therefore leaves a store whose manifest describes only durable data.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from traintape.core import layout as L
from traintape.core.claim import WriterClaim
from traintape.core.errors import StoreError
from traintape.core.kvstore import KvStore, local_path
from traintape.core.store import open_array, write_manifest
from traintape.schema import N_STATS, CommitMark, Kind, Manifest

log = logging.getLogger("traintape")


@dataclass
class Row:
    """One recorded step: stat vectors per kind (manifest order) and scalar metrics."""

    step: int
    stats: dict[Kind, np.ndarray] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Part:
    """This process's block of a tensor of a multi-process job (canonical layout).

    The snapshot array of such a tensor is sharded by ``block`` (one shard per block per
    snapshot); each process writes the blocks it holds at ``offset``, process 0 creates and
    grows the array and commits once every process has confirmed its blocks
    (:class:`PartWriter`). ``data`` None: this process writes nothing of the tensor (its
    block is empty, or another process writes the same replicated block).
    """

    data: np.ndarray | None
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    """Global (whole-tensor) canonical shape."""
    block: tuple[int, ...]
    """Shard shape of the array: every process's block lies inside one such shard."""
    dtype: str

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else int(self.data.nbytes)


@dataclass
class Snapshot:
    """Full tensors of one kind at one step, in canonical layout (owned by the writer):
    whole arrays, or this process's :class:`Part` of a tensor of a multi-process job."""

    step: int
    kind: Kind
    tensors: dict[str, np.ndarray | Part]


@dataclass(frozen=True)
class _CommitPlan:
    """What one commit of :class:`StoreWriter` writes, decided before anything is
    (:meth:`StoreWriter._plan`)."""

    manifest: Manifest
    """The Recorder's manifest as of the plan; the commit step sets its commit mark."""
    rows: slice
    """The new rows ``[committed, committed + buffered)`` of every row-axis array."""
    last_step: int | None
    """The step of the last row the commit mark will cover."""
    capacity: int
    """Row capacity of the row arrays after this commit (whole ``row_block`` s)."""
    create: dict[str, dict[str, Any]]
    """Row arrays to create (path → metadata at ``capacity``): not vouched for by the
    committed manifest nor created by this writer."""
    grow: tuple[str, ...]
    """Existing row arrays too short for ``rows``: resized to ``capacity``."""
    blocks: dict[str, np.ndarray]
    """The values of ``rows`` per row-axis array (path → block)."""
    followers_need: dict[Kind, int]
    """Snapshots (per kind) whose :class:`Part` s every other process must have confirmed
    before the commit mark covers them."""
    final: bool
    """The closing commit: trim the arrays and mark the run closed."""


def _row_blocks(m: Manifest, rows: list[Row]) -> dict[str, np.ndarray]:
    """The block of ``rows`` for every row-axis array of ``m``: steps, the stat vectors of
    each kind (NaN where a row has none of the kind), each metric (NaN where not logged)."""
    n = len(rows)
    blocks = {L.STEPS: np.fromiter((r.step for r in rows), dtype=np.int64, count=n)}
    for kind in m.kinds():
        block = np.full((n, len(m.specs(kind)), N_STATS), np.nan)
        for i, r in enumerate(rows):
            v = r.stats.get(kind)
            if v is not None:
                block[i] = v
        blocks[L.stats_path(kind)] = block
    for name in m.metrics:
        blocks[L.metric_path(name)] = np.fromiter(
            (r.metrics.get(name, np.nan) for r in rows), dtype=np.float64, count=n
        )
    return blocks


@dataclass
class _Control:
    op: str  # "flush" | "close"
    done: threading.Event = field(default_factory=threading.Event)


class _QueueWorker:
    """A background thread fed through ``_queue``; :meth:`flush` and :meth:`close` are
    control messages it answers in order (flush: everything before it is durable; close:
    the same, then the thread ends)."""

    _thread: threading.Thread
    _queue: queue.Queue[Any]
    _handed_bytes: int = 0  # data bytes of every item put so far (uncompressed)

    def bytes_written(self) -> int:
        """Bytes of data (stat vectors, metrics, snapshot tensors; uncompressed) handed
        to this writer so far — the ``sys/bytes_written`` system metric."""
        return self._handed_bytes

    def flush(self, timeout: float | None = None) -> None:
        """Make everything enqueued so far durable; returns when it is (or failed)."""
        self._control("flush", timeout)

    def close(self, timeout: float | None = None) -> None:
        """Make everything durable and finish (the store writer also commits, trims the
        arrays to their committed size and marks the run closed)."""
        if self._thread.is_alive():
            self._control("close", timeout)
            self._thread.join(timeout)

    def _control(self, op: str, timeout: float | None) -> None:
        if not self._thread.is_alive():
            return
        c = _Control(op)
        self._queue.put(c)
        c.done.wait(timeout)


class StoreWriter(_QueueWorker):
    """Background writer of one run store. Create through :class:`~traintape.Recorder`."""

    def __init__(
        self,
        url: str,
        manifest: Manifest,
        manifest_copy: Callable[[], Manifest],
        *,
        flush_every_steps: int,
        flush_every_seconds: float,
        max_pending: int,
        max_pending_bytes: int = 1 << 30,
        claim: WriterClaim | None = None,
        followers: int = 0,
        followers_timeout: float = 300.0,
    ) -> None:
        self.url = url
        self.followers = followers  # processes 1..followers write Parts (multi-process job)
        self.followers_timeout = followers_timeout
        self._parts_upto: dict[Kind, int] = {}  # snapshots (per kind) holding Parts
        self.kv = KvStore(url)
        self.layout = manifest.layout
        self._manifest_copy = manifest_copy
        self.flush_every_steps = flush_every_steps
        self.flush_every_seconds = flush_every_seconds
        self._queue: queue.Queue[Row | Snapshot | _Control] = queue.Queue(maxsize=max_pending)
        self.max_pending_bytes = max_pending_bytes
        self._bytes_cond = threading.Condition()
        self._pending_bytes = 0  # snapshot bytes handed over and not yet durable
        self._written_bytes = 0  # of those, issued to TensorStore since the last commit
        self._rows: list[Row] = []
        self._deferred: list[_Control] = []
        self._pending: list[ts.WriteFutures | ts.Future[Any]] = []
        self._arrays: dict[str, ts.TensorStore] = {}
        self._groups_written: set[str] = {""}
        self._committed_paths = L.committed_paths(manifest)
        commit = manifest.commit
        self.rows_committed = commit.rows
        self.last_step = commit.last_step
        self.sequence = commit.sequence
        # snapshot bookkeeping per kind: steps written (committed ones first)
        self._snap_steps: dict[Kind, list[int]] = {}
        self._snap_capacity: dict[Kind, int] = {}
        self._row_capacity = 0
        self._writer_stats = manifest.writer.model_copy()
        self._stats_lock = threading.Lock()
        self._last_commit = time.monotonic()
        self._claim = claim
        # chunks equal to the fill value are stored too, so validate can tell a missing
        # chunk from an all-NaN one (StoreLayout.all_chunks_stored)
        self._store_all: dict[str, Any] = (
            {"store_data_equal_to_fill_value": True} if manifest.layout.all_chunks_stored else {}
        )
        self._heartbeat_every = claim.stale_after / 3 if claim is not None else None
        self._last_heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self._last_good: Manifest = manifest.model_copy(deep=True)
        self._open_existing(manifest)
        self._thread = threading.Thread(target=self._run, name="traintape-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread
    @property
    def pending_bytes(self) -> int:
        """Bytes of snapshots handed over and not yet committed (host memory held)."""
        return self._pending_bytes

    def put(self, item: Row | Snapshot) -> None:
        """Enqueue an item; blocks (a counted stall) only if the queue is full."""
        if self.error is not None:
            return
        t0 = time.perf_counter()
        stalled = False
        if isinstance(item, Row):
            self._handed_bytes += 8 * (len(item.metrics) + 1) + sum(
                int(v.nbytes) for v in item.stats.values()
            )
        if isinstance(item, Snapshot):
            nbytes = sum(int(a.nbytes) for a in item.tensors.values())
            self._handed_bytes += nbytes
            with self._bytes_cond:
                while (
                    self._pending_bytes > 0
                    and self._pending_bytes + nbytes > self.max_pending_bytes
                    and self.error is None
                ):
                    stalled = True
                    self._bytes_cond.wait(0.1)
                self._pending_bytes += nbytes
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            stalled = True
            self._queue.put(item)
        if stalled:
            with self._stats_lock:
                self._writer_stats.stalls += 1
                self._writer_stats.stall_seconds += time.perf_counter() - t0

    def _release_bytes(self, everything: bool = False) -> None:
        """Snapshots written by this commit are durable: let the training thread on."""
        with self._bytes_cond:
            self._pending_bytes = 0 if everything else self._pending_bytes - self._written_bytes
            self._written_bytes = 0
            self._bytes_cond.notify_all()

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while True:
            dirty = bool(self._rows or self._pending)
            now = time.monotonic()
            commit_in = self._last_commit + self.flush_every_seconds - now if dirty else None
            beat_in = (
                self._last_heartbeat + self._heartbeat_every - now
                if self._heartbeat_every is not None and self.error is None
                else None
            )
            waits = [w for w in (commit_in, beat_in) if w is not None]
            timeout = max(0.0, min(waits)) if waits else None
            try:
                item = self._deferred.pop(0) if self._deferred else self._queue.get(timeout=timeout)
            except queue.Empty:
                if dirty and time.monotonic() >= self._last_commit + self.flush_every_seconds:
                    self._guarded(self._commit)
                else:
                    self._guarded(self._heartbeat)
                continue
            if isinstance(item, _Control):
                if item.op == "close":
                    self._guarded(lambda: self._commit(final=True))
                    item.done.set()
                    return
                self._guarded(self._commit)
                item.done.set()
                continue
            if self.error is not None:
                continue  # capture is disabled: drain without writing
            if isinstance(item, Row):
                self._rows.append(item)
                if len(self._rows) >= self.flush_every_steps:
                    self._take_backlog()
                    self._guarded(self._commit)
            else:
                self._guarded(functools.partial(self._write_snapshot, item))
                if self._written_bytes >= self.max_pending_bytes // 2:
                    self._guarded(self._commit)  # make them durable: frees the byte budget

    def _take_backlog(self) -> None:
        """Before a commit, take rows already waiting so one commit (one fsync round)
        covers a backlog instead of the training thread stalling behind many commits."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Row):
                self._rows.append(item)
            elif isinstance(item, Snapshot):
                self._guarded(functools.partial(self._write_snapshot, item))
            else:  # a control message: put it back in front by handling after commit
                self._deferred.append(item)
                return

    def _guarded(self, fn: Callable[[], None]) -> None:
        if self.error is not None:
            return
        try:
            fn()
        except BaseException as e:
            self._fail(e)

    def _heartbeat(self) -> None:
        """Renew the writer claim (raises StoreError when it was lost: store removed,
        renamed or taken over)."""
        if self._claim is not None:
            self._claim.refresh()
        self._last_heartbeat = time.monotonic()

    def release_claim(self) -> None:
        if self._claim is not None:
            self._claim.release()

    def _fail(self, e: BaseException) -> None:
        self.error = e
        self._rows.clear()
        self._pending.clear()
        self._release_bytes(everything=True)
        lost = self._claim is not None and not self._claim.held
        if lost:  # the store is gone or another writer owns it: say so, write nothing
            msg = (
                f"traintape: {e}. Capture is DISABLED for the rest of this run; nothing more "
                f"is written to {self.url}."
            )
        else:
            msg = (
                f"traintape: storage failure writing {self.url}: {type(e).__name__}: {e}. "
                f"Capture is DISABLED for the rest of this run; the {self.rows_committed} "
                f"rows committed so far stay readable."
            )
        log.debug(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)  # once, from the writer thread
        if lost:
            return
        # Best effort: say so in the manifest, keeping the last good commit mark.
        try:
            m = self._last_good.model_copy(deep=True)
            m.status = "failed"
            m.writer = self.writer_stats()
            m.writer.disabled = True
            m.writer.error = f"{type(e).__name__}: {e}"
            self._write_manifest(m)
        except Exception:
            pass
        self.release_claim()

    def writer_stats(self) -> Any:
        with self._stats_lock:
            return self._writer_stats.model_copy()

    # ------------------------------------------------------------------ arrays
    def _open_existing(self, manifest: Manifest) -> None:
        """On resume, learn the capacity of existing arrays and committed snapshot steps."""
        if manifest.commit.rows == 0 and not manifest.tensors and not manifest.metrics:
            return
        steps = self._open(L.STEPS)
        self._row_capacity = steps.shape[0]
        for kind, count in manifest.commit.snapshots.items():
            arr = self._open(L.snapshot_steps_path(kind))
            self._snap_steps[kind] = [int(s) for s in arr[:count].read().result()]
            self._snap_capacity[kind] = arr.shape[0]

    def _open(self, path: str) -> ts.TensorStore:
        arr = self._arrays.get(path)
        if arr is None:
            arr = open_array(self.url, path, **self._store_all)
            self._arrays[path] = arr
        return arr

    def _create(self, path: str, metadata: dict[str, Any]) -> ts.TensorStore:
        self._ensure_groups(path)
        arr = open_array(self.url, path, metadata=metadata, **self._store_all)
        self._arrays[path] = arr
        return arr

    def _exists(self, path: str) -> bool:
        """Known array: created by this writer or vouched for by the committed manifest.

        Arrays at other paths are leftovers of writes that never committed (a crash):
        they are recreated, never reused.
        """
        return path in self._arrays or path in self._committed_paths

    def _ensure_groups(self, path: str) -> None:
        for g in sorted(L.parent_groups([path]) - self._groups_written):
            if g and self.kv.read_bytes(f"{g}/zarr.json") is None:
                self.kv.write_json(f"{g}/zarr.json", L.group_metadata())
            self._groups_written.add(g)

    def _row_arrays(self, m: Manifest, cap: int | None = None) -> dict[str, dict[str, Any]]:
        """Every row-axis array the manifest needs, with its metadata at capacity ``cap``
        (None: the current capacity)."""
        cap = self._row_capacity if cap is None else cap
        arrays = {L.STEPS: L.row_array_metadata(self.layout, cap, (), "int64", ["row"])}
        for kind in m.kinds():
            arrays[L.stats_path(kind)] = L.stats_metadata(
                self.layout, kind.value, cap, len(m.specs(kind))
            )
        for name in m.metrics:
            arrays[L.metric_path(name)] = L.row_array_metadata(
                self.layout, cap, (), "float64", ["row"]
            )
        return arrays

    # ------------------------------------------------------------------ writes
    def _write_snapshot(self, snap: Snapshot) -> None:
        kind = snap.kind
        steps = self._snap_steps.setdefault(kind, [])
        index = len(steps)
        cap = self._snap_capacity.get(kind, 0)
        grow = index >= cap
        new_cap = cap + L.SNAPSHOT_BLOCK if grow else cap
        sp = L.snapshot_steps_path(kind)
        if not self._exists(sp):
            self._create(
                sp,
                L.row_array_metadata(self.layout, new_cap, (), "int64", [f"snapshot_{kind.value}"]),
            )
        elif grow:
            self._arrays[sp] = self._open(sp).resize(exclusive_max=[new_cap]).result()
        for name, value in snap.tensors.items():
            path = L.snapshot_path(kind, name)
            if not self._exists(path):
                if isinstance(value, Part):
                    shape, dtype, block = value.shape, value.dtype, value.block
                else:
                    shape, dtype, block = value.shape, value.dtype.name, None
                self._create(
                    path, L.snapshot_metadata(self.layout, name, new_cap, shape, dtype, block)
                )
            elif grow or self._open(path).shape[0] < new_cap:
                arr = self._open(path)
                self._arrays[path] = arr.resize(
                    exclusive_max=[new_cap, *arr.shape[1:]], expand_only=True
                ).result()
            if isinstance(value, Part):
                self._parts_upto[kind] = index + 1  # the other processes write theirs
                if value.data is None:
                    continue
                sel = part_index(index, value)
                self._pending.append(self._arrays[path][sel].write(value.data))
            else:
                self._pending.append(self._arrays[path][index].write(value))
            self._written_bytes += value.nbytes
        self._pending.append(self._arrays[sp][index].write(np.int64(snap.step)))
        self._snap_capacity[kind] = new_cap
        steps.append(snap.step)

    def _commit(self, final: bool = False) -> None:
        """One commit, in three steps (the order is the crash-safety argument of the
        module docstring): :meth:`_plan` decides what to write, :meth:`_write_and_wait`
        grows the row arrays, writes the block of new rows and waits until every write
        since the last commit is durable, and only then :meth:`_write_commit_mark` moves
        the commit mark (``final``: after trimming the arrays, marking the run closed)."""
        # still our store? (removed, renamed or taken over: StoreError, nothing written)
        self._heartbeat()
        plan = self._plan(final)
        self._write_and_wait(plan)
        self._write_commit_mark(plan)

    def _plan(self, final: bool) -> _CommitPlan:
        """What this commit writes: the buffered rows as one block per row-axis array,
        the row arrays to create or grow to hold them, and the snapshot blocks other
        processes must have confirmed. Reads array shapes; writes nothing."""
        m = self._manifest_copy()
        rows = self._rows
        r0 = self.rows_committed
        r1 = r0 + len(rows)
        # Every row array must hold r1 rows. Each existing array is grown from its own
        # shape: after a kill during close() of a resumed run some arrays may be trimmed
        # and others not, so no one array's shape stands for all.
        block = self.layout.row_block
        capacity = -(-r1 // block) * block if r1 > self._row_capacity else self._row_capacity
        create: dict[str, dict[str, Any]] = {}
        grow: list[str] = []
        for path, meta in self._row_arrays(m, capacity).items():
            if not self._exists(path):
                create[path] = meta
            elif self._open(path).shape[0] < r1:
                grow.append(path)
        last_step = rows[-1].step if rows else self.last_step
        upto = last_step if last_step is not None else -1
        return _CommitPlan(
            manifest=m,
            rows=slice(r0, r1),
            last_step=last_step,
            capacity=capacity,
            create=create,
            grow=tuple(grow),
            blocks=_row_blocks(m, rows) if rows else {},
            followers_need={
                kind: bisect.bisect_right(s, upto)
                for kind, s in self._snap_steps.items()
                if kind in self._parts_upto
            },
            final=final,
        )

    def _write_and_wait(self, plan: _CommitPlan) -> None:
        """Create or grow the row arrays, write the block of new rows, and wait until it
        and every snapshot write issued since the last commit is durable (the file
        kvstore fsyncs before a write completes), and until the other processes of a
        multi-process job have confirmed their snapshot blocks. Then the buffers are
        dropped and the training thread's byte budget is freed."""
        self._row_capacity = plan.capacity
        for path, meta in plan.create.items():
            self._create(path, meta)
        for path in plan.grow:
            arr = self._open(path)
            self._arrays[path] = arr.resize(
                exclusive_max=[plan.capacity, *arr.shape[1:]], expand_only=True
            ).result()
        futures = list(self._pending)
        for path, values in plan.blocks.items():
            futures.append(self._open(path)[plan.rows].write(values))
        for f in futures:
            f.result()  # durable (file kvstore fsyncs) before the commit mark moves
        self._wait_for_followers(plan.followers_need)
        self._pending.clear()
        self._release_bytes()
        self._rows = []

    def _write_commit_mark(self, plan: _CommitPlan) -> None:
        """Make the planned rows visible: (``final``: trim the arrays to what is
        committed, status ``closed``) set the new :class:`CommitMark` and writer stats on
        the manifest and rewrite the root ``zarr.json`` — one atomic kvstore write. Call
        only once :meth:`_write_and_wait` has returned: the mark vouches for durable
        data only."""
        m, r1, last_step = plan.manifest, plan.rows.stop, plan.last_step
        if plan.final:
            self._trim(m, r1, last_step)
        self.rows_committed = r1
        self.last_step = last_step
        self.sequence += 1
        committed_snaps = {
            kind: bisect.bisect_right(steps_, last_step if last_step is not None else -1)
            for kind, steps_ in self._snap_steps.items()
        }
        m.commit = CommitMark(
            rows=r1, snapshots=committed_snaps, last_step=last_step, sequence=self.sequence
        )
        with self._stats_lock:
            self._writer_stats.commits += 1
        m.writer = self.writer_stats()
        if plan.final:
            m.status = "closed"
        self._write_manifest(m)
        self._last_good = m
        self._last_commit = time.monotonic()

    def _wait_for_followers(self, need: dict[Kind, int]) -> None:
        """Before a commit mark covers snapshots with :class:`Part` s: wait until every
        other process has confirmed (its progress key) that its blocks of them are
        durable. A slow process delays the commit, not training (until the queue fills);
        one silent for ``followers_timeout`` seconds fails the writer (capture stops
        loudly; every step committed before stays valid)."""
        need = {k: n for k, n in need.items() if n > 0}
        if not self.followers or not need:
            return
        waiting = set(range(1, self.followers + 1))

        def confirmed() -> bool:
            for rank in sorted(waiting):
                done = read_progress(self.kv, rank)
                if all(done.get(k.value, 0) >= n for k, n in need.items()):
                    waiting.discard(rank)
            return not waiting

        _poll(
            confirmed,
            self.followers_timeout,
            lambda: (
                f"{self.url}: process(es) {sorted(waiting)} did not confirm their snapshot "
                f"blocks ({ {k.value: n for k, n in need.items()} }) within "
                f"{self.followers_timeout:.0f} s; capture stops, committed steps stay valid"
            ),
        )

    def _trim(self, m: Manifest, rows: int, last: int | None) -> None:
        """Shrink arrays to exactly what is committed, so plain Zarr readers see no padding."""
        for path in self._row_arrays(m):
            if self._exists(path):
                arr = self._open(path)
                if arr.shape[0] != rows:
                    self._arrays[path] = arr.resize(
                        exclusive_max=[rows, *arr.shape[1:]], shrink_only=True
                    ).result()
        self._row_capacity = rows
        for kind, steps_ in self._snap_steps.items():
            count = bisect.bisect_right(steps_, last if last is not None else -1)
            del steps_[count:]
            paths = [L.snapshot_steps_path(kind)] + [
                L.snapshot_path(kind, s.name) for s in m.specs(kind)
            ]
            for path in paths:
                if self._exists(path):
                    arr = self._open(path)
                    if arr.shape[0] != count:
                        self._arrays[path] = arr.resize(
                            exclusive_max=[count, *arr.shape[1:]], shrink_only=True
                        ).result()
            self._snap_capacity[kind] = count
        self._remove_empty_dirs()

    def _remove_empty_dirs(self) -> None:
        """Local stores: remove the empty chunk directories that shrinking arrays leaves
        behind (the file kvstore deletes keys, not directories)."""
        root = local_path(self.url)
        if root is None:
            return
        for top in (L.STEPS, L.STATS, L.METRICS, L.SNAPSHOTS, L.SNAPSHOT_STEPS):
            base = os.path.join(root, top)
            for dirpath, _dirs, files in os.walk(base, topdown=False):
                if not files and dirpath != base:
                    with contextlib.suppress(OSError):  # not empty after all: keep it
                        os.rmdir(dirpath)

    def _write_manifest(self, m: Manifest) -> None:
        write_manifest(self.kv, m)


def _poll(done: Callable[[], bool], timeout: float, failure: Callable[[], str]) -> None:
    """Wait until ``done()`` (checked at once, then after 1 ms, doubling to 50 ms: a
    waiting commit or write waits little for another process); ``StoreError(failure())``
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not done():
        if time.monotonic() > deadline:
            raise StoreError(failure())
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


PROGRESS = ".traintape/progress"
"""Key prefix of the per-process progress records of a multi-process job."""


def progress_key(rank: int) -> str:
    return f"{PROGRESS}/{rank}.json"


def read_progress(kv: KvStore, rank: int) -> dict[str, int]:
    """``{kind: snapshots whose blocks process rank has made durable}`` (empty if none)."""
    raw = kv.read_bytes(progress_key(rank))
    if raw is None:
        return {}
    try:
        return {str(k): int(v) for k, v in json.loads(raw)["snapshots"].items()}
    except (ValueError, KeyError, TypeError):
        return {}


def clear_progress(kv: KvStore) -> None:
    """Remove every progress record (process 0, when it opens the store: records of an
    earlier job must not vouch for this one's blocks)."""
    for k in kv.list(PROGRESS + "/"):
        kv.delete(k)


def part_index(index: int, part: Part) -> tuple[Any, ...]:
    """The selection of ``part`` in snapshot ``index`` of its array."""
    assert part.data is not None
    return (
        index,
        *(slice(o, o + n) for o, n in zip(part.offset, part.data.shape, strict=True)),
    )


class PartWriter(_QueueWorker):
    """The writer of a process other than 0 in a multi-process job.

    It writes nothing but this process's :class:`Part` s of snapshots, in a background
    thread: for each snapshot (in the order the recorder hands them over, the same on
    every process) it waits until process 0 has created or grown the array to hold it,
    writes its blocks, waits until they are durable, then records its progress
    (:func:`progress_key`) — what process 0 waits for before committing. Rows, metrics
    and whole arrays are process 0's and are dropped here. A failure (or process 0 not
    growing an array within ``timeout`` seconds) stops this writer loudly; the store keeps
    every step committed before.
    """

    rows_committed = 0

    def __init__(self, url: str, rank: int, manifest: Manifest, timeout: float = 300.0) -> None:
        self.url = url
        self.rank = rank
        self.kv = KvStore(url)
        self.timeout = timeout
        self.error: BaseException | None = None
        self._store_all: dict[str, Any] = (
            {"store_data_equal_to_fill_value": True} if manifest.layout.all_chunks_stored else {}
        )
        self._count = {k.value: n for k, n in manifest.commit.snapshots.items()}
        self._arrays: dict[str, ts.TensorStore] = {}
        self._queue: queue.Queue[Snapshot | _Control] = queue.Queue(maxsize=64)
        self._thread = threading.Thread(target=self._run, name="traintape-parts", daemon=True)
        self._thread.start()

    def put(self, item: object) -> None:
        if isinstance(item, Snapshot) and self.error is None:
            self._queue.put(item)

    def release_claim(self) -> None:
        pass  # holds none: process 0 holds the job's claim

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Control):
                item.done.set()
                if item.op == "close":
                    return
                continue
            if self.error is not None:
                continue
            try:
                self._write(item)
            except BaseException as e:
                self.error = e
                log.error(
                    "traintape: process %d stopped writing its snapshot blocks to %s: %s: %s",
                    self.rank, self.url, type(e).__name__, e,
                )  # fmt: skip

    def _write(self, snap: Snapshot) -> None:
        kind = snap.kind.value
        index = self._count.get(kind, 0)
        futures = []
        for name, value in snap.tensors.items():
            if not isinstance(value, Part) or value.data is None:
                continue
            arr = self._grown(L.snapshot_path(snap.kind, name), index)
            futures.append(arr[part_index(index, value)].write(value.data))
        for f in futures:
            f.result()  # durable before the progress record says so
        self._count[kind] = index + 1
        self.kv.write_json(progress_key(self.rank), {"snapshots": dict(self._count)})

    def _grown(self, path: str, index: int) -> ts.TensorStore:
        """The array at ``path`` once process 0 has created it with room for ``index``."""
        arr = self._arrays.get(path)
        if arr is not None and arr.shape[0] > index:
            return arr

        def grown() -> bool:
            if self.kv.read_bytes(f"{path}/zarr.json") is None:
                return False
            self._arrays[path] = open_array(self.url, path, **self._store_all)
            return self._arrays[path].shape[0] > index

        _poll(
            grown,
            self.timeout,
            lambda: (
                f"{self.url}: array {path} was not created or grown to hold snapshot "
                f"{index} by process 0 within {self.timeout:.0f} s"
            ),
        )
        return self._arrays[path]
