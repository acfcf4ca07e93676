"""Snapshots of a multi-process JAX job, written by the processes that hold the data.

Under ``jax.distributed`` the step's tensors are global arrays spread over every process's
devices. Gathering a snapshot tensor onto one device (what a plain host callback does)
moves all of it through process 0. Instead, on full-capture steps each snapshot tensor
that can be split evenly is re-laid out *inside the compiled step* so that every device
holds one distinct slab of it (:func:`hand_over`: a sharding over all devices in
process-major order, along the first axis whose size the device count divides — no
replicas, so no two processes hold the same element), and a per-device host callback
(``buffer_callback`` in a ``shard_map``) hands each device's slab to its own process
(no host fetch of non-addressable data, no collective outside the step). Each process joins its devices'
slabs into one contiguous block (:class:`Blocks`) and writes it through
:meth:`traintape.core.recorder.Recorder.put_blocks` at its global offset; the store's
array of that tensor is sharded by the process block, so no two processes write one
shard. Process 0's rows for the step name those tensors with ``Part(None, ...,
holders=True)`` and it commits the snapshot once every process confirmed its blocks.

Tensors no axis of which the device count divides (and probe activations) still reach
process 0 whole, as do all snapshots off the CPU backend (the per-device callback's
buffers are device memory on GPU; TPU has no such callback) or where JAX lacks
``jax.experimental.buffer_callback``.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from traintape.core import Recorder
from traintape.core.writer import Part
from traintape.schema import Kind


@dataclass(frozen=True)
class Devices:
    """Every device of the job in process-major order, and this process's place in it."""

    order: tuple[Any, ...]
    """Every device, sorted by (process index, id)."""
    local: int
    """Devices per process (the same on every process)."""
    process: int
    processes: int

    @property
    def count(self) -> int:
        return self.local * self.processes


@functools.cache
def job_devices() -> Devices | None:
    """The job's devices, if it has several and its processes hold the same number of
    devices (else None: nothing is spread)."""
    if jax.device_count() < 2:
        return None
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per = collections.Counter(d.process_index for d in devs)
    local = jax.local_device_count()
    if set(per.values()) != {local} or len(per) != jax.process_count():
        return None
    return Devices(tuple(devs), local, jax.process_index(), jax.process_count())


@dataclass(frozen=True)
class Split:
    """How one snapshot tensor of canonical ``shape`` is spread: along ``axis``, each
    device holds ``rows`` of it, each process ``rows * local`` contiguous ones."""

    shape: tuple[int, ...]
    dtype: str
    axis: int
    rows: int
    devices: Devices

    @property
    def block(self) -> tuple[int, ...]:
        """The shard shape of the tensor's array: one process's block."""
        b = list(self.shape)
        b[self.axis] = self.rows * self.devices.local
        return tuple(b)

    @property
    def offset(self) -> tuple[int, ...]:
        """Where this process's block starts in the tensor."""
        o = [0] * len(self.shape)
        o[self.axis] = self.devices.process * self.block[self.axis]
        return tuple(o)

    def spec(self, mesh: Mesh) -> P:
        """The partition spec that spreads the tensor over every axis of ``mesh``."""
        spec: list[Any] = [None] * len(self.shape)
        spec[self.axis] = tuple(mesh.axis_names)
        return P(*spec)

    def placeholder(self) -> Part:
        """What process 0's rows name for the tensor: the blocks come from the holders."""
        return Part(None, (0,) * len(self.shape), self.shape, self.block, self.dtype, True)


