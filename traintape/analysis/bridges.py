"""Bridges to the dashboards people already use: TensorBoard and Weights & Biases.

:func:`export_tensorboard` writes a TensorBoard event file, :func:`export_wandb` an
offline W&B run. Both carry the same content; the store stays the source of truth and an
export can be redone with other options at any time.

What goes where (``step`` is always the optimizer step the store recorded):

- ``<kind>/<tensor>/<stat>`` — a scalar per step for each kind (``param``, ``grad``,
  ``update``, ``activation``, ``opt_state``), tensor (canonical name, e.g.
  ``layers/0/kernel``) and chosen stat (default ``l2``, ``mean``, ``std``, ``max``,
  ``min``), at every step where that tensor's kind was recorded;
- ``<metric>`` — each training metric (``loss``, ``lr``, ...) under its own name, and each
  system metric under its ``sys/...`` name, at the steps where it was logged;
- ``<kind>/<tensor>/histogram`` — a histogram of the full tensor (finite values only,
  ``bins`` equal-width buckets from its min to its max) at each step with a snapshot
  (``CapturePolicy(full_every=...)``).

Stats are read in blocks of rows (the same block size as the parquet/CSV export,
:data:`traintape.analysis.export.BLOCK_VALUES` (row, tensor) pairs), so memory holds one
block and one snapshot at a time, never the whole run.

``tensorboard`` and ``wandb`` are optional: ``pip install 'traintape[bridges]'``.
Neither tensorflow nor torch is imported.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from traintape.analysis._common import ProgressCallback, Tracker
from traintape.core import layout as L
from traintape.schema import Kind

if TYPE_CHECKING:
    from traintape.core.reader import Run

DEFAULT_STATS: tuple[str, ...] = ("l2", "mean", "std", "max", "min")
"""Stats exported per tensor unless told otherwise."""

DEFAULT_BINS = 30
"""Histogram buckets (TensorBoard's own default); at most 512 (W&B's limit)."""

MAX_BINS = 512

EVENT_SUFFIX = ".traintape"
"""Ending of the event files :func:`export_tensorboard` writes."""

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class MissingDependencyError(ImportError):
    """The package a bridge needs is not installed (``pip install 'traintape[bridges]'``)."""

    def __init__(self, target: str, package: str) -> None:
        self.target = target
        self.package = package
        super().__init__(
            f"exporting to {target} needs the {package} package, which is not installed: "
            f"pip install 'traintape[bridges]' (or pip install {package})"
        )


def require(target: str) -> None:
    """Raise :class:`MissingDependencyError` unless ``target``'s package
    (``'tensorboard'`` or ``'wandb'``) can be imported."""
    package = _PACKAGES.get(target)
    if package is None:
        raise ValueError(f"unknown bridge {target!r}: use tensorboard or wandb")
    module = "tensorboard.compat.proto.event_pb2" if target == "tensorboard" else "wandb"
    try:
        __import__(module)
    except ImportError as e:
        raise MissingDependencyError(target, package) from e


# ---------------------------------------------------------------------------- content


@dataclass(frozen=True)
class _Histogram:
    tag: str
    counts: np.ndarray  # int64 [bins]
    edges: np.ndarray  # float64 [bins + 1]


@dataclass
class _Step:
    """Everything exported at one optimizer step."""

    step: int
    wall_time: float
    tags: list[np.ndarray] = field(default_factory=list)  # object arrays of tag names
    values: list[np.ndarray] = field(default_factory=list)  # float64, parallel to tags
    histograms: list[_Histogram] = field(default_factory=list)

    def scalars(self) -> Iterator[tuple[str, float]]:
        for t, v in zip(self.tags, self.values, strict=True):
            yield from zip(t.tolist(), v.tolist(), strict=True)


class _Plan:
    """What to export from ``run`` (validated options) and how to stream it."""

    def __init__(
        self,
        run: Run,
        kinds: Sequence[Kind | str] | None,
        stats: Sequence[str],
        metrics: bool,
        system: bool,
        histograms: bool,
        bins: int,
    ) -> None:
        self.run = run
        have = run.kinds()
        if kinds is None:
            self.kinds = list(have)
        else:
            self.kinds = []
            for k in kinds:
                value = getattr(k, "value", k)
                if value not in [x.value for x in have]:
                    raise ValueError(
                        f"kind {value!r} is not in this run: "
                        f"use one of {', '.join(x.value for x in have) or '(none)'}"
                    )
                kind = Kind(value)
                if kind not in self.kinds:
                    self.kinds.append(kind)
        held = list(run.manifest.stat_names)  # a store older than 1.4.0 has no sig
        bad = [s for s in stats if s not in held]
        if bad:
            raise ValueError(f"unknown stat {bad[0]!r}: use any of {', '.join(held)}")
        self.stats = list(dict.fromkeys(stats))
        if not 1 <= bins <= MAX_BINS:
            raise ValueError(f"bins must be between 1 and {MAX_BINS}, got {bins}")
        self.bins = bins
        self.cols = [held.index(s) for s in self.stats]
        self.names = {k: run.tensor_names(k) for k in self.kinds}
        self.tags = {
            k: np.array(
                [[f"{k.value}/{n}/{s}" for s in self.stats] for n in self.names[k]], dtype=object
            ).reshape(len(self.names[k]), len(self.stats))
            for k in self.kinds
        }
        # metrics: one [rows, metric] float64 array (NaN: not logged at that row)
        frames = []
        if metrics:
            frames.append(run.metrics())
        sys_frame = run.system() if run.manifest.metrics else None
        if system and sys_frame is not None:
            frames.append(sys_frame)
        cols: list[str] = []
        arrays: list[np.ndarray] = []
        for f in frames:
            if len(f.columns):
                cols.extend(str(c) for c in f.columns)
                arrays.append(f.reindex(run.steps).to_numpy(dtype=np.float64))
        self.metric_names = np.array(cols, dtype=object)
        self.metric_values = (
            np.concatenate(arrays, axis=1) if arrays else np.zeros((run.rows, 0), dtype=np.float64)
        )
        # wall time of each row: sys/time where recorded, else the run's creation time
        created = run.manifest.created_at.timestamp()
        self.wall = np.full(run.rows, created, dtype=np.float64)
        if sys_frame is not None and "sys/time" in sys_frame.columns:
            t = sys_frame["sys/time"].reindex(run.steps).to_numpy(dtype=np.float64)
            ok = np.isfinite(t)
            self.wall[ok] = t[ok]
        # snapshots: step -> [(kind, snapshot index)]
        self.snap_at: dict[int, list[tuple[Kind, int]]] = {}
        if histograms:
            for k in self.kinds:
                if run.manifest.commit.snapshots.get(k, 0) and self.names[k]:
                    for i, s in enumerate(run.snapshot_steps(self.names[k][0], k).tolist()):
                        self.snap_at.setdefault(int(s), []).append((k, i))
        total = sum(len(n) for n in self.names.values())
        # the module (traintape.analysis.export is also the name of its function)
        block = importlib.import_module("traintape.analysis.export").BLOCK_VALUES
        self.rows_per_block = max(1, int(block) // max(1, total))

    @property
    def blocks(self) -> int:
        return -(-self.run.rows // self.rows_per_block) if self.run.rows else 0

    @property
    def snapshot_units(self) -> int:
        return sum(len(self.names[k]) for v in self.snap_at.values() for k, _ in v)

    def steps(self, tracker: Tracker) -> Iterator[_Step]:
        """Every step's content in increasing step order, read block by block of rows."""
        run = self.run
        steps = run.steps
        recorded = set(steps.tolist())
        orphans = sorted(s for s in self.snap_at if s not in recorded)  # snapshot, no row
        o = 0
        for start in range(0, run.rows, self.rows_per_block):
            stop = min(start + self.rows_per_block, run.rows)
            tracker.stage(f"steps {int(steps[start])}…{int(steps[stop - 1])}")
            present: dict[Kind, np.ndarray] = {}
            chosen: dict[Kind, np.ndarray] = {}
            for k in self.kinds:
                if not self.names[k]:
                    continue
                block = run.stats_array(k, rows=slice(start, stop))  # [b, tensor, stat]
                present[k] = ~np.isnan(block).all(axis=2)  # the kind was recorded there
                chosen[k] = block[:, :, self.cols]
            for i in range(stop - start):
                s = int(steps[start + i])
                while o < len(orphans) and orphans[o] < s:
                    yield self._snapshot_step(orphans[o], self.wall[start + i], tracker)
                    o += 1
                out = _Step(s, float(self.wall[start + i]))
                for k in present:
                    m = present[k][i]
                    if m.any():
                        out.tags.append(self.tags[k][m].ravel())
                        out.values.append(chosen[k][i][m].ravel())
                if self.metric_names.size:
                    v = self.metric_values[start + i]
                    m = ~np.isnan(v)
                    if m.any():
                        out.tags.append(self.metric_names[m])
                        out.values.append(v[m])
                out.histograms = self._histograms(s, tracker)
                yield out
            tracker.advance()
        last = float(self.wall[-1]) if run.rows else run.manifest.created_at.timestamp()
        for s in orphans[o:]:
            yield self._snapshot_step(s, last, tracker)

    def _snapshot_step(self, step: int, wall: float, tracker: Tracker) -> _Step:
        return _Step(step, float(wall), histograms=self._histograms(step, tracker))

    def _histograms(self, step: int, tracker: Tracker) -> list[_Histogram]:
        out: list[_Histogram] = []
        for k, idx in self.snap_at.get(step, ()):
            tracker.stage(f"{k.value} histograms at step {step}")
            for n in self.names[k]:
                a = np.asarray(self.run.array(L.snapshot_path(k, n))[idx].read().result())
                h = histogram(a, self.bins)
                if h is not None:
                    out.append(_Histogram(f"{k.value}/{n}/histogram", *h))
                tracker.advance()
        return out


