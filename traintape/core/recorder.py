"""The Recorder: the framework-free write API every adapter uses.

Step semantics (docs/store-format.md): step ``t`` counts completed optimizer steps from 0. A *row*
holds everything recorded for one step (stat vectors of each kind, metrics). Calls for
the same step add to the open row; the first call for a later step seals it and hands
it to the background writer. Calling with a step before the open one, or not after the
last committed one when resuming, is an error.

Durability: rows are committed (made visible and durable) every ``flush_every_steps``
rows, every ``flush_every_seconds`` seconds (whatever the writer's queue holds), on
:meth:`Recorder.flush` and on :meth:`Recorder.close`. A process that dies loses what was
not committed: the training thread runs at most ``flush_every_steps + 2 * max_pending + 1``
sealed rows ahead of the last commit (``max_pending`` items wait in the queue and one in a
hand-over while the writer commits a block of up to ``flush_every_steps`` rows plus the
backlog it took, itself at most ``max_pending``), plus the open step. Storage slower than
capture slows the training thread (back-pressure), never the commits.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import socket
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from traintape._version import __version__
from traintape.core import layout as L
from traintape.core.claim import STALE_AFTER, WriterClaim
from traintape.core.errors import (
    CaptureDisabledError,
    RecordError,
    StoreError,
    TraintapeError,
)
from traintape.core.group import ProcessGroup, check_group, detect
from traintape.core.inputs import check_array, check_metric, check_step, check_user
from traintape.core.kvstore import KvStore, Location, check_key_length, normalize_url
from traintape.core.options import RecorderOptions
from traintape.core.registry import TensorRegistry
from traintape.core.rows import NonfiniteEvents, RowState
from traintape.core.stats import backend as host_backend
from traintape.core.stats import raw_rows as host_raw_rows
from traintape.core.store import (
    LocationKind,
    inspect_location,
    read_manifest,
    remove_leftovers,
    remove_lock_files,
    storage_dtype,
    write_manifest,
)
from traintape.core.system import PREFIX as SYSTEM_PREFIX
from traintape.core.system import SystemSampler, is_system
from traintape.core.writer import (
    Part,
    PartWriter,
    Piece,
    Row,
    Snapshot,
    StoreWriter,
    clear_progress,
    stream_rows,
)
from traintape.schema import (
    N_RAW,
    N_STATS,
    RAW_NAMES,
    CapturePolicy,
    Event,
    EventType,
    Kind,
    Manifest,
    Producer,
    Severity,
    StoreLayout,
    TensorSpec,
    check_no_prefix_clash,
    finalize,
)
from traintape.schema.policy import StepPlan
from traintape.schema.stats import activation_map


def default_producer(**fields: Any) -> Producer:
    base: dict[str, Any] = {
        "traintape_version": __version__,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
    }
    base.update(fields)
    return Producer(**base)


class Recorder:
    """Records one training run into a traintape store.

    Args:
        url: a local directory (created; the default kind of store) or a TensorStore
            kvstore URL (``memory://name``, ``file:///abs``, ``gs://bucket/run``, ...).
            An existing traintape store is reopened and appended to (resume).
        policy: what to record and when (:class:`~traintape.schema.CapturePolicy`).
            On resume, None keeps the store's policy; a different one is refused.
        flush_every_steps: commit at least every K rows (also the rows per chunk of a new
            store, so commits write whole chunks).
        flush_every_seconds: commit at least every T seconds while data is pending.
        max_pending: queue bound (rows + snapshots) between training and writer threads.
        max_pending_bytes: bound on snapshot bytes handed over and not yet durable; the
            training thread waits (a counted stall) beyond it. A streamed snapshot
            (:meth:`stream_snapshot`, the torch adapter's) holds at most
            ``min(max_pending_bytes, 192 MiB)`` of pieces not yet written.
        strict: re-raise storage failures in the training thread instead of disabling
            capture with a loud error.
        compression: 'none' (default: float gradients compress poorly), 'zstd', 'blosc'.
        process_group: the processes of a multi-process job
            (:class:`~traintape.core.group.ProcessGroup`); default: found from the
            framework (``jax.distributed`` / ``torch.distributed`` once initialised), else
            one process. Every process constructs its ``Recorder`` with the same URL and
            policy; process 0 writes the store (the adapters merge statistics over
            processes before they reach the recorder), the others write only the snapshot
            blocks they hold (:class:`~traintape.core.writer.PartWriter`).
            If process 0 cannot open the store, every process raises.
        resume_step: continue an existing run from optimizer step N (a job restarted from
            its step-N checkpoint): committed steps ``>= N`` are abandoned — copied first
            to ``<url>/abandoned/<k>`` (readable with ``open_run``), then the commit mark
            moves back in one write and a ``rewind`` event names the copy
            (:mod:`traintape.core.rewind`). Recording continues at step N. None (default):
            append after the last committed step.
        system_metrics: record system metrics on every row (``sys/time``, step time,
            CPU, RSS, host memory, GPU memory/utilisation where present; sampled off the
            training thread — :mod:`traintape.core.system`); True samples every second,
            a number every that many seconds, False records none. Process 0's.
        samples_per_step: training samples per optimizer step (the global batch size),
            for ``sys/samples_per_s``.
        write_timeout: seconds the writer may go without progress (no write completing)
            before it is declared hung — storage that stopped answering (a frozen object
            store, a hung NFS mount): capture is then disabled with a loud error, the
            training thread never waits for the writer again, and :meth:`close` raises
            :class:`CaptureDisabledError` without waiting. The most the training thread
            waits on storage at any one time.
    """

    policy: CapturePolicy
    _sync_hooks: list[Callable[[bool], None]]
    _writer: StoreWriter | PartWriter
    _own_blocks: PartWriter | None = None

    def __init__(
        self,
        url: Location = "runs/run",
        policy: CapturePolicy | None = None,
        *,
        run_id: str | None = None,
        producer: Producer | None = None,
        flush_every_steps: int = 64,
        flush_every_seconds: float = 5.0,
        max_pending: int = 1024,
        max_pending_bytes: int = 1 << 30,
        strict: bool = False,
        compression: str = "none",
        user: Mapping[str, Any] | None = None,
        claim_stale_after: float = STALE_AFTER,
        process_group: ProcessGroup | None = None,
        resume_step: int | None = None,
        system_metrics: bool | float = True,
        samples_per_step: int | None = None,
        write_timeout: float = 120.0,
    ) -> None:
        opts = RecorderOptions.check(  # every option range-checked before anything else
            flush_every_steps=flush_every_steps, flush_every_seconds=flush_every_seconds,
            max_pending=max_pending, max_pending_bytes=max_pending_bytes,
            compression=compression, claim_stale_after=claim_stale_after,
            write_timeout=write_timeout, system_metrics=system_metrics,
            samples_per_step=samples_per_step,
        )  # fmt: skip
        flush_every_steps, flush_every_seconds = opts.flush_every_steps, opts.flush_every_seconds
        max_pending, max_pending_bytes = opts.max_pending, opts.max_pending_bytes
        claim_stale_after, write_timeout = opts.claim_stale_after, opts.write_timeout
        system_metrics = opts.system_metrics
        interval = 1.0 if system_metrics is True else float(system_metrics)
        user = check_user(user)  # refused here, before anything is claimed or written
        self.url = normalize_url(url)
        self.strict = strict
        self._lock = threading.RLock()  # guards manifest and row state; never held in put()
        self._put_lock = threading.Lock()  # keeps hand-over order; may block on a full queue
        self.group = detect() if process_group is None else check_group(process_group)
        if resume_step is not None:
            resume_step = check_step(resume_step)
        self._resume_step = resume_step
        self._write_timeout = write_timeout
        args = (policy, run_id, producer, flush_every_steps, flush_every_seconds, max_pending,
                max_pending_bytes, compression, user)  # fmt: skip
        failure: BaseException | None = None
        self._claim: WriterClaim | None = None
        if self.group.index == 0:
            try:
                self._open_as_leader(claim_stale_after, *args)
            except TraintapeError as e:
                failure = e
            except Exception as e:  # storage unreachable, no bucket, no credentials, ...
                failure = StoreError(f"cannot open the store {self.url}: {e}")
                failure.__cause__ = e
            except BaseException as e:
                failure = e
        if self.group.count > 1:  # followers learn whether the leader opened the store
            failed = self.group.all_gather(np.array([float(failure is not None)]))[0, 0]
            if self.group.index != 0:
                if failed:
                    raise StoreError(
                        f"process 0 of {self.group.count} could not open the store "
                        f"{self.url} (its error says why); nothing was recorded"
                    )
                self._open_as_follower(*args)
        if failure is not None:
            raise failure
        self._system: SystemSampler | None = None
        if system_metrics is not False and self.group.index == 0:
            self._system = SystemSampler(
                interval, samples_per_step, bytes_written=self._writer.bytes_written
            )
            self._rows.on_open = self._system_row
        # a Recorder never closed is closed at interpreter exit (bounded), with a warning
        _track_open(self)
        if self._claim is not None and self._claim.took_over is not None:
            self.event(
                self._rows.last_sealed or 0,
                EventType.NOTE,
                f"took over the writer claim of a dead or silent writer "
                f"({self._claim.took_over.describe()})",
                severity=Severity.WARNING,
            )

    def _open_as_leader(self, claim_stale_after: float, *args: Any) -> None:
        _prepare_location(self.url)  # refuse a foreign location before writing anything
        self._claim = WriterClaim(KvStore(self.url).kv, self.url, stale_after=claim_stale_after)
        self._claim.acquire()  # one writer per store: a live one makes this raise
        try:
            existing = _prepare_location(self.url, clean_leftovers=True)  # as it is now
            remove_lock_files(self.url)  # temporaries of killed writers (we hold the claim)
            if self.group.count > 1:  # an earlier job's progress must not vouch for ours
                clear_progress(KvStore(self.url))
            self._open(existing, *args)
        except BaseException:
            self._claim.release()
            raise

    def _adopt(self, m: Manifest) -> None:
        """The in-memory state of a recorder of manifest ``m`` (leader or follower)."""
        self._manifest = m
        self.policy = m.policy
        self._tensors = TensorRegistry(m)
        self._rows = RowState(self.url, m.commit.last_step)
        self._first_step = 0 if m.commit.last_step is None else m.commit.last_step + 1
        self._nonfinite = NonfiniteEvents(m.events)
        self._closed = False
        self._sync_hooks = []
        self._skipped: set[tuple[int, Kind]] = set()  # snapshot_skipped events given

    def _open_as_follower(
        self, policy: CapturePolicy | None, run_id: str | None, *args: Any
    ) -> None:
        """A process other than 0: the same bookkeeping as the leader (declarations,
        steps, policy checks — so bad input fails on every process alike), written
        nowhere. The policy is the store's, which the leader has just opened."""
        m = read_manifest(self.url)
        if policy is not None and policy != m.policy:
            raise RecordError(
                f"process {self.group.index}: policy {policy.model_dump()} differs from the "
                f"store's {m.policy.model_dump()} (process 0 opened {self.url})"
            )
        self._adopt(m)
        self._writer = PartWriter(self.url, self.group.index, m)

    def _open(
        self,
        existing: Manifest | None,
        policy: CapturePolicy | None,
        run_id: str | None,
        producer: Producer | None,
        flush_every_steps: int,
        flush_every_seconds: float,
        max_pending: int,
        max_pending_bytes: int,
        compression: str,
        user: Mapping[str, Any] | None,
    ) -> None:
        # everything that can refuse is checked before anything changes (a refused
        # resume must not have rewound the store first)
        if existing is not None and policy is not None and policy != existing.policy:
            raise RecordError(
                f"store {self.url} was recorded with policy {existing.policy.model_dump()}; "
                f"refusing to resume it with a different policy {policy.model_dump()}"
            )
        if existing is not None and self._resume_step is not None:
            from traintape.core.rewind import rewind

            rewound = rewind(self.url, existing, self._resume_step)
            if rewound is not existing:
                write_manifest(KvStore(self.url), rewound)  # the one write that flips history
                existing = rewound
        if existing is not None:
            m = existing
            # an older schema's stat vector (a subset of this build's) stays the store's:
            # appended rows keep its columns (the writer selects them by name)
            m.status = "open"
            if producer is not None:
                m.producer = producer
        else:
            m = Manifest(
                run_id=run_id or uuid.uuid4().hex,
                producer=producer or default_producer(),
                policy=policy or CapturePolicy(),
                layout=StoreLayout(
                    row_chunk=flush_every_steps, compression=compression, all_chunks_stored=True
                ),
                user=dict(user or {}),
            )
        self._adopt(m)
        try:
            writer = StoreWriter(
                self.url,
                m,
                self._manifest_copy,
                flush_every_steps=flush_every_steps,
                flush_every_seconds=flush_every_seconds,
                max_pending=max_pending,
                max_pending_bytes=max_pending_bytes,
                claim=self._claim,
                followers=self.group.count - 1,
                write_timeout=self._write_timeout,
            )
            if existing is None:
                writer._write_manifest(m.model_copy(deep=True))
            self._writer = writer
            if self.group.count > 1:  # process 0's own blocks of Part.holders snapshots
                self._own_blocks = PartWriter(self.url, 0, m)
        except Exception as e:
            raise StoreError(f"cannot write a traintape store at {self.url}: {e}") from e

    # ------------------------------------------------------------------ properties
    @property
    def manifest(self) -> Manifest:
        """A deep copy of the manifest as recorded so far (not all of it committed yet):
        changing it changes nothing in the recorder."""
        with self._lock:
            return self._manifest.model_copy(deep=True)

    @property
    def next_step(self) -> int:
        """The optimizer step the next record carries by default (read-only): 0 for a new
        run, ``N`` for a recorder opened with ``resume_step=N``, the last committed step
        + 1 when appending — and, once this recorder has recorded (or opened) a step,
        the step after it. Every adapter's step counter starts here when created."""
        with self._lock:
            row, last = self._rows.row, self._rows.last_sealed
        start = self._first_step if self._resume_step is None else self._resume_step
        seen = [s + 1 for s in (None if row is None else row.step, last) if s is not None]
        return max([start, *seen])

    @property
    def enabled(self) -> bool:
        """False once a storage failure disabled capture (or after close)."""
        return self._writer.error is None and not self._closed

    @property
    def error(self) -> BaseException | None:
        return self._writer.error

    def _manifest_copy(self) -> Manifest:
        """A consistent copy for the writer: new lists, shared (immutable-once-set) specs.

        Cheap on purpose — it runs under ``_lock`` at every commit.
        """
        with self._lock:
            m = self._manifest
            return m.model_copy(
                update={
                    "tensors": [t.model_copy() for t in m.tensors],
                    "metrics": list(m.metrics),
                    "events": list(m.events),
                    "commit": m.commit.model_copy(),
                    "writer": m.writer.model_copy(),
                }
            )

    # ------------------------------------------------------------------ declaration
    def set_producer(self, **fields: Any) -> None:
        """Set producer fields (framework, framework_version, adapter) — for adapters."""
        with self._lock:
            data = self._manifest.producer.model_dump()
            data.update(fields)
            self._manifest.producer = Producer(**data)

    def declare(self, specs: Sequence[TensorSpec], *, in_forward_order: bool = True) -> None:
        """Declare the tensors of one or more kinds with full specs (adapters do this).

        The set of tensors of a kind is fixed by its first declaration (sorted canonical
        order = the stats array's tensor axis). Re-declaring the same set is a no-op;
        a different set is an error naming the tensors that differ.

        Forward order: adapters declare ``activation`` specs in the order the layers ran
        (``in_forward_order=False`` when they cannot know it). Unless the user set it
        (``Recorder(user={"forward_order": [...]})``), the first such activation
        declaration stores that order of layer paths as ``manifest.forward_order`` (the
        analyses and ``compare`` order layers by it).

        Layer kinds: a layer's kind is a property of the layer, not of the kind of data.
        A spec declared with ``layer_kind=None`` takes the kind already declared for the
        same layer, and a later spec that knows the kind fills it into earlier ones.
        """
        with self._lock:
            self._check_spec_paths(specs)
            self._tensors.declare(specs, in_forward_order=in_forward_order)

    def _check_path(self, array_path: str, what: str) -> None:
        """Refuse (RecordError, at the call) a name whose array's keys would exceed the
        storage's path or key limits — found at a commit, it would disable capture."""
        why = check_key_length(self.url, array_path)
        if why is not None:
            raise RecordError(f"{what} is too long for the store {self.url}: {why}")

    def _check_spec_paths(self, specs: Sequence[TensorSpec]) -> None:
        """:meth:`_check_path` for the snapshot arrays of tensors about to be declared
        (the only arrays whose paths hold a tensor's name)."""
        for s in specs:
            if not self._tensors.declared(Kind(s.kind)) or s.name not in self._tensors.specs(
                Kind(s.kind)
            ):
                self._check_path(
                    L.snapshot_path(Kind(s.kind), s.name),
                    f"tensor {s.name!r} ({Kind(s.kind).value})",
                )

    # ------------------------------------------------------------------ recording
    def wants(self, step: int, kind: Kind | str) -> bool:
        """True if ``kind`` is recorded at ``step`` (adapters skip work when False)."""
        return self._computing and self.policy.records_kind(kind) and self.policy.captures(step)

    @property
    def _computing(self) -> bool:
        """Whether adapters compute at all. In a multi-process job every process must
        take part in the same merges, so a storage failure on process 0 (which drops
        what reaches it) does not change what the processes compute."""
        return self.enabled if self.group.count == 1 else not self._closed

    def plan(self, step: int) -> StepPlan:
        """What to compute at optimizer step ``step``: the policy applied in one place
        (nothing while capture is disabled). Adapters whose step is known on the host ask
        this; traced adapters evaluate ``policy.captures``/``policy.is_full`` on device."""
        if not self._computing:
            return StepPlan(step=step, kinds=frozenset(), snapshot_kinds=frozenset())
        return self.policy.plan(step)

    def snapshots(self, step: int, kind: Kind | str) -> bool:
        """Whether to hand over full tensors of ``kind`` at ``step``: a full-capture step
        of the policy, within the snapshot memory budget (``policy.snapshot_budget_bytes``
        / ``snapshot_budget_fraction``). Adapters ask this before copying anything to the
        host; a capture over the budget is skipped here, with a ``snapshot_skipped``
        event. The stat vectors of the step are recorded either way."""
        kind = Kind(kind)
        if not self._computing or not self.policy.snapshots(step, kind):
            return False
        with self._lock:
            return self._within_budget(step, kind, self._snapshot_estimate(kind))

    def stream_snapshot(self, step: int, kind: Kind | str) -> SnapshotStream | None:
        """Start a *streamed* full capture of ``kind`` at ``step``, or None when there is
        none to take (as :meth:`snapshots`; a skip over the budget is an event).

        For adapters whose tensors must be copied to the host (device memory, or host
        memory the training step changes in place): :meth:`SnapshotStream.put` copies each
        tensor piece by piece and hands each piece to the writer at once, waiting while
        the writer holds :attr:`SnapshotStream.limit` bytes not yet written — so a full
        snapshot of a model larger than free host memory needs that much host memory
        more, not the model's size. Pass the stream as the kind's ``snapshots`` in
        :meth:`record_step` (or :meth:`record_raw`): that completes the snapshot. Against
        the budget a stream counts at most its ``limit``. Single-process only (None in a
        multi-process job, whose processes hand over :class:`~traintape.core.writer.Part` s).
        """
        kind = Kind(kind)
        w = self._writer
        if (
            self.group.count > 1
            or not isinstance(w, StoreWriter)
            or not self._computing
            or not self.policy.snapshots(step, kind)
        ):
            return None
        with self._lock:
            if not self._tensors.declared(kind):
                raise RecordError(
                    f"kind {kind.value}: no tensors declared; call Recorder.declare(specs) first"
                )
            estimate = min(self._snapshot_estimate(kind), w.stream_bytes)
            if not self._within_budget(step, kind, estimate):
                return None
        self._drain()  # what came before goes to the writer first
        return SnapshotStream(self, step, kind)

    def _budget(self) -> int | None:
        """The snapshot memory budget now (bytes), or None. Not applied in multi-process
        jobs (every process must write the same snapshots)."""
        p = self.policy
        if self.group.count > 1 or (
            p.snapshot_budget_bytes is None and p.snapshot_budget_fraction is None
        ):
            return None
        limits = [] if p.snapshot_budget_bytes is None else [p.snapshot_budget_bytes]
        if p.snapshot_budget_fraction is not None:
            import psutil

            limits.append(int(p.snapshot_budget_fraction * psutil.virtual_memory().available))
        return min(limits)

    def _snapshot_estimate(self, kind: Kind) -> int:
        """Bytes of a full capture of ``kind`` (declared shapes; tensors whose size is not
        known yet — an activation before its first snapshot — count 0)."""
        total = 0
        for spec in self._tensors.specs(kind).values():
            dims = [d for d in (spec.snapshot_shape or spec.shape) if d is not None]
            if len(dims) == len(spec.snapshot_shape or spec.shape):
                total += int(np.prod(dims, dtype=np.int64)) * storage_dtype(spec.dtype).itemsize
        return total

    def _within_budget(self, step: int, kind: Kind, nbytes: int) -> bool:
        """True if ``nbytes`` more of snapshots fit the budget; else False and (once per
        step and kind) a ``snapshot_skipped`` event. Under ``_lock``."""
        budget = self._budget()
        if budget is None:
            return True
        pending = getattr(self._writer, "pending_bytes", 0)
        if pending + nbytes <= budget:
            return True
        if (step, kind) not in self._skipped:
            self._skipped.add((step, kind))
            self._manifest.events.append(
                Event(
                    step=step,
                    type=EventType.SNAPSHOT_SKIPPED,
                    severity=Severity.WARNING,
                    kind=kind,
                    message=f"full capture of {kind.value} at step {step} skipped: "
                    f"{nbytes / 2**20:.1f} MiB more would exceed the snapshot memory budget "
                    f"of {budget / 2**20:.1f} MiB ({pending / 2**20:.1f} MiB still pending)",
                    data={"bytes": nbytes, "pending_bytes": pending, "budget_bytes": budget},
                )
            )
        return False

    def record(self, step: int, kind: Kind | str, tensors: Mapping[str, ArrayLike]) -> bool:
        """Record host (numpy) tensors of one kind at optimizer step ``step``.

        Stat vectors are computed here; full snapshots are written when the policy says
        so. ``tensors`` maps canonical names to arrays in canonical layout; names the
        policy does not select are skipped. On first use of a kind its tensor set,
        shapes and dtypes are declared from these arrays (activation batch axis free).

        Returns True if something was recorded (False: policy skipped it or capture is
        disabled). Bad input (step, name, dtype, shape) raises :class:`RecordError`
        naming it, before anything of the call is recorded; capture stays enabled.
        """
        kind = Kind(kind)
        step = check_step(step)
        if not self._guard() or not self.wants(step, kind):
            return False
        with self._lock:
            arrays: dict[str, np.ndarray] = {}
            for n, v in tensors.items():
                self._tensors.valid(n)
                if self.policy.selects(n):
                    arrays[n] = check_array(n, kind, v, step)
            if not arrays:
                return False
            if not self._tensors.declared(kind):
                specs_ = [
                    TensorSpec.build(n, kind, dtype=a.dtype.name, shape=a.shape)
                    for n, a in arrays.items()
                ]
                self._check_spec_paths(specs_)
                self._tensors.declare(specs_)
            else:
                self._tensors.check_same_set(kind, arrays.keys())
            specs = self._tensors.specs(kind)
            for n, a in arrays.items():
                _check_against_spec(specs[n], a, step)
            names = self._tensors.names[kind]
            # canonical layout: identity index maps, but an activation's batch axis is
            # free (the sig pattern runs over the per-example index)
            maps = [
                activation_map(arrays[n].shape) if kind is Kind.ACTIVATION else None for n in names
            ]
            raw = host_raw_rows([arrays[n] for n in names], maps=maps)
            if self._manifest.producer.stats_backend is None:
                self._manifest.producer = self._manifest.producer.model_copy(
                    update={"stats_backend": host_backend()}
                )
            snaps = {n: arrays[n] for n in names} if self.policy.snapshots(step, kind) else None
            self._add(step, kind, finalize(raw), snaps, copy=True)
        self._drain()
        return True

    def record_step(self, step: int, parts: Sequence[KindRows]) -> bool:
        """The record point of every adapter: what it computed for one optimizer step.

        Args:
            parts: per kind, raw rows ``[len(names), N_RAW]`` (:mod:`traintape.schema.stats`)
                of the tensors ``names`` (any order; every declared tensor of the kind
                once) and, on full-capture steps, snapshots (canonical layout; the
                recorder takes ownership — do not modify them afterwards — or the
                :class:`SnapshotStream` that handed them over). Raw rows of
                parts of one tensor (shards, micro-batches) are merged by the caller
                with :func:`traintape.schema.stats.merge` first.
        The kinds must have been declared (:meth:`declare`). The policy is applied here:
        kinds it does not record at ``step`` are ignored, snapshots are kept only where
        it snapshots the kind at ``step``. Stat vectors are
        :func:`traintape.schema.stats.finalize` of the raw rows (one call per step).
        Returns True if something was recorded.
        """
        step = check_step(step)
        if not self._guard():
            return False
        parts = [p for p in parts if self.wants(step, p.kind)]
        if not parts:
            return False
        raws = []
        for p in parts:
            r = np.asarray(p.raw, dtype=np.float64)
            if r.shape != (len(p.names), N_RAW):
                raise RecordError(
                    f"kind {Kind(p.kind).value} at step {step}: raw rows have shape {r.shape}, "
                    f"expected ({len(p.names)}, {N_RAW}) (one row of {RAW_NAMES} per name)"
                )
            raws.append(r)
        vecs = finalize(np.concatenate(raws)) if len(raws) > 1 else finalize(raws[0])
        off = 0
        for p in parts:
            n = len(p.names)
            if p.absent:
                pos = {name: i for i, name in enumerate(p.names)}
                vecs[[off + pos[a] for a in p.absent]] = np.nan
            self._record_vectors(step, Kind(p.kind), vecs[off : off + n], p.names, p.snapshots)
            off += n
        return True

    def put_blocks(self, step: int, kind: Kind | str, blocks: Mapping[str, Part]) -> None:
        """This process's blocks of the snapshot of ``kind`` at ``step``, in a
        multi-process job whose blocks arrive apart from the step's rows (JAX: from one
        host callback per device, on every process).

        Every process (process 0 too) calls this once per such snapshot, in step order,
        with the same tensor names; each :class:`~traintape.core.writer.Part` is the
        block this process writes (``data``) at ``offset`` of the canonical tensor. The
        step's rows, recorded by process 0 alone, name the same tensors with
        ``Part(None, ..., holders=True)``; process 0 commits the snapshot once every
        process has confirmed its blocks durable.
        """
        kind = Kind(kind)
        step = check_step(step)
        if self.group.count == 1:
            raise RecordError(f"put_blocks ({kind.value} at step {step}): not a multi-process job")
        writer = self._writer if self.group.index else self._own_blocks
        if not self._guard() or writer is None or writer.error is not None:
            return
        with self._lock:
            specs = self._tensors.specs(kind)
            owned: dict[str, np.ndarray | Part | Piece] = {}
            for n, p in blocks.items():
                if n not in specs:
                    raise RecordError(
                        f"put_blocks: tensor {n!r} ({kind.value}) at step {step} is not declared"
                    )
                _check_part(specs[n], p, step)
                owned[n] = _stored_part(p)
        writer.put(Snapshot(step, kind, owned))

    def record_raw(
        self,
        step: int,
        kind: Kind | str,
        raw: ArrayLike,
        *,
        names: Sequence[str],
        snapshots: Mapping[str, ArrayLike] | None = None,
    ) -> bool:
        """:meth:`record_step` for one kind."""
        return self.record_step(step, [KindRows(Kind(kind), names, raw, snapshots)])

    def record_stats(
        self,
        step: int,
        kind: Kind | str,
        stats: Mapping[str, ArrayLike] | ArrayLike,
        names: Sequence[str] | None = None,
        snapshots: Mapping[str, ArrayLike] | None = None,
    ) -> bool:
        """Record finished stat vectors (e.g. synthetic data, or stats from elsewhere).

        Args:
            stats: a mapping name -> ``[N_STATS]`` vector, or an array ``[n, N_STATS]``
                whose rows are named by ``names``.
            snapshots: as for :meth:`record_raw`.
        Adapters use :meth:`record_raw` (raw rows merge exactly across shards; vectors
        do not). The tensors of ``kind`` must have been declared (:meth:`declare`).
        """
        kind = Kind(kind)
        step = check_step(step)
        if not self._guard() or not self.wants(step, kind):
            return False
        if isinstance(stats, Mapping):
            names = list(stats.keys())
            vecs = np.stack([np.asarray(stats[n], dtype=np.float64) for n in names])
        else:
            if names is None:
                raise RecordError("record_stats: an array of stats needs `names`")
            vecs = np.asarray(stats, dtype=np.float64)
        if vecs.shape != (len(names), N_STATS):
            raise RecordError(
                f"kind {kind.value} at step {step}: stats have shape {vecs.shape}, expected "
                f"({len(names)}, {N_STATS})"
            )
        return self._record_vectors(step, kind, vecs, names, snapshots)

    def _record_vectors(
        self,
        step: int,
        kind: Kind,
        vecs: np.ndarray,
        names: Sequence[str],
        snapshots: Mapping[str, ArrayLike | Part] | SnapshotStream | None,
    ) -> bool:
        with self._lock:
            if not self._tensors.declared(kind):
                raise RecordError(
                    f"kind {kind.value}: no tensors declared; call Recorder.declare(specs) "
                    f"first or use Recorder.record(step, kind, arrays)"
                )
            vecs = vecs[self._tensors.order(kind, tuple(names))]
            if isinstance(snapshots, SnapshotStream):
                self._end_stream(step, kind, snapshots, vecs)
            else:
                self._add(step, kind, vecs, self._checked_snapshots(step, kind, snapshots), False)
        self._drain()
        return True

    def _checked_snapshots(
        self, step: int, kind: Kind, snapshots: Mapping[str, ArrayLike | Part] | None
    ) -> dict[str, np.ndarray | Part] | None:
        """The snapshots of a :meth:`record_step` call, checked against the declared
        specs, or None where the policy takes none of ``kind`` at ``step``."""
        if snapshots is None or not self.policy.snapshots(step, kind):
            return None
        self._tensors.check_same_set(kind, snapshots.keys())
        specs = self._tensors.specs(kind)
        snaps: dict[str, np.ndarray | Part] = {}
        for n in self._tensors.names[kind]:
            v = snapshots[n]
            if isinstance(v, Part):
                _check_part(specs[n], v, step)
                snaps[n] = v
                continue
            a = np.asarray(v)
            _check_against_spec(specs[n], a, step)
            snaps[n] = a
        return snaps

    def _end_stream(self, step: int, kind: Kind, stream: SnapshotStream, vecs: np.ndarray) -> None:
        """Complete a streamed snapshot with the kind's stat vectors (under ``_lock``):
        every declared tensor must have been put whole; then its final item follows the
        pieces to the writer, in order with the rows."""
        if (stream.step, stream.kind) != (step, kind):
            raise RecordError(
                f"kind {kind.value} at step {step}: the snapshot stream is of "
                f"{stream.kind.value} at step {stream.step}"
            )
        self._tensors.check_same_set(kind, stream.shapes.keys())
        if stream.unfinished:
            raise RecordError(
                f"kind {kind.value} at step {step}: snapshot stream of {sorted(stream.unfinished)} "
                f"did not complete"
            )
        self._add(step, kind, vecs, None, copy=False)
        specs = self._tensors.specs(kind)
        for n, shape in stream.shapes.items():
            specs[n].snapshot_shape = list(shape)
        self._rows.outbox.append(Snapshot(step, kind, {}, final=True))

    def log(self, step: int, metrics: Mapping[str, float] | None = None, **kw: float) -> None:
        """Record scalar metrics (loss, learning rate, ...) at ``step``.

        Names follow the canonical grammar (``train/loss`` is fine). NaN/Inf values are
        stored and raise an event, never an exception.
        """
        step = check_step(step)
        values = {**(metrics or {}), **kw}
        checked = {
            self._tensors.valid(name): check_metric(name, v, step) for name, v in values.items()
        }
        if any(is_system(n) for n in checked):
            raise RecordError(
                f"metric names under {SYSTEM_PREFIX!r} are traintape's system metrics: "
                f"{sorted(n for n in checked if is_system(n))}; choose another name"
            )
        self._log_checked(step, checked)

    def _log_checked(self, step: int, checked: Mapping[str, float]) -> None:
        """Checked metrics (system ones too: a copied run's) into the row of ``step``."""
        if not self._guard():
            return
        with self._lock:
            self._put_metrics(self._rows.row_for(step), checked)
        self._drain()

    def _put_metrics(self, row: Row, values: Mapping[str, float]) -> None:
        """Metrics into ``row`` (names registered, non-finite values evented); under
        ``_lock``, names already checked."""
        new = [n for n in values if n not in self._manifest.metrics]
        if new:
            check_no_prefix_clash([*self._manifest.metrics, *new])
            for n in new:
                self._check_path(L.metric_path(n), f"metric {n!r}")
            self._manifest.metrics = sorted([*self._manifest.metrics, *new])
        for name, fv in values.items():
            row.metrics[name] = fv
            if is_system(name):  # traintape's own measurements raise no NaN/Inf events
                continue
            ev = self._nonfinite.of_metric(row.step, name, fv)
            if ev is not None:
                self._manifest.events.append(ev)

    def _system_row(self, row: Row) -> None:
        """RowState hook: the system metrics of a newly opened row (under ``_lock``)."""
        if self._system is not None:  # a value not measured (NaN) is missing, not NaN
            values = self._system.row_metrics(row.step)
            self._put_metrics(row, {k: v for k, v in values.items() if v == v})

    def event(
        self,
        step: int,
        type: EventType | str,
        message: str = "",
        *,
        severity: Severity | str = Severity.INFO,
        tensor: str | None = None,
        kind: Kind | str | None = None,
        **data: float | int | str,
    ) -> None:
        """Add an event at ``step``; committed with the next rows.

        ``type``: ``"note"`` (or another :class:`~traintape.schema.EventType`), or
        ``"user/<name>"`` for an event type of your own (e.g. ``"user/lr_drop"``).
        Raises RecordError naming the field at fault.
        """
        step = check_step(step)
        try:
            ev = Event(
                step=step,
                type=type,
                severity=Severity(severity),
                tensor=tensor,
                kind=Kind(kind) if kind is not None else None,
                message=message,
                data=dict(data),
            )
        except ValueError as e:  # pydantic's ValidationError, a bad Severity/Kind
            errors = getattr(e, "errors", None)
            why = "; ".join(str(x["msg"]) for x in errors()) if callable(errors) else str(e)
            raise RecordError(f"event at step {step}: {why}") from None
        with self._lock:
            self._manifest.events.append(ev)

    def _drain(self) -> None:
        """Hand sealed rows/snapshots to the writer, outside ``_lock``.

        ``put`` may block on a full queue while the writer thread needs ``_lock`` for
        the manifest copy it commits, so the hand-over never holds ``_lock``.
        """
        with self._put_lock:
            with self._lock:
                items = self._rows.take()
            for item in items:
                self._writer.put(item)

    def _put_items(self, items: Sequence[Row | Snapshot]) -> None:
        """Hand ``items`` to the writer after everything sealed so far (outside ``_lock``)."""
        with self._put_lock:
            with self._lock:
                sealed = self._rows.take()
            for item in [*sealed, *items]:
                self._writer.put(item)

    def _add(
        self,
        step: int,
        kind: Kind,
        vecs: np.ndarray,
        snaps: Mapping[str, np.ndarray | Part] | None,
        copy: bool,
    ) -> None:
        """Add one kind's stat vectors (declared order) and snapshots to the row of
        ``step``. Everything is checked before the row changes: a refused call leaves
        nothing of itself behind, so a corrected retry is accepted."""
        row = self._rows.row_for(step)
        if kind in row.stats:
            raise RecordError(f"kind {kind.value} already recorded at step {step}")
        owned: dict[str, np.ndarray | Part | Piece] = {}
        shapes: dict[str, list[int]] = {}
        if (
            snaps
            and self._budget() is not None  # (none in multi-process jobs: no Parts here)
            and not self._within_budget(step, kind, sum(int(np.asarray(a).nbytes) for a in snaps.values()))
        ):  # fmt: skip
            snaps = None
        if snaps:
            specs = self._tensors.specs(kind)
            for n, a in snaps.items():
                spec = specs[n]
                if spec.snapshot_shape is not None and list(a.shape) != spec.snapshot_shape:
                    raise RecordError(
                        f"tensor {n!r} ({kind.value}) at step {step}: snapshot shape "
                        f"{list(a.shape)} differs from earlier snapshots {spec.snapshot_shape}"
                    )
                shapes[n] = list(a.shape)
            for n, a in snaps.items():
                if isinstance(a, Part):  # this process's block: the adapter's own copy
                    owned[n] = _stored_part(a)
                    continue
                target = storage_dtype(a.dtype)
                owned[n] = np.array(a, dtype=target, copy=True) if copy or target != a.dtype else a
            for n, shape in shapes.items():
                specs[n].snapshot_shape = shape
        row.stats[kind] = vecs
        self._manifest.events += self._nonfinite.of_stats(
            step, kind, self._tensors.names[kind], vecs
        )
        if owned:
            self._rows.outbox.append(Snapshot(step, kind, owned))

    def _guard(self) -> bool:
        if self._closed:
            raise RecordError(f"recorder for {self.url} is closed")
        err = self._writer.error
        if err is not None:
            if self.strict:
                raise CaptureDisabledError(f"capture to {self.url} failed: {err}") from err
            return False
        return True

    # ------------------------------------------------------------------ lifecycle
    def add_sync_hook(self, hook: Callable[[bool], None]) -> None:
        """Register ``hook(closing)``, run first thing in :meth:`flush` (``closing=False``)
        and :meth:`close` (``True``), in registration order.

        For adapters whose records arrive asynchronously (the JAX adapter's device
        callbacks): the hook waits until every record of the work dispatched so far has
        reached this recorder. An exception from a hook is raised after ``close`` has
        finished committing what was recorded (nothing recorded is lost).
        """
        with self._lock:
            self._sync_hooks.append(hook)

    def _run_sync_hooks(self, closing: bool) -> BaseException | None:
        first: BaseException | None = None
        for hook in list(self._sync_hooks):
            try:
                hook(closing)
            except BaseException as e:
                first = first or e
        return first

    def flush(self) -> None:
        """Commit every sealed row and pending snapshot; returns when durable.

        The open step stays open (more data for it may follow); :meth:`close` seals it.
        """
        err = self._run_sync_hooks(False)
        self._drain()
        self._writer.flush()
        if err is not None:
            raise err
        self._raise_if_strict()

    def close(self) -> None:
        """Seal the open step, commit everything, trim arrays, mark the run closed.

        A Recorder not closed by the time the interpreter exits is closed then (within
        :data:`EXIT_TIMEOUT` seconds), with a ``ResourceWarning`` naming it."""
        _OPEN.discard(self)
        if self._closed:
            return
        err = self._run_sync_hooks(True)
        with self._lock:
            if self._writer.error is None:
                self._rows.seal()
        self._drain()
        with self._lock:
            self._closed = True
        if self._system is not None:
            self._system.close()
        self._writer.close()
        if self._own_blocks is not None:
            self._own_blocks.close()
        self._writer.release_claim()  # (a follower holds none)
        if err is not None:
            raise err
        failure = self._writer.error
        if failure is not None:  # training went on; the user learns it here at the latest
            raise CaptureDisabledError(
                f"capture to {self.url} was disabled during the run: "
                f"{type(failure).__name__}: {failure}"
            ) from failure

    def _raise_if_strict(self) -> None:
        err = self._writer.error
        if err is not None and self.strict:
            raise CaptureDisabledError(f"capture to {self.url} failed: {err}") from err

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder({self.url!r}, rows={self._writer.rows_committed})"


EXIT_TIMEOUT = 60.0
"""Seconds a Recorder left open may take to close at interpreter exit."""


_OPEN: weakref.WeakSet[Recorder] = weakref.WeakSet()
"""Recorders of this process not closed yet."""
_EXIT_HOOK: list[bool] = []


def _track_open(rec: Recorder) -> None:
    """Remember ``rec`` until it is closed; the first time, install the exit hook. It
    runs at interpreter shutdown *before* ``concurrent.futures`` stops its pools (the
    writer's fsync pool is one) — ``threading``'s exit hooks, run in reverse order of
    registration — and falls back to :mod:`atexit` where that hook does not exist."""
    _OPEN.add(rec)
    if _EXIT_HOOK:
        return
    _EXIT_HOOK.append(True)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_close_all_forgotten)
    else:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        atexit.register(_close_all_forgotten)


def _close_all_forgotten() -> None:
    for rec in list(_OPEN):
        _close_forgotten(rec)


def _close_forgotten(rec: Recorder) -> None:
    """At interpreter exit: close a Recorder its program never closed (warning that it
    was forgotten), in a thread given :data:`EXIT_TIMEOUT` seconds, so the rows it
    recorded are committed and the claim released — instead of the writer thread dying
    with the interpreter (0 rows committed, status ``open``, the claim left in place)."""
    if rec._closed:
        return
    url = rec.url
    msg = (
        f"traintape: Recorder({url!r}) was never closed; closing it at interpreter exit "
        f"(call close() or use `with Recorder(...)`)"
    )
    warnings.warn(msg, ResourceWarning, stacklevel=1)
    import sys

    print(msg, file=sys.stderr)  # ResourceWarning is hidden by default: say it anyway
    failure: list[BaseException] = []

    def close() -> None:
        try:
            rec.close()
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=close, name="traintape-exit-close", daemon=True)
    t.start()
    t.join(EXIT_TIMEOUT)
    if t.is_alive():
        print(f"traintape: closing {url} at exit took over {EXIT_TIMEOUT:.0f} s; gave up",
              file=sys.stderr)  # fmt: skip
    elif failure:
        print(f"traintape: closing {url} at exit failed: {failure[0]}", file=sys.stderr)


