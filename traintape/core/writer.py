"""The asynchronous store writer: a bounded queue, a background thread, commit marks.

The training thread hands finished rows and snapshots to :class:`StoreWriter` through
a bounded queue (it waits only when the queue is full; those stalls are counted in the
manifest). The writer thread buffers rows and, every ``flush_every_steps`` rows or
``flush_every_seconds`` seconds (and on flush/close), writes each row-axis array once
for the whole block, issues snapshot writes as they arrive, waits until every write is
durable, and only then rewrites the manifest with the new commit mark — atomically, as
a single kvstore write of the root ``zarr.json``. A process killed at any instant
therefore leaves a store whose manifest describes only durable data.

Snapshot shards of a local store without compression — a whole tensor's, or a process's
block of a multi-process job when it is one whole shard (:func:`part_shard`) — are
written straight to their files (:class:`_DirectShard`: the bytes TensorStore would
write, without its copies; fsync, rename and directory fsync in a small I/O pool, like
TensorStore's file kvstore); a whole tensor's may arrive piece by piece (:class:`Piece`,
a streamed snapshot): the writer encodes each piece as it comes, so a snapshot of any
size needs a bounded amount of host memory. Everything else goes through TensorStore.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from traintape.core import layout as L
from traintape.core.claim import WriterClaim
from traintape.core.errors import StoreError
from traintape.core.kvstore import KvStore, local_path
from traintape.core.store import open_array, write_manifest
from traintape.schema import STAT_INDEX, STAT_NAMES, CommitMark, Kind, Manifest

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
    holders: bool = False
    """True: every process — process 0 too — hands its blocks over apart from the step's
    rows (:meth:`traintape.core.recorder.Recorder.put_blocks`; JAX, whose blocks arrive
    from per-device callbacks) and confirms them like the other processes do; the Part
    in the step's snapshot then carries no data and only says so."""

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else int(self.data.nbytes)


@dataclass
class Piece:
    """Rows ``[start, start + len(data))`` along axis 0 of one tensor of a *streamed*
    snapshot (canonical layout, a private host copy the writer owns): an adapter hands a
    large tensor over piece by piece, so host memory holds at most the writer's byte
    budget of it (:meth:`traintape.core.recorder.Recorder.stream_snapshot`)."""

    data: np.ndarray
    start: int
    shape: tuple[int, ...]
    """The whole tensor's shape."""

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


try:  # the C implementation (a dependency of zarr): checksums at memory speed
    import google_crc32c as _crc32c

    _CRC = _crc32c if getattr(_crc32c, "implementation", "c") == "c" else None
except ImportError:  # pragma: no cover - zarr requires it
    _CRC = None

_IOV = 1020  # iovecs per writev (IOV_MAX is 1024 on Linux)
_FSYNC_THREADS = 4
"""Shards made durable side by side (:meth:`_DirectShard.finish`): concurrent fsyncs
share journal commits (ext4 here: 2 threads took 18-32% longer than 4, 2 writer processes)."""


def _fsync_pool() -> ThreadPoolExecutor:
    """The pool that makes finished shards durable (:meth:`_DirectShard.finish`)."""
    return ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="traintape-fsync")


_TMP = itertools.count()
STREAM_BYTES = 192 << 20
"""Streamed snapshot pieces (:class:`Piece`) held at most (copied, not yet written)
before the training thread waits: the extra host memory of a full snapshot of any size
(pieces are a quarter of it)."""
_FILL = {"f": np.nan, "b": False, "i": -1, "u": 0}  # the arrays' fill values (layout)


def direct_geometry(
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunk_bytes: int,
    inner: tuple[int, ...] | None = None,
) -> tuple[int, int] | None:
    """``(split_axis, rows_per_chunk)`` when the shard of a snapshot of ``shape`` can be
    written straight from a C-ordered array: every inner chunk (``inner``, by default
    :func:`traintape.core.layout.inner_chunk`) is one contiguous range of it (axes before
    ``split_axis`` have chunk size 1, axes after it are whole). None: write through
    TensorStore (zero-size axes, big-endian or non-numeric dtypes, no fast crc32c)."""
    if _CRC is None or dtype.kind not in "fiub" or dtype.byteorder == ">" or 0 in shape:
        return None
    if dtype.byteorder == "=" and np.little_endian is False:  # pragma: no cover
        return None
    if inner is None:
        inner = tuple(L.inner_chunk(shape, dtype.itemsize, chunk_bytes))
    elif len(inner) != len(shape):
        return None
    split = max((i for i, (c, s) in enumerate(zip(inner, shape, strict=True)) if c != s), default=0)
    if any(c != 1 for c in inner[:split]):
        return None
    return split, (inner[split] if shape else 1)