def histogram(a: np.ndarray, bins: int = DEFAULT_BINS) -> tuple[np.ndarray, np.ndarray] | None:
    """``(counts, edges)`` of the finite values of ``a`` in ``bins`` equal-width buckets
    (``numpy.histogram``); None when ``a`` has no finite value."""
    a = np.asarray(a)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float64)
    a = a.reshape(-1)
    finite = np.isfinite(a)
    if not finite.all():
        a = a[finite]
    if a.size == 0:
        return None
    counts, edges = np.histogram(a, bins=bins)
    return counts.astype(np.int64), edges.astype(np.float64)


# ---------------------------------------------------------------------------- TensorBoard


def _masked_crc32c() -> Callable[[bytes], int]:
    """TFRecord's masked CRC-32C: google_crc32c's C implementation where present (zarr
    installs it), else TensorBoard's own (pure Python, slow on big events)."""
    try:
        import google_crc32c

        if getattr(google_crc32c, "implementation", "") == "c":
            value = google_crc32c.value

            def fast(data: bytes) -> int:
                x = value(data)
                return (((x >> 15) | ((x << 17) & 0xFFFFFFFF)) + 0xA282EAD8) & 0xFFFFFFFF

            return fast
    except ImportError:
        pass
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    return masked_crc32c  # type: ignore[no-any-return]