def split_for(a: jax.Array, *, holders: bool = True) -> Split | None:
    """The :class:`Split` of the (traced) tensor ``a``, or None if it is not spread: a
    single device, unequal devices per process, no axis the device count divides, or a
    program that is not on a mesh of every device (one without a mesh, e.g. on a single
    device, is never spread out; manual axes of ``shard_map``). ``holders``: for
    snapshots written by their holders (also None in a single-process job, off the CPU
    backend — the callback's buffers are host memory there only — or without
    ``buffer_callback``)."""
    devs = job_devices()
    if devs is None or (
        holders
        and (devs.processes < 2 or jax.default_backend() != "cpu" or not holders_supported())
    ):
        return None
    mesh = program_mesh(a)  # only a program already spread over every device: never
    sizes = tuple(getattr(mesh, "axis_sizes", ()) or ())  # one placed on fewer devices
    if getattr(mesh, "manual_axes", ()) or not sizes or int(np.prod(sizes)) != devs.count:
        return None
    shape = tuple(np.shape(a))
    for axis, n in enumerate(shape):
        if n >= devs.count and n % devs.count == 0:
            return Split(shape, jnp.dtype(a.dtype).name, axis, n // devs.count, devs)
    return None


def program_mesh(a: jax.Array) -> Any:
    """The abstract mesh of the program ``a`` is traced in (from its type), or None."""
    typeof = getattr(jax, "typeof", None)  # (jax >= 0.6)
    try:
        return None if typeof is None else typeof(a).sharding.mesh
    except AttributeError:
        return None


def spread(a: jax.Array) -> jax.Array:
    """(traced) ``a`` laid out as its :func:`split_for` says (one slab per device, no
    replicas), or ``a`` itself if it is not spread. The layout the stats kernel and the
    holders' snapshots read it in: constrained once, it is resharded once."""
    sp = split_for(a, holders=False)
    if sp is None:
        return a
    mesh = mesh_like(program_mesh(a), sp.devices)
    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, sp.spec(mesh)))


def hand_over(a: jax.Array, split: Split, step: jax.Array, put: Callable[..., None]) -> jax.Array:
    """(traced) Spread ``a`` as ``split`` says and call ``put(step, k, slab)`` on the
    process of device ``k`` (of the process-major order) with the slab that device holds;
    returns int32 1 (a value to depend on).

    A jitted program may use one mesh shape only, so the layout is expressed on the
    program's own mesh (found in ``a``'s type) with the job's devices placed in it in
    process-major order, sharded over all of its axes at once. The per-device call is a
    ``buffer_callback`` inside a ``shard_map`` over that mesh: it sees the device's own
    buffer (``put`` copies it before returning), and the device's index comes from
    ``axis_index``. (``jax.debug.callback(partitioned=True)`` hands the callback arrays
    placed on the process's first device; fetching them from two devices' callbacks at
    once hangs under ``jax.distributed`` once a slab is a few MiB.)"""
    from jax.experimental.buffer_callback import buffer_callback

    mesh = mesh_like(program_mesh(a), split.devices)
    axes = tuple(mesh.axis_names)

    def host(ctx: Any, out: Any, slab: Any, index: Any, at: Any) -> None:
        put(at, index, slab)  # buffers: read (and failures kept) by Blocks.put

    call = buffer_callback(host, (), has_side_effect=True)

    def per_device(slab: jax.Array, at: jax.Array) -> jax.Array:
        call(slab, jax.lax.axis_index(axes), at)
        return jnp.ones((), jnp.int32)

    return shard_map_all(per_device, mesh, (split.spec(mesh), P()), P())(
        a, jnp.asarray(step, jnp.int32)
    )