def stream_rows(shape: tuple[int, ...], dtype: np.dtype, chunk_bytes: int, target: int) -> int:
    """Rows (axis 0) per :class:`Piece` of a streamed tensor: about ``target`` bytes,
    whole inner chunks (so the writer can encode each piece as it comes)."""
    if not shape:
        return 1
    geo = direct_geometry(shape, dtype, chunk_bytes)
    row = math.prod(shape[1:]) * dtype.itemsize
    step = geo[1] if geo is not None and geo[0] == 0 else 1
    rows = max(step, (max(target, 1) // max(row, 1)) // step * step)
    return min(rows, shape[0])


class _DirectShard:
    """One snapshot shard (one tensor at one snapshot) written straight to its file in
    the Zarr v3 ``sharding_indexed`` format the array's metadata declares
    (:func:`traintape.core.layout.snapshot_metadata` with ``compression='none'``): each
    inner chunk's bytes (padded with the fill value past the array's end) and its crc32c,
    then the index and its crc32c. The same bytes TensorStore would write, without its
    copies: the data go from the caller's array to the file (``writev``), piece by piece.

    Like TensorStore's file kvstore, the shard is written to ``<key>.<n>.__lock``, then
    :meth:`finish` (in the writer's I/O pool) fsyncs it, renames it into place and fsyncs
    the directory: the future it returns is durable data."""

    def __init__(
        self, path: str, shape: tuple[int, ...], dtype: np.dtype, geometry: tuple[int, int]
    ) -> None:
        self.path = path
        self.tmp = f"{path}.{next(_TMP)}.__lock"  # unique: an earlier one may be in flight
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        split, k = geometry
        self.shape = shape
        self.dtype = dtype
        self.n = shape[split] if shape else 1  # extent of the split axis
        self.k = k  # its rows per chunk
        self.per_row = math.prod(shape[split + 1 :]) * dtype.itemsize  # bytes per split row
        self.lead = math.prod(shape[:split])
        self.chunks_along = -(-self.n // k)
        self.total = math.prod(shape) * dtype.itemsize
        self.done = 0  # bytes of the tensor consumed
        self.rows = 0  # axis-0 rows consumed
        self.offset = 0  # bytes written to the file
        self.index = np.empty((self.lead * self.chunks_along, 2), dtype="<u8")
        self.chunk = 0  # next inner chunk (C order)
        fill = np.full(k * self.per_row // dtype.itemsize, _FILL[dtype.kind], dtype=dtype)
        self.fill = fill.view(np.uint8)

    @property
    def complete(self) -> bool:
        return self.done == self.total

    def add(self, data: np.ndarray, start: int) -> None:
        """Write rows ``[start, start + len(data))`` (axis 0) — the next rows, ending on
        an inner chunk's boundary or at the tensor's end."""
        if start != self.rows:
            raise StoreError(f"{self.path}: piece at row {start}, expected row {self.rows}")
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        end = self.done + flat.nbytes
        bufs: list[Any] = []
        pos = 0
        while self.done + pos < end:
            q = self.chunk % self.chunks_along
            valid = min(self.k, self.n - q * self.k) * self.per_row
            if pos + valid > flat.nbytes:
                raise StoreError(f"{self.path}: a piece ends inside an inner chunk")
            part = flat[pos : pos + valid]
            pad = self.k * self.per_row - valid
            crc = _CRC.value(part)  # type: ignore[union-attr]
            bufs.append(part)
            if pad:
                crc = _CRC.extend(crc, self.fill[:pad])  # type: ignore[union-attr]
                bufs.append(self.fill[:pad])
            bufs.append(crc.to_bytes(4, "little"))
            size = valid + pad + 4
            self.index[self.chunk] = (self.offset, size)
            self.offset += size
            self.chunk += 1
            pos += valid
            if len(bufs) >= _IOV - 3:
                self._writev(bufs)
                bufs = []
        self._writev(bufs)
        self.done = end
        self.rows += int(data.shape[0]) if data.ndim else 1

    def _writev(self, bufs: list[Any]) -> None:
        if not bufs:
            return
        want = sum(memoryview(b).nbytes for b in bufs)
        n = os.writev(self.fd, bufs)
        if n < want:  # a short write: the rest one buffer at a time
            rest = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)[n:]
            while rest:
                rest = rest[os.write(self.fd, rest) :]

    def finish(self) -> Callable[[], None]:
        """Write the index; returns the durable part (fsync, rename, directory fsync), to
        run in the writer's I/O pool."""
        idx = self.index.tobytes()
        self._writev([idx, _CRC.value(idx).to_bytes(4, "little")])  # type: ignore[union-attr]
        fd, tmp, path = self.fd, self.tmp, self.path
        self.fd = -1

        def durable() -> None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(d)
            finally:
                os.close(d)

        return durable

    def abort(self) -> None:
        """Drop an unfinished shard (a streamed snapshot that never completed)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(OSError):
            os.remove(self.tmp)


def part_shard(
    root: str, path: str, index: int, part: Part, arr: ts.TensorStore
) -> _DirectShard | None:
    """A direct writer of the one shard that ``part`` fills in snapshot ``index`` of
    ``arr`` (the array at ``path`` of the local uncompressed store at ``root``), or None
    (TensorStore writes it): the part's data must be exactly one whole shard — shape
    ``block``, offset a multiple of ``block`` on every axis — of the array's own chunk
    layout. Its key (default chunk key encoding) is ``c/<index>/<offset[i] // block[i]>/...``."""
    data = part.data
    block = tuple(part.block)
    if data is None or tuple(data.shape) != block or data.dtype.name != part.dtype:
        return None
    if any(o % b for o, b in zip(part.offset, block, strict=True)):
        return None
    chunks = arr.chunk_layout
    shard = tuple(int(n or 0) for n in chunks.write_chunk.shape or ())
    inner = tuple(int(n or 0) for n in chunks.read_chunk.shape or ())
    if shard != (1, *block):  # not sharded by the block
        return None
    geo = direct_geometry(block, data.dtype, 0, inner[1:])
    if geo is None:
        return None
    grid = (str(o // b) for o, b in zip(part.offset, block, strict=True))
    return _DirectShard(os.path.join(root, path, "c", str(index), *grid), block, data.dtype, geo)


def _fill(shard: _DirectShard, data: np.ndarray) -> None:
    """Write ``data``, the whole of ``shard`` (its file is dropped if that fails)."""
    try:
        shard.add(data, 0)
    except BaseException:
        shard.abort()
        raise


@dataclass
class Snapshot:
    """Full tensors of one kind at one step, in canonical layout (owned by the writer):
    whole arrays, this process's :class:`Part` of a tensor of a multi-process job, or
    :class:`Piece` s of a streamed snapshot.

    ``final`` False: a streamed snapshot goes on (more items of the same step and kind
    follow); the snapshot counts (its step is written) only with its final item. A
    streamed snapshot whose final item never comes is dropped when the next snapshot of
    the kind starts (its slot is reused)."""

    step: int
    kind: Kind
    tensors: dict[str, np.ndarray | Part | Piece]
    final: bool = True


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
    # the store's own stat vector: this build's, or an older schema's subset of it (a
    # resumed older store keeps its columns; the rows carry this build's full vectors)
    cols = None if tuple(m.stat_names) == STAT_NAMES else [STAT_INDEX[s] for s in m.stat_names]
    for kind in m.kinds():
        block = np.full((n, len(m.specs(kind)), len(m.stat_names)), np.nan)
        for i, r in enumerate(rows):
            v = r.stats.get(kind)
            if v is not None:
                block[i] = v if cols is None else v[:, cols]
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
    write_timeout: float = math.inf
    """Seconds the writer thread may go without progress before it is declared hung."""
    _busy_since: float | None = None  # monotonic time of the writer's last progress
    _hung = False  # declared hung (:meth:`_check_hung`): the training thread waits no more

    def _check_hung(self) -> bool:
        """Whether the writer is hung: busy without progress for ``write_timeout`` seconds
        (storage that stopped answering). Called from the training thread, which then
        waits for the writer no more (:meth:`_declare_hung`)."""
        if self._hung:
            return True
        since = self._busy_since
        if since is None or time.monotonic() - since <= self.write_timeout:
            return False
        self._declare_hung(time.monotonic() - since)
        return True

    def _declare_hung(self, seconds: float) -> None:
        self._hung = True

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
            if not self._hung:
                self._thread.join(timeout)

    def _control(self, op: str, timeout: float | None) -> None:
        """Send control message ``op`` and wait until it is answered (or ``timeout``
        seconds, or the writer is declared hung: then it returns at once)."""
        if not self._thread.is_alive() or self._check_hung():
            return
        c = _Control(op)
        while True:
            try:
                self._queue.put(c, timeout=0.1)
                break
            except queue.Full:
                if self._check_hung():
                    return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not c.done.wait(0.1):
            if self._check_hung() or (deadline is not None and time.monotonic() > deadline):
                return


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
        write_timeout: float = 120.0,
    ) -> None:
        self.url = url
        self.write_timeout = write_timeout
        self._hang_handled = False
        self.followers = followers  # processes 1..followers write Parts (multi-process job)
        self.followers_timeout = followers_timeout
        self._parts_upto: dict[Kind, int] = {}  # snapshots (per kind) holding Parts
        self._self_confirms = False  # process 0's own blocks come through a PartWriter
        self.kv = KvStore(url)
        self.layout = manifest.layout
        self._manifest_copy = manifest_copy
        self.flush_every_steps = flush_every_steps
        self.flush_every_seconds = flush_every_seconds
        self._queue: queue.Queue[Row | Snapshot | _Control] = queue.Queue(maxsize=max_pending)
        self.max_pending_bytes = max_pending_bytes
        self.stream_bytes = min(max_pending_bytes, STREAM_BYTES)
        """Bytes of streamed snapshot pieces held not yet written before a put waits."""
        self._bytes_cond = threading.Condition()
        self._pending_bytes = 0  # snapshot bytes handed over and not yet durable
        self._written_bytes = 0  # of those, issued to TensorStore since the last commit
        self._rows: list[Row] = []
        # direct shard writes (local, uncompressed stores): open shards, the fsync pool
        self._direct_root = local_path(url) if manifest.layout.compression == "none" else None
        self._shards: dict[tuple[Kind, str], _DirectShard] = {}
        self._open_snap: dict[Kind, int] = {}  # kind -> step of the snapshot being written
        self._finishing: dict[str, Future[None]] = {}  # shard path -> its durable part
        self._io: ThreadPoolExecutor | None = None
        self._deferred: list[_Control] = []
        self._pending: list[ts.WriteFutures | ts.Future[Any] | Future[None]] = []
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
        """Enqueue an item; blocks (a counted stall) only if the queue is full, and
        never longer than until the writer is declared hung (:meth:`_check_hung`: no
        progress for ``write_timeout`` seconds — capture is then disabled and items are
        dropped; training goes on at full speed)."""
        if self.error is not None or self._check_hung():
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
            limit = self.max_pending_bytes if item.final else self.stream_bytes
            with self._bytes_cond:
                while (
                    self._pending_bytes > 0
                    and self._pending_bytes + nbytes > limit
                    and self.error is None
                ):
                    stalled = True
                    self._bytes_cond.wait(0.1)
                    if self._check_hung():
                        return
                self._pending_bytes += nbytes
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            stalled = True
            while True:
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    if self._check_hung():
                        return
        if stalled:
            with self._stats_lock:
                self._writer_stats.stalls += 1
                self._writer_stats.stall_seconds += time.perf_counter() - t0

    def wait_for_room(self, nbytes: int) -> None:
        """Block (a counted stall) until ``nbytes`` more of streamed pieces fit
        :attr:`stream_bytes` — called *before* a piece is copied to the host, so the
        copy itself stays within the budget."""
        t0 = time.perf_counter()
        stalled = False
        with self._bytes_cond:
            while (
                self._pending_bytes > 0
                and self._pending_bytes + nbytes > self.stream_bytes
                and self.error is None
            ):
                stalled = True
                self._bytes_cond.wait(0.1)
                if self._check_hung():
                    return
        if stalled:
            with self._stats_lock:
                self._writer_stats.stalls += 1
                self._writer_stats.stall_seconds += time.perf_counter() - t0

    def _release_bytes(self, everything: bool = False, streamed: int = 0) -> None:
        """Snapshots written by this commit are durable (or ``streamed`` bytes of pieces
        are in their shard files, out of this process's memory): let the training
        thread on."""
        with self._bytes_cond:
            if streamed:
                self._pending_bytes -= streamed
            else:
                self._pending_bytes = 0 if everything else self._pending_bytes - self._written_bytes
                self._written_bytes = 0
            self._bytes_cond.notify_all()

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while True:
            if self._hung:  # declared hung and back: say so in the store, then end
                self._after_hang()
                return
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
            self._busy_since = None  # idle: waiting for work is not a hang
            try:
                item = self._deferred.pop(0) if self._deferred else self._queue.get(timeout=timeout)
            except queue.Empty:
                self._busy_since = time.monotonic()
                if dirty and time.monotonic() >= self._last_commit + self.flush_every_seconds:
                    self._guarded(self._commit)
                else:
                    self._guarded(self._heartbeat)
                continue
            self._busy_since = time.monotonic()
            if isinstance(item, _Control):
                if item.op == "close":
                    self._guarded(lambda: self._commit(final=True))
                    self._drop_io()
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
                if (
                    self._written_bytes
                    >= (self.max_pending_bytes if item.final else self.stream_bytes) // 2
                ):
                    self._guarded(self._commit)  # make them durable: frees the byte budget
            if self._commit_due():  # whatever the queue holds: never starved by a busy queue
                self._take_backlog()
                self._guarded(self._commit)

    def _commit_due(self) -> bool:
        """Whether data is pending and ``flush_every_seconds`` have passed since the last
        commit (checked after every item, not only when the queue runs empty: a producer
        that keeps the queue full must not starve the commits)."""
        return bool(self._rows or self._pending) and (
            time.monotonic() >= self._last_commit + self.flush_every_seconds
        )

    def _take_backlog(self) -> None:
        """Before a commit, take rows already waiting so one commit (one fsync round)
        covers a backlog instead of the training thread stalling behind many commits.

        Bounded: at most the items waiting when it starts (``max_pending``), taken within
        ``flush_every_seconds`` — a producer that refills the queue as fast as it is
        taken never postpones the commit (issue 25: with an unbounded loop a busy queue
        meant no commit at all), and slow commits cover a backlog each instead of a row
        or two (storage slower than capture then costs throughput, never commits)."""
        deadline = time.monotonic() + self.flush_every_seconds
        for _ in range(self._queue.qsize()):
            if time.monotonic() >= deadline:
                return
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

    def _progress(self) -> None:
        """The writer thread made progress (a write completed): not hung."""
        if self._busy_since is not None:
            self._busy_since = time.monotonic()

    def _declare_hung(self, seconds: float) -> None:
        """No progress for ``seconds`` (training thread): disable capture loudly, without
        touching storage (it hangs); the writer thread, if it ever comes back, marks the
        store failed and releases the claim (:meth:`_after_hang`)."""
        self._hung = True
        err = StoreError(
            f"{self.url}: the writer made no progress for {seconds:.0f} s (write_timeout "
            f"{self.write_timeout:g} s): storage hung or unreachable"
        )
        if self.error is None:
            self.error = err
        with self._bytes_cond:
            self._bytes_cond.notify_all()
        msg = (
            f"traintape: {err}. Capture is DISABLED for the rest of this run; training goes "
            f"on; the {self.rows_committed} rows committed so far stay readable."
        )
        log.error(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _after_hang(self) -> None:
        """Writer thread, back from a call that hung: drop what is buffered, mark the
        store failed with the last good commit mark, release the claim (best effort)."""
        if self._hang_handled:
            return
        self._hang_handled = True
        self._rows.clear()
        self._pending.clear()
        self._drop_io()
        self._release_bytes(everything=True)
        if self.error is not None:
            self._mark_failed(self.error)
        if self._claim is not None:
            self._claim.release()

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
        if self._claim is not None and not self._hung:  # (hung: the writer thread does)
            self._claim.release()

    def _drop_io(self) -> None:
        """Abort unfinished shards and end the fsync pool (its queued work runs first)."""
        for shard in self._shards.values():
            shard.abort()
        self._shards.clear()
        self._open_snap.clear()
        self._finishing.clear()
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    def _fail(self, e: BaseException) -> None:
        if self._hung:  # already reported: the hung call failed at last
            self._after_hang()
            return
        self.error = e
        self._rows.clear()
        self._pending.clear()
        self._drop_io()
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
        self._mark_failed(e)
        self.release_claim()

    def _mark_failed(self, e: BaseException) -> None:
        """Best effort: say so in the manifest, keeping the last good commit mark."""
        try:
            m = self._last_good.model_copy(deep=True)
            m.status = "failed"
            m.writer = self.writer_stats()
            m.writer.disabled = True
            m.writer.error = f"{type(e).__name__}: {e}"
            self._write_manifest(m)
        except Exception:
            pass

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
                self.layout, kind.value, cap, len(m.specs(kind)), len(m.stat_names)
            )
        for name in m.metrics:
            arrays[L.metric_path(name)] = L.row_array_metadata(
                self.layout, cap, (), "float64", ["row"]
            )
        return arrays

    # ------------------------------------------------------------------ writes
    def _write_snapshot(self, snap: Snapshot) -> None:
        """Write the tensors of ``snap`` into its snapshot slot (the next index of its
        kind, or the slot of the streamed snapshot of the same step it continues); the
        final item writes the step, which makes the slot a snapshot. Whole arrays, pieces
        and :class:`Part` s that are one whole shard (:func:`part_shard`) of a local
        uncompressed store go straight to their shard files (:class:`_DirectShard`),
        anything else through TensorStore."""
        kind = snap.kind
        steps = self._snap_steps.setdefault(kind, [])
        index = len(steps)
        if self._open_snap.get(kind) not in (None, snap.step):
            self._abort_stream(kind)  # never completed: its slot is reused
        sp = L.snapshot_steps_path(kind)
        if kind not in self._open_snap:  # a new slot
            cap = self._snap_capacity.get(kind, 0)
            new_cap = cap + L.SNAPSHOT_BLOCK if index >= cap else cap
            if not self._exists(sp):
                meta = L.row_array_metadata(
                    self.layout, new_cap, (), "int64", [f"snapshot_{kind.value}"]
                )
                self._create(sp, meta)
            elif new_cap > cap:
                self._arrays[sp] = self._open(sp).resize(exclusive_max=[new_cap]).result()
            self._snap_capacity[kind] = new_cap
            self._open_snap[kind] = snap.step
        new_cap = self._snap_capacity[kind]
        streamed = 0  # bytes of pieces written to their shard files
        for name, value in snap.tensors.items():
            path = L.snapshot_path(kind, name)
            if isinstance(value, Part):
                shape, dtype, block = value.shape, value.dtype, value.block
            elif isinstance(value, Piece):
                shape, dtype, block = value.shape, value.data.dtype.name, None
            else:
                shape, dtype, block = value.shape, value.dtype.name, None
            if not self._exists(path):
                self._create(
                    path, L.snapshot_metadata(self.layout, name, new_cap, shape, dtype, block)
                )
            elif self._open(path).shape[0] < new_cap:
                arr = self._open(path)
                self._arrays[path] = arr.resize(
                    exclusive_max=[new_cap, *arr.shape[1:]], expand_only=True
                ).result()
            if isinstance(value, Part):
                self._parts_upto[kind] = index + 1  # the other processes write theirs
                self._self_confirms |= value.holders
                if value.data is None:
                    continue
                arr = self._arrays[path]
                shard = (
                    part_shard(self._direct_root, path, index, value, arr)
                    if self._direct_root is not None
                    else None
                )
                if shard is not None:  # one whole shard: straight to its file
                    self._after_earlier(shard.path)
                    _fill(shard, value.data)
                    self._finish_shard(shard)
                else:
                    self._pending.append(arr[part_index(index, value)].write(value.data))
                self._written_bytes += value.nbytes
                continue
            if isinstance(value, Piece):
                data, start = value.data, value.start
            else:
                data, start = value, 0
            shard = self._shards.get((kind, name))
            if shard is not None and start == 0:  # put again from its start: begin anew
                self._shards.pop((kind, name)).abort()
                shard = None
            if shard is None and start == 0:
                shard = self._direct_shard(path, index, tuple(shape), np.dtype(dtype))
            if shard is not None:
                self._shards[(kind, name)] = shard
                shard.add(data, start)
                if shard.complete:
                    del self._shards[(kind, name)]
                    self._finish_shard(shard)
                if isinstance(value, Piece):  # in the file: out of our memory
                    streamed += value.nbytes
                else:
                    self._written_bytes += value.nbytes
            elif start == 0 and tuple(data.shape) == tuple(shape):
                # ours (the recorder hands over owned arrays): TensorStore need not copy it
                self._pending.append(
                    self._arrays[path][index].write(
                        data, can_reference_source_data_indefinitely=True
                    )
                )
                self._written_bytes += value.nbytes
            else:
                raise StoreError(
                    f"{path}: piece at row {start} of a tensor this store cannot stream "
                    f"(only whole tensors; see Recorder.stream_snapshot)"
                )
        if streamed:  # drop our references first: the stream may copy the next piece
            snap.tensors.clear()
            del value, data
            self._release_bytes(streamed=streamed)
        if snap.final:
            unfinished = sorted(n for k, n in self._shards if k == kind)
            if unfinished:
                self._abort_stream(kind)
                raise StoreError(
                    f"snapshot of {kind.value} at step {snap.step}: tensors {unfinished} "
                    f"were not handed over completely"
                )
            self._pending.append(self._arrays[sp][index].write(np.int64(snap.step)))
            steps.append(snap.step)
            del self._open_snap[kind]

    def _direct_shard(
        self, path: str, index: int, shape: tuple[int, ...], dtype: np.dtype
    ) -> _DirectShard | None:
        """A direct writer of the shard of snapshot ``index`` of the array at ``path``,
        or None (a remote or compressed store, or a tensor TensorStore must write)."""
        if self._direct_root is None:
            return None
        geo = direct_geometry(shape, dtype, self.layout.snapshot_chunk_bytes)
        if geo is None:
            return None
        key = "/".join(["c", str(index), *("0" * len(shape))])
        full = os.path.join(self._direct_root, path, key)
        self._after_earlier(full)
        return _DirectShard(full, shape, dtype, geo)

    def _after_earlier(self, path: str) -> None:
        """Wait for an earlier write of the same shard file still finishing (a retried
        stream, a reused slot): the writes of one shard land in order."""
        earlier = self._finishing.pop(path, None)
        if earlier is not None:
            earlier.result()

    def _finish_shard(self, shard: _DirectShard) -> None:
        """Make a completely written shard durable in the I/O pool (the commit waits for
        it)."""
        done = self._io_pool().submit(shard.finish())
        self._finishing[shard.path] = done
        self._pending.append(done)

    @property
    def streams_pieces(self) -> bool:
        """Whether this store takes :class:`Piece` s smaller than a whole tensor (a
        local uncompressed store: each piece is encoded into its shard as it comes)."""
        return self._direct_root is not None

    def _io_pool(self) -> ThreadPoolExecutor:
        if self._io is None:
            self._io = _fsync_pool()
        return self._io

    def _abort_stream(self, kind: Kind) -> None:
        """Drop the streamed snapshot of ``kind`` that never completed (its shards beyond
        the committed snapshots are overwritten by the next one or trimmed at close)."""
        for key in [k for k in self._shards if k[0] == kind]:
            self._shards.pop(key).abort()
        self._open_snap.pop(kind, None)

    def _commit(self, final: bool = False) -> None:
        """One commit, in three steps (the order is the crash-safety argument of the
        module docstring): :meth:`_plan` decides what to write, :meth:`_write_and_wait`
        grows the row arrays, writes the block of new rows and waits until every write
        since the last commit is durable, and only then :meth:`_write_commit_mark` moves
        the commit mark (``final``: after trimming the arrays, marking the run closed)."""
        # still our store? (removed, renamed or taken over: StoreError, nothing written)
        # a recent heartbeat is checked with one read, else renewed (a fsync'd write)
        if (
            self._claim is not None
            and self._heartbeat_every is not None
            and time.monotonic() - self._last_heartbeat < self._heartbeat_every / 2
        ):
            self._claim.verify()
        else:
            self._heartbeat()
        plan = self._plan(final)
        failed = self._write_and_wait(plan)
        self._write_commit_mark(plan)
        if failed is not None:  # the rows are committed without the metric; now fail
            raise failed

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

    def _write_and_wait(self, plan: _CommitPlan) -> BaseException | None:
        """Create or grow the row arrays, write the block of new rows, and wait until it
        and every snapshot write issued since the last commit is durable (the file
        kvstore fsyncs before a write completes), and until the other processes of a
        multi-process job have confirmed their snapshot blocks. Then the buffers are
        dropped and the training thread's byte budget is freed.

        A new metric's array that cannot be created (a name too long for the storage,
        say) does not cost the other arrays their rows: the metric is left out of this
        commit (its values with it) and the error is returned, to be raised once the
        commit mark is written."""
        self._row_capacity = plan.capacity
        failed: BaseException | None = None
        for path, meta in plan.create.items():
            try:
                self._create(path, meta)
            except Exception as e:
                if not path.startswith(L.METRICS + "/") or self._claim_lost():
                    raise
                name = path[len(L.METRICS) + 1 :]
                plan.manifest.metrics.remove(name)
                plan.blocks.pop(path, None)
                failed = failed or StoreError(
                    f"cannot create the array of metric {name!r} ({type(e).__name__}: {e}); "
                    f"the rows recorded so far are committed without it"
                )
        for path in plan.grow:
            arr = self._open(path)
            self._arrays[path] = arr.resize(
                exclusive_max=[plan.capacity, *arr.shape[1:]], expand_only=True
            ).result()
        futures = list(self._pending)
        r0 = plan.rows.start
        for path in plan.create:  # a metric or kind first seen after committed rows:
            if r0 > 0 and path in self._arrays:  # its earlier rows are stored as missing
                arr = self._arrays[path]  # (every chunk exists: all_chunks_stored)
                dt = arr.dtype.numpy_dtype
                fill = np.broadcast_to(np.array(_FILL[dt.kind], dtype=dt), (r0, *arr.shape[1:]))
                futures.append(arr[0:r0].write(fill))
        for path, values in plan.blocks.items():
            futures.append(self._open(path)[plan.rows].write(values))
        for f in futures:
            f.result()  # durable (file kvstore fsyncs) before the commit mark moves
            self._progress()
        self._wait_for_followers(plan.followers_need)
        self._pending.clear()
        self._finishing.clear()
        self._release_bytes()
        self._rows = []
        return failed

    def _claim_lost(self) -> bool:
        return self._claim is not None and not self._claim.held

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
        other process (and process 0's own :class:`PartWriter`, for ``Part.holders``
        blocks) has confirmed (its progress key) that its blocks of them are durable. A
        slow process delays the commit, not training (until the queue fills); one silent
        for ``followers_timeout`` seconds fails the writer (capture stops loudly; every
        step committed before stays valid)."""
        need = {k: n for k, n in need.items() if n > 0}
        if not self.followers or not need:
            return
        waiting = set(range(0 if self._self_confirms else 1, self.followers + 1))

        def confirmed() -> bool:
            self._progress()  # bounded by followers_timeout, not write_timeout
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
    writes its blocks (one that is a whole shard of a local uncompressed store straight
    to its file, :func:`part_shard`), waits until they are durable, then records its
    progress (:func:`progress_key`) — what process 0 waits for before committing. Rows,
    metrics and whole arrays are process 0's and are dropped here. A failure (or process
    0 not growing an array within ``timeout`` seconds) stops this writer loudly; the
    store keeps every step committed before.
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
        # whole-shard blocks of a local uncompressed store go straight to their files
        self._root = local_path(url) if manifest.layout.compression == "none" else None
        self._io: ThreadPoolExecutor | None = None  # their fsyncs, side by side
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
                if item.op == "close" and self._io is not None:
                    self._io.shutdown(wait=True)
                    self._io = None
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
        """Write this process's blocks of ``snap`` (a block that is one whole shard of a
        local uncompressed store straight to its file, :func:`part_shard`; others
        through TensorStore), wait until all are durable, then record the progress."""
        kind = snap.kind.value
        index = self._count.get(kind, 0)
        futures: list[ts.WriteFutures | Future[None]] = []
        for name, value in snap.tensors.items():
            if not isinstance(value, Part) or value.data is None:
                continue
            path = L.snapshot_path(snap.kind, name)
            arr = self._grown(path, index)
            shard = part_shard(self._root, path, index, value, arr) if self._root else None
            if shard is None:
                futures.append(arr[part_index(index, value)].write(value.data))
                continue
            _fill(shard, value.data)
            if self._io is None:
                self._io = _fsync_pool()
            futures.append(self._io.submit(shard.finish()))  # fsyncs side by side
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