class SnapshotStream:
    """A full capture of one kind at one step handed to the writer piece by piece
    (:meth:`Recorder.stream_snapshot`); complete it by passing it as the kind's
    ``snapshots`` to :meth:`Recorder.record_step`."""

    def __init__(self, recorder: Recorder, step: int, kind: Kind) -> None:
        w = recorder._writer
        assert isinstance(w, StoreWriter)
        self._rec = recorder
        self._writer = w
        self.step = step
        self.kind = kind
        self.limit = w.stream_bytes
        """Bytes of pieces the writer may hold not yet written; :meth:`put` waits beyond."""
        self.piece_bytes = max(w.layout.snapshot_chunk_bytes, self.limit // 4) if (
            w.streams_pieces
        ) else None  # fmt: skip
        """Target bytes of one piece (None: whole tensors — a remote or compressed store)."""
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.unfinished: set[str] = set()
        self._specs = recorder._tensors.specs(kind)

    def put(
        self,
        name: str,
        shape: Sequence[int],
        dtype: str,
        read: Callable[[int, int], ArrayLike],
    ) -> None:
        """Hand over tensor ``name`` (canonical layout, ``shape``, ``dtype`` as declared):
        ``read(start, stop)`` returns a host copy of its rows ``[start, stop)`` along axis
        0 (for a 0-d tensor, ``read(0, 1)`` the value), called once per piece right before
        that piece is handed over; the writer owns what it returns. Blocks while the
        writer holds :attr:`limit` bytes (a counted stall). Raises RecordError for a name,
        shape or dtype that is not the declared one."""
        spec = self._specs.get(name)
        if spec is None:
            raise RecordError(f"tensor {name!r} ({self.kind.value}) is not declared")
        shape = tuple(int(d) for d in shape)
        _check_against_spec(spec, np.empty((0,) * len(shape), dtype=dtype), self.step, shape)
        if name in self.shapes:
            raise RecordError(f"tensor {name!r} ({self.kind.value}) put twice at step {self.step}")
        if spec.snapshot_shape is not None and list(shape) != spec.snapshot_shape:
            raise RecordError(
                f"tensor {name!r} ({self.kind.value}) at step {self.step}: snapshot shape "
                f"{list(shape)} differs from earlier snapshots {spec.snapshot_shape}"
            )
        self.shapes[name] = shape
        self.unfinished.add(name)
        target = storage_dtype(dtype)
        n = shape[0] if shape else 1
        rows = (
            n
            if self.piece_bytes is None or not shape
            else stream_rows(shape, target, self._writer.layout.snapshot_chunk_bytes, self.piece_bytes)
        )  # fmt: skip
        row_bytes = math.prod(shape[1:]) * target.itemsize
        for start in range(0, max(n, 1), max(rows, 1)):
            stop = min(start + rows, n)
            self._writer.wait_for_room((stop - start) * row_bytes if shape else row_bytes)
            data = np.asarray(read(start, stop))
            if data.dtype != target:
                data = data.astype(target)
            want = (stop - start, *shape[1:]) if shape else ()
            if data.shape != want:
                raise RecordError(
                    f"tensor {name!r} ({self.kind.value}) at step {self.step}: rows "
                    f"[{start}, {stop}) read as shape {list(data.shape)}, expected {list(want)}"
                )
            piece = Piece(data, start, shape)
            del data
            self._rec._put_items([Snapshot(self.step, self.kind, {name: piece}, final=False)])
            del piece
        self.unfinished.discard(name)