def _existing_events(logdir: str) -> tuple[list[str], list[str]]:
    """Event files directly in ``logdir``: (written by traintape, by something else)."""
    ours: list[str] = []
    foreign: list[str] = []
    if os.path.isdir(logdir):
        for f in sorted(os.listdir(logdir)):
            if "tfevents" in f and os.path.isfile(os.path.join(logdir, f)):
                (ours if f.endswith(EVENT_SUFFIX) else foreign).append(os.path.join(logdir, f))
    return ours, foreign


def check_logdir(logdir: str | os.PathLike[str], *, overwrite: bool = False) -> list[str]:
    """Raise FileExistsError unless :func:`export_tensorboard` may write into ``logdir``:
    it holds no event files, or only an earlier traintape export and ``overwrite`` is set
    (returned: the files that export would replace)."""
    logdir = os.fspath(logdir)
    ours, foreign = _existing_events(logdir)
    if foreign:
        raise FileExistsError(
            f"{logdir} already holds TensorBoard event files traintape did not write "
            f"({os.path.basename(foreign[0])}{', ...' if len(foreign) > 1 else ''}); "
            "export into a directory of its own"
        )
    if ours and not overwrite:
        raise FileExistsError(
            f"{logdir} already holds a traintape export ({os.path.basename(ours[0])}); "
            "pass overwrite=True (--overwrite) to replace it, or choose another directory"
        )
    return ours