def shard_map_all(f: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
    sm = getattr(jax, "shard_map", None)
    if sm is not None:
        return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # (jax < 0.7)

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def holders_supported() -> bool:
    """Whether this JAX has what :func:`hand_over` needs (``buffer_callback``)."""
    try:
        from jax.experimental.buffer_callback import buffer_callback  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def mesh_like(abstract: Any, devices: Devices) -> Mesh:
    """A mesh of the same shape and axes as ``abstract`` (the program's) over the job's
    devices in process-major order."""
    devs = np.array(devices.order, dtype=object)
    types = getattr(abstract, "axis_types", None)
    kw = {} if types is None else {"axis_types": tuple(types)}
    return Mesh(devs.reshape(tuple(abstract.axis_sizes)), tuple(abstract.axis_names), **kw)


class Blocks:
    """This process's side of holder-written snapshots of one record point.

    Device callbacks deliver slabs (:meth:`put`, any thread, any order); once every
    local device delivered every spread tensor of a kind for a step, the joined blocks
    go to :meth:`Recorder.put_blocks` — in step order per kind. ``run`` is the
    recorder's pump (a failure stops capture, never the step)."""

    def __init__(
        self,
        recorder: Recorder,
        kinds: dict[int, Kind],
        names: dict[int, str],
        splits: dict[int, Split],
        run: Callable[[Callable[[], None]], None],
    ) -> None:
        self.recorder = recorder
        self.kinds, self.names, self.splits = kinds, names, splits
        self.run = run
        self._want = collections.Counter(kinds.values())
        self._slabs: dict[tuple[int, int], list[Any]] = {}  # (step, j): [block, slabs in]
        self._done: dict[tuple[int, Kind], dict[str, Part]] = {}
        self._lock = threading.Lock()

    def put(self, j: int, step: Any, device: Any, slab: Any) -> None:
        """(device callback, any thread) device ``device`` (process-major order) holds
        ``slab`` of spread tensor ``j`` at ``step`` (scalars and array, or the
        callback's own buffers): copied into this process's block. A failure goes to
        ``run`` (capture stops; the step goes on unless the recorder is strict)."""
        sp = self.splits[j]
        try:
            step, device = int(np.asarray(step)), int(np.asarray(device))
            slab = np.asarray(slab)
            local = device - sp.devices.process * sp.devices.local
            if not 0 <= local < sp.devices.local:
                first = sp.devices.process * sp.devices.local
                raise RuntimeError(
                    f"traintape.jax: step {step}: a slab of {self.names[j]!r} from device "
                    f"{device}, expected devices {first}..{first + sp.devices.local - 1} "
                    f"of process {sp.devices.process}"
                )
            with self._lock:
                entry = self._slabs.get((step, j))
                if entry is None:
                    entry = self._slabs[(step, j)] = [np.empty(sp.block, slab.dtype), 0]
            at: list[Any] = [slice(None)] * len(sp.block)
            at[sp.axis] = slice(local * sp.rows, (local + 1) * sp.rows)
            entry[0][tuple(at)] = slab  # the copy, outside the lock
            with self._lock:
                entry[1] += 1
                if entry[1] < sp.devices.local:
                    return
                del self._slabs[(step, j)]
        except BaseException as e:
            err = e

            def fail() -> None:
                raise err

            self.run(fail)
            return
        self.run(lambda: self._complete(j, step, entry[0]))

    def _complete(self, j: int, step: int, block: np.ndarray) -> None:
        """Tensor ``j``'s block at ``step`` is whole: hand over what is ready."""
        sp = self.splits[j]
        with self._lock:
            parts = self._done.setdefault((step, self.kinds[j]), {})
            parts[self.names[j]] = Part(block, sp.offset, sp.shape, sp.block, sp.dtype, True)
            ready = self._ready()
        for (s, k), blocks in ready:
            self.recorder.put_blocks(s, k, blocks)

    def _ready(self) -> list[tuple[tuple[int, Kind], dict[str, Part]]]:
        """Complete snapshots that no earlier, still incomplete one of the same kind
        precedes (under ``_lock``)."""
        pending_steps = {s for s, _ in self._slabs}
        out = []
        for key in sorted(self._done, key=lambda sk: sk[0]):
            s, k = key
            if len(self._done[key]) < self._want[k]:
                continue
            earlier = any(s2 < s and k2 == k for s2, k2 in self._done) or any(
                s2 < s for s2 in pending_steps
            )
            if earlier:
                continue
            out.append((key, self._done.pop(key)))
        return out