@dataclass(frozen=True)
class KindRows:
    """What an adapter computed for one kind at one step (see :meth:`Recorder.record_step`)."""

    kind: Kind
    names: Sequence[str]
    """Canonical names of the rows of ``raw``."""
    raw: ArrayLike
    """Raw rows ``[len(names), N_RAW]`` float64 (:data:`traintape.schema.stats.RAW_NAMES`)."""
    snapshots: Mapping[str, ArrayLike | Part] | SnapshotStream | None = None
    """Full tensors by name, canonical layout (full-capture steps), or the
    :class:`SnapshotStream` that handed them over (:meth:`Recorder.stream_snapshot`)."""
    absent: Sequence[str] = ()
    """Names among ``names`` not recorded at this step (their raw rows are ignored and
    their stat vectors stored as all-NaN: "not recorded", e.g. a frozen weight read only
    on full-capture steps); they must have no snapshot."""


def _stored_part(p: Part) -> Part:
    """``p`` with its data in the store's dtype (:func:`storage_dtype`; no copy when it
    already is)."""
    target = storage_dtype(p.dtype)
    data = None if p.data is None else np.asarray(p.data, dtype=target)
    return dataclasses.replace(p, data=data, dtype=target.name)


def _check_part(spec: TensorSpec, p: Part, step: int) -> None:
    """A process's block of a snapshot: the whole tensor's shape and dtype are the spec's,
    and the block lies inside it."""
    if p.dtype != spec.dtype or list(p.shape) != list(spec.shape):
        raise RecordError(
            f"tensor {spec.name!r} ({spec.kind.value}) at step {step}: block of a "
            f"{p.dtype} {list(p.shape)} tensor, expected {spec.dtype} {spec.shape}"
        )
    if p.data is not None and any(
        o < 0 or o + n > s for o, n, s in zip(p.offset, p.data.shape, p.shape, strict=True)
    ):
        raise RecordError(
            f"tensor {spec.name!r} ({spec.kind.value}) at step {step}: block "
            f"{list(p.data.shape)} at offset {list(p.offset)} outside {list(p.shape)}"
        )