def export_tensorboard(
    run: Run,
    logdir: str | os.PathLike[str],
    *,
    kinds: Sequence[Kind | str] | None = None,
    stats: Sequence[str] = DEFAULT_STATS,
    metrics: bool = True,
    system: bool = True,
    histograms: bool = True,
    bins: int = DEFAULT_BINS,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> str:
    """Write ``run`` as one TensorBoard event file in ``logdir``; returns its path.

    View it with ``tensorboard --logdir LOGDIR``. Every event's ``step`` is the optimizer
    step; its wall time is the step's ``sys/time`` where the run recorded system metrics
    (so TensorBoard's *relative* / *wall* axes show training time), else the run's start.

    - scalars ``<kind>/<tensor>/<stat>`` for ``kinds`` (default: all the run has) and
      ``stats`` (default :data:`DEFAULT_STATS`), at every step the kind was recorded;
    - scalars ``<metric>`` for the training metrics (``metrics``) and ``sys/...`` for the
      system metrics (``system``), at the steps they were logged;
    - histograms ``<kind>/<tensor>/histogram`` (``histograms``; ``bins`` buckets over the
      finite values) at each snapshot step.

    Scalars are TensorBoard ``simple_value`` summaries, so float32 (``sys/time`` loses
    its sub-minute digits there; the event wall time keeps it); histograms use the
    histogram plugin's tensor format (``[bins, 3]``: left edge, right edge, count).
    Written with TensorBoard's protos and record writer (``tensorboard.compat.proto``,
    ``tensorboard.summary.writer.record_writer``) — tensorflow is never imported.

    ``logdir`` is created if needed. An earlier traintape export there is replaced only
    with ``overwrite=True`` (FileExistsError otherwise); event files written by something
    else are never touched (FileExistsError: TensorBoard would mix the two).
    ``progress(stage, done, total)`` counts row blocks and snapshot tensors.
    """
    require("tensorboard")
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.histogram import metadata as hist_metadata
    from tensorboard.summary.writer.record_writer import RecordWriter
    from tensorboard.util import tensor_util

    plan = _Plan(run, kinds, stats, metrics, system, histograms, bins)
    logdir = os.fspath(logdir)
    ours = check_logdir(logdir, overwrite=overwrite)
    os.makedirs(logdir, exist_ok=True)
    for p in ours:
        os.remove(p)
    tracker = Tracker(progress)
    tracker.add(plan.blocks + plan.snapshot_units)

    crc = _masked_crc32c()

    class _Records(RecordWriter):
        """TensorBoard's record writer with a C CRC (its own is pure Python)."""

        def write(self, data: bytes) -> None:
            header = struct.pack("<Q", len(data))
            self._writer.write(
                header + struct.pack("<I", crc(header)) + data + struct.pack("<I", crc(data))
            )

    name = (
        f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
        f"{os.getpid()}.0{EVENT_SUFFIX}"
    )
    path = os.path.join(logdir, name)
    hist_meta: dict[str, Any] = {}
    with open(path, "wb") as f:
        records = _Records(f)
        first = event_pb2.Event(
            wall_time=float(plan.wall[0]) if run.rows else time.time(),
            file_version="brain.Event:2",
            source_metadata=event_pb2.SourceMetadata(writer="traintape"),
        )
        records.write(first.SerializeToString())
        for st in plan.steps(tracker):
            ev = event_pb2.Event(step=st.step, wall_time=st.wall_time)
            add = ev.summary.value.add
            for tag, value in st.scalars():
                add(tag=tag, simple_value=value)
            for h in st.histograms:
                meta = hist_meta.get(h.tag)
                if meta is None:
                    meta = hist_meta[h.tag] = hist_metadata.create_summary_metadata(
                        display_name=h.tag, description=""
                    )
                buckets = np.stack([h.edges[:-1], h.edges[1:], h.counts.astype(np.float64)], 1)
                add(
                    tag=h.tag,
                    metadata=meta,
                    tensor=tensor_util.make_tensor_proto(buckets),
                )
            if len(ev.summary.value):
                records.write(ev.SerializeToString())
        records.flush()
    tracker.finish()
    return path


# ---------------------------------------------------------------------------- W&B


@contextlib.contextmanager
def _env_default(**values: str) -> Iterator[None]:
    """Set environment variables not already set, for the duration only."""
    added = [k for k in values if k not in os.environ]
    for k in added:
        os.environ[k] = values[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _wandb_settings(wandb: Any) -> Any:
    """Offline, quiet, and nothing about the exporting machine or process (its system
    metrics, git state, code, installed packages) mixed into the exported run."""
    wanted: dict[str, Any] = {
        "silent": True,
        "console": "off",
        "x_disable_stats": True,
        "x_disable_meta": True,
        "x_disable_machine_info": True,
        "disable_git": True,
        "disable_code": True,
        "save_code": False,
        "disable_job_creation": True,
        "x_save_requirements": False,
    }
    fields = getattr(wandb.Settings, "model_fields", None)
    if fields is not None:
        wanted = {k: v for k, v in wanted.items() if k in fields}
    else:  # an older Settings class: only the long-standing options
        wanted = {"silent": True, "console": "off"}
    return wandb.Settings(**wanted)


def _service_running(wandb: Any) -> bool:
    """Whether this process already has a W&B service connection (then it is not ours to
    tear down: it may carry the user's own runs)."""
    try:
        from wandb.sdk import wandb_setup

        s = wandb_setup._singleton
        return s is not None and s._pid == os.getpid() and s._connection is not None
    except Exception:
        return wandb.run is not None


def _wait_written(run_dir: str, timeout: float = 30.0) -> None:
    """Wait until the offline run's transaction log has data beyond its header (the W&B
    service closes it shortly after ``finish`` returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = glob.glob(os.path.join(run_dir, "*.wandb"))
        if logs and all(os.path.getsize(p) > 7 for p in logs):
            return
        time.sleep(0.05)


def export_wandb(
    run: Run,
    dir: str | os.PathLike[str],
    *,
    project: str = "traintape",
    name: str | None = None,
    kinds: Sequence[Kind | str] | None = None,
    stats: Sequence[str] = DEFAULT_STATS,
    metrics: bool = True,
    system: bool = True,
    histograms: bool = True,
    bins: int = DEFAULT_BINS,
    init: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> str:
    """Write ``run`` as an offline Weights & Biases run under ``dir``; returns the run's
    directory (``DIR/wandb/offline-run-<time>-<id>``).

    Nothing is sent anywhere: the run is created with ``mode="offline"`` (whatever
    ``WANDB_MODE`` says) and error reporting off unless ``WANDB_ERROR_REPORTING`` is set;
    upload it later with ``wandb sync <returned dir>``. The W&B service process this
    starts is stopped before returning (one that already ran in this process is left
    alone). Each store row is one ``run.log(..., step=<optimizer step>)``, in step order:

    - ``<kind>/<tensor>/<stat>`` for ``kinds`` (default: all the run has) and ``stats``
      (default :data:`DEFAULT_STATS`), at every step the kind was recorded;
    - ``<metric>`` (``metrics``) and ``sys/...`` (``system``) at the steps they were
      logged (full float64 precision);
    - ``<kind>/<tensor>/histogram`` — a ``wandb.Histogram`` of ``bins`` buckets over the
      finite values — at each snapshot step (``histograms``).

    The W&B run is named ``name`` (default: the store's run id) in ``project``; its
    config holds ``traintape`` (run id, store URL, producer, capture policy, user
    metadata) and ``export`` (the kinds and stats exported). ``init``: more keyword
    arguments for ``wandb.init`` (``entity``, ``tags``, ``group``, ``notes``, ...; not
    ``mode`` or ``dir``). W&B's own system metrics, git and code capture are off: they
    would describe the exporting machine, not the training.
    """
    require("wandb")
    import wandb

    extra = dict(init or {})
    for k in ("mode", "dir"):
        if k in extra:
            raise ValueError(f"init may not set {k!r}: export_wandb writes offline runs to dir")
    plan = _Plan(run, kinds, stats, metrics, system, histograms, bins)
    dir = os.fspath(dir)
    os.makedirs(dir, exist_ok=True)
    m = run.manifest
    config = {
        "traintape": {
            "run_id": m.run_id,
            "url": run.url,
            "status": m.status,
            "rows": run.rows,
            "producer": m.producer.model_dump(mode="json"),
            "policy": m.policy.model_dump(mode="json"),
            "user": m.user,
        },
        "export": {"kinds": [k.value for k in plan.kinds], "stats": plan.stats},
    }
    args: dict[str, Any] = {
        "project": project,
        "name": name or m.run_id,
        "config": config,
        **extra,
        "mode": "offline",
        "dir": dir,
    }
    fields = getattr(wandb.Settings, "model_fields", {})
    if "reinit" in fields and "create_new" in str(fields["reinit"].annotation):
        args.setdefault("reinit", "create_new")  # leave any run of the user's untouched
    tracker = Tracker(progress)
    tracker.add(plan.blocks + plan.snapshot_units)
    ours = not _service_running(wandb)
    with _env_default(WANDB_ERROR_REPORTING="false"):
        wrun = wandb.init(settings=_wandb_settings(wandb), **args)
        run_dir = os.path.dirname(os.path.abspath(wrun.dir))
        failed = True
        try:
            for st in plan.steps(tracker):
                payload: dict[str, Any] = dict(st.scalars())
                for h in st.histograms:
                    payload[h.tag] = wandb.Histogram(np_histogram=(h.counts, h.edges))
                if payload:
                    wrun.log(payload, step=st.step)
            failed = False
        finally:
            try:
                wrun.finish(exit_code=1 if failed else 0)
            finally:
                if ours:
                    try:
                        wandb.teardown()
                    except SystemExit as e:  # the service reported a failure
                        if not failed:
                            raise RuntimeError(
                                f"the W&B service failed writing {run_dir} (exit code "
                                f"{e.code}); see {run_dir}/logs"
                            ) from None
    if not ours:
        _wait_written(run_dir)
    tracker.finish()
    return run_dir
