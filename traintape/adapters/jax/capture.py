"""Device → host transport: one ordered host callback per step that only enqueues.

Every record point (``value_and_grad``, ``watch``) calls :func:`emit` at trace time
with groups of (kind, named leaves). :func:`emit` declares the tensor specs, computes the
stat matrix inside the compiled computation (:func:`.stats.device_stats`), and inserts an *ordered*
``io_callback`` carrying only that matrix (and the step). On full-capture steps, chosen
on the device with ``lax.cond`` when the step is known there, the full tensors go to the
host too, one leaf per callback (see :func:`_ship_snapshots`) ahead of the stats; on other
steps no tensor leaves the device.

Ordered callbacks arrive in program order, also across ``jax.lax.scan``/``fori_loop``
iterations and with several devices (ordered ``io_callback`` is supported there, unlike
``jax.debug.callback(ordered=True)``), so the host assigns steps correctly. The callback
hands the small arrays to ``Recorder.record_step`` (itself an enqueue into the open
row; the store writer thread does the I/O, see :class:`Pump`);
``Recorder.close()``/``flush()`` first run ``jax.effects_barrier()`` so every dispatched
step's callback has fired (see :func:`pump_for`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from traintape.core import Recorder
from traintape.core.recorder import KindRows
from traintape.core.writer import Part
from traintape.schema import CapturePolicy, Kind
from traintape.schema.stats import activation_map, index_map

from .blocks import Blocks, Split, hand_over, split_for, spread
from .names import Leaf, specs_for
from .stats import device_stats, stats_mode


class Pump:
    """Applies host-side records in callback order, in the callback's thread.

    ``Recorder.record_step`` is itself an enqueue (it fills the open row; the store
    writer thread does the I/O), so applying it synchronously keeps the callback short
    *and* guarantees that once a step's outputs are ready on the host, its records are
    in the recorder — a following ``rec.log(t + 1, ...)`` from the training loop can
    never seal step t before its stats arrive. A failure is kept (capture of later steps
    stops) and re-raised by :meth:`drain` (``Recorder.close``/``flush``) rather than
    raised inside the XLA runtime — unless the recorder is ``strict``: then it is raised
    in the callback and the step itself fails.
    """

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def put(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._error is not None:
                return
            try:
                fn()
            except BaseException as e:
                if self.recorder.strict:  # failures are to stop training: out of the
                    raise  # callback, the jitted call fails with it
                self._error = e
                warnings.warn(
                    f"traintape.jax: recording into {self.recorder.url} failed and is "
                    f"stopped: {e!r} (raised again by Recorder.close())",
                    RuntimeWarning,
                    stacklevel=1,
                )

    def drain(self) -> None:
        """Re-raise the first failure, if any."""
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err


_PUMPS: dict[int, Pump] = {}
_PUMPS_LOCK = threading.Lock()


def pump_for(recorder: Recorder) -> Pump:
    """The recorder's pump; on first use registers a :meth:`Recorder.add_sync_hook`.

    The hook runs ``jax.effects_barrier()`` so every dispatched step's callback has
    fired, then re-raises a failure kept by the pump: when ``recorder.close()`` (or
    ``flush()``) returns, every step run before it is in the store.
    """
    with _PUMPS_LOCK:
        pump = _PUMPS.get(id(recorder))
        if pump is not None and pump.recorder is recorder:
            return pump
        pump = Pump(recorder)
        _PUMPS[id(recorder)] = pump

    def sync(closing: bool) -> None:
        try:
            jax.effects_barrier()
            pump.drain()
        finally:
            if closing:
                with _PUMPS_LOCK:
                    _PUMPS.pop(id(recorder), None)

    recorder.add_sync_hook(sync)
    return pump


@dataclass
class StepCounter:
    """Host-side step numbering for the automatic mode (one call = one step)."""

    start: int = 0
    _it: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._it = itertools.count(self.start)

    def next(self) -> int:
        with self._lock:
            return next(self._it)


@dataclass
class Group:
    """Leaves of one kind to record at one point: names (trace-time) and device arrays."""

    kind: Kind
    leaves: list[Leaf]
    arrays: list[jax.Array]
    layer_kinds: dict[str, str | None] | None = None
    snapshots: bool | Callable[[], dict[str, jax.Array]] = True
    """False: never write full tensors for this group (e.g. activations of a training
    batch, whose snapshots are only meaningful for a fixed probe batch); or a function
    returning the snapshot tensors by name, traced inside the full-capture branch only
    (activations of a fixed probe batch: the probe forward pass runs on those steps only)."""
    in_forward_order: bool = True
    """Activations: whether ``leaves`` are in the order the layers ran."""


def fetch_step(counter: StepCounter) -> jax.Array:
    """Ask the host for the next automatic step number (an ordered round trip, int32)."""
    return io_callback(
        lambda: np.int32(counter.next()), jax.ShapeDtypeStruct((), jnp.int32), ordered=True
    )


def emit(
    recorder: Recorder,
    groups: Sequence[Group],
    *,
    step: jax.Array | int | None,
    counter: StepCounter | None = None,
) -> None:
    """Record ``groups`` at ``step`` from inside a (possibly jitted) computation.

    Args:
        step: the optimizer step as a traced or concrete integer; ``None`` = automatic:
            ``counter`` numbers the callbacks in arrival order (one per executed call).
    Trace-time work: declare specs, build the stat computation and the callbacks. Nothing
    here blocks; the host side runs in the callbacks, through the recorder's :class:`Pump`.
    """
    policy = recorder.policy
    groups = [
        dataclasses.replace(g, leaves=[lf for lf in g.leaves if policy.selects(lf.name)])
        for g in groups
        if policy.records_kind(g.kind)
    ]  # fmt: skip
    groups = [g for g in groups if g.leaves]
    if not groups or not recorder.enabled:
        return
    for g in groups:
        recorder.declare(
            specs_for(g.leaves, g.kind, g.layer_kinds), in_forward_order=g.in_forward_order
        )
    arrays = [[lf.canonical(g.arrays[lf.index]) for lf in g.leaves] for g in groups]
    if stats_mode() == "kernel":  # over several devices: spread once, for stats and snapshots
        arrays = [[spread(a) for a in arrs] for arrs in arrays]
    sizes = [len(g.leaves) for g in groups]
    # stats of a leaf held permuted (equinox) are taken in its own layout, the sig
    # pattern following the canonical index (no transposed copy for the kernel); an
    # activation's batch axis is free (the pattern runs over the per-example index)
    held, maps = [], []
    for g, arrs in zip(groups, arrays, strict=True):
        for lf, a in zip(g.leaves, arrs, strict=True):
            if g.kind is Kind.ACTIVATION:
                held.append(a)
                maps.append(activation_map(jnp.shape(a)))
            elif lf.permutation is not None:
                src = g.arrays[lf.index]
                held.append(src)
                maps.append(index_map(jnp.shape(src), lf.permutation))
            else:
                held.append(a)
                maps.append(None)
    stats, decode = device_stats(held, maps)
    kinds = [g.kind for g in groups]
    names = [tuple(lf.name for lf in g.leaves) for g in groups]
    pump = pump_for(recorder)
    snap_groups = [
        i
        for i, g in enumerate(groups)
        if g.snapshots and policy.full_every and g.kind in policy.snapshot_kinds
    ]
    # multi-process: snapshots that spread evenly over the job's devices are written by
    # the processes holding them (blocks.py); the rest reach process 0 whole
    splits: dict[int, Split] = {}
    j = 0
    for i in snap_groups:
        for a in arrays[i]:
            sp = None if callable(groups[i].snapshots) else split_for(a)
            if sp is not None:
                splits[j] = sp
            j += 1
    n_snaps = sum(sizes[i] for i in snap_groups)
    pending = _Snapshots(n_snaps - len(splits), pump)
    blocks = None
    if splits:
        snap_kinds = [groups[i].kind for i in snap_groups for _ in groups[i].leaves]
        snap_names = [lf.name for i in snap_groups for lf in groups[i].leaves]
        blocks = Blocks(
            recorder,
            {j: snap_kinds[j] for j in splits},
            {j: snap_names[j] for j in splits},
            splits,
            pump.put,
        )
    if step is None and counter is None:
        raise ValueError("emit: automatic step numbering needs a counter")
    auto = counter

    def host(step_v: Any, stats_v: Any, shipped: Any = None) -> None:
        s = auto.next() if auto is not None and step_v is None else int(step_v)

        def apply() -> None:  # in the pump: a failure stops capture, never the step
            raw = decode(stats_v)
            snaps = pending.take(s, shipped, splits) if shipped is not None else None
            _apply(recorder, s, kinds, names, sizes, raw, snaps, snap_groups)

        pump.put(apply)

    if snap_groups and auto is not None and step is None:
        step = fetch_step(auto)
    if step is None:
        io_callback(lambda st: host(None, st), None, stats, ordered=True)
        return
    step_a = jnp.asarray(step, jnp.int32)
    if not snap_groups:
        io_callback(host, None, step_a, stats, ordered=True)
        return
    shipped = _ship_snapshots(step_a, policy, groups, snap_groups, arrays, pending, blocks)
    io_callback(host, None, step_a, stats, shipped, ordered=True)


class _Snapshots:
    """Host side of full capture: whole tensors of one record point, shipped one leaf per
    callback (:func:`_ship_snapshots`), collected by step until that step's stats
    callback takes them (it runs after them: their flags are its operand)."""

    def __init__(self, n: int, pump: Pump) -> None:
        self.n = n
        self.pump = pump
        self._by_step: dict[int, dict[int, np.ndarray]] = {}
        self._lock = threading.Lock()

    def put(self, j: int, step_v: Any, a: Any) -> np.int32:
        def keep() -> None:  # copy: the callback's buffer is only valid during the callback
            copy = np.array(a, copy=True)
            with self._lock:
                self._by_step.setdefault(int(step_v), {})[j] = copy

        self.pump.put(keep)  # a failure (out of memory) stops capture, not the step
        return np.int32(1)

    def take(
        self, step: int, shipped: Any, splits: dict[int, Split]
    ) -> list[np.ndarray | Part] | None:
        """The step's tensors, if it shipped any (``shipped``: the flags from
        :func:`_ship_snapshots`); a tensor its holders write (``splits``) is named by
        its :meth:`Split.placeholder`."""
        with self._lock:
            got = self._by_step.pop(step, {})
        if not np.any(shipped):
            return None
        if len(got) != self.n:
            raise RuntimeError(
                f"traintape.jax: step {step}: {len(got)} of {self.n} full tensors arrived"
            )
        n = self.n + len(splits)
        return [splits[j].placeholder() if j in splits else got[j] for j in range(n)]


def _ship_snapshots(
    step: jax.Array,
    policy: CapturePolicy,
    groups: Sequence[Group],
    snap_groups: Sequence[int],
    arrays: Sequence[Sequence[jax.Array]],
    pending: _Snapshots,
    blocks: Blocks | None = None,
) -> jax.Array:
    """On full-capture steps (``policy.is_full(step)``, decided on the device) send the
    snapshot tensors to ``pending``, one callback per leaf under its own ``lax.cond``.

    Returns an int32 vector (1 per leaf shipped) that the step's stats callback takes as
    an operand: that data dependency, not an effect token, puts every leaf's callback
    before the stats callback. Ordered callbacks (one token chain) or one cond over all
    leaves would keep every leaf alive until the last exists (every update until the
    optimizer has made all of them): a larger temp allocation, fresh pages and ~10k page
    faults per step on the benchmark's 11M-param MLP (``benchmarks/jax_overhead.py``).
    A group whose snapshots come from a function (the probe batch's activations) runs it
    inside one cond, on full-capture steps only. A tensor with a split in ``blocks``
    (multi-process) is spread over the job's devices and handed to ``blocks`` by one
    callback per device instead (:mod:`.blocks`)."""
    full = policy.is_full(step)
    flags: list[jax.Array] = []
    out = jax.ShapeDtypeStruct((), jnp.int32)

    def send(k: int, a: jax.Array) -> jax.Array:
        return io_callback(functools.partial(pending.put, k), out, step, a, ordered=False)

    def to_holders(blocks: Blocks, k: int, a: jax.Array) -> jax.Array:
        return hand_over(a, blocks.splits[k], step, functools.partial(blocks.put, k))

    j = 0
    for i in snap_groups:
        g = groups[i]
        idx = range(j, j + len(g.leaves))
        j += len(g.leaves)
        if callable(g.snapshots):

            def probe(fn=g.snapshots, ix=idx, nm=tuple(lf.name for lf in g.leaves)) -> jax.Array:
                by_name = fn()  # traced in this branch only: runs on full steps only
                return jnp.stack([send(k, by_name[n]) for k, n in zip(ix, nm, strict=True)])

            flags.append(jax.lax.cond(full, probe, lambda n=len(idx): jnp.zeros(n, jnp.int32)))
        else:
            for k, a in zip(idx, arrays[i], strict=True):
                if blocks is not None and k in blocks.splits:
                    send_k = functools.partial(to_holders, blocks, k)
                else:
                    send_k = functools.partial(send, k)
                shipped = jax.lax.cond(full, lambda f=send_k, a=a: f(a), lambda: jnp.int32(0))
                flags.append(shipped[None])
    return jnp.concatenate(flags)


def _apply(
    recorder: Recorder,
    step: int,
    kinds: list[Kind],
    names: list[tuple[str, ...]],
    sizes: list[int],
    raw: np.ndarray,
    snaps: list[np.ndarray | Part] | None,
    snap_groups: list[int],
) -> None:
    """Hand one step's raw rows (and snapshots) to the recorder in one call (the
    recorder applies the policy)."""
    off = 0
    snap_off = 0
    parts = []
    for i, (kind, nm, n) in enumerate(zip(kinds, names, sizes, strict=True)):
        snapshots = None
        if snaps is not None and i in snap_groups:
            snapshots = dict(zip(nm, snaps[snap_off : snap_off + n], strict=True))
            snap_off += n
        parts.append(KindRows(kind, nm, raw[off : off + n], snapshots))
        off += n
    recorder.record_step(step, parts)