def _check_against_spec(
    spec: TensorSpec, a: np.ndarray, step: int, shape: tuple[int, ...] | None = None
) -> None:
    """``a`` (of ``shape``, default its own) has the spec's dtype and shape."""
    if a.dtype.name != spec.dtype:
        raise RecordError(
            f"tensor {spec.name!r} ({spec.kind.value}) at step {step}: dtype {a.dtype.name}, "
            f"expected {spec.dtype}"
        )
    shape = a.shape if shape is None else shape
    ok = len(shape) == len(spec.shape) and all(
        d is None or d == s for d, s in zip(spec.shape, shape, strict=False)
    )
    if not ok:
        raise RecordError(
            f"tensor {spec.name!r} ({spec.kind.value}) at step {step}: shape {list(shape)}, "
            f"expected {spec.shape}"
        )


def _prepare_location(url: str, *, clean_leftovers: bool = False) -> Manifest | None:
    """Check the location before training starts; return the manifest if resuming.

    A location holding only the writer claim and lock files of an interrupted creation
    is a new store (``clean_leftovers``: those lock files are removed — call it only
    while holding the writer claim).
    """
    loc = inspect_location(url)
    path = loc.path
    if loc.kind is LocationKind.NOT_A_DIRECTORY:
        raise StoreError(f"{path} exists and is not a directory")
    if loc.kind is LocationKind.MISSING:  # to be created: its nearest existing parent is written
        if not loc.parent_is_dir:
            raise StoreError(f"cannot create a store at {path}: {loc.parent} is not a directory")
        if not loc.writable:
            raise StoreError(f"cannot create a store at {path}: {loc.parent} is not writable")
        return None
    if loc.writable is False:
        raise StoreError(f"cannot write the store at {path}: the directory is not writable")
    if loc.kind is LocationKind.STORE:
        return read_manifest(url)
    if loc.kind is LocationKind.FOREIGN:
        if path is None:
            raise StoreError(
                f"{url} is not empty and is not a traintape store (found {list(loc.foreign)})"
            )
        raise StoreError(
            f"{path} is not empty and is not a traintape store (found {list(loc.foreign)}); "
            f"choose an empty or new directory"
        )
    if clean_leftovers:
        remove_leftovers(loc)
    return None
