"""Snapshots of a multi-process JAX job, written by the processes that hold the data.

Under ``jax.distributed`` the step's tensors are global arrays spread over every process's
devices. Gathering a snapshot tensor onto one device (what a plain host callback does)
moves all of it through process 0. Instead, on full-capture steps each snapshot tensor
that can be split evenly is re-laid out *inside the compiled step* so that every device
holds one distinct slab of it (:func:`spread`: a sharding over all devices in
process-major order, along the first axis whose size the device count divides — no
replicas, so no two processes hold the same element), and a *partitioned* debug
callback hands each device its slab on its own process (no host fetch of
non-addressable data, no collective outside the step). Each process joins its devices'
slabs into one contiguous block (:class:`Blocks`) and writes it through
:meth:`traintape.core.recorder.Recorder.put_blocks` at its global offset; the store's
array of that tensor is sharded by the process block, so no two processes write one
shard. Process 0's rows for the step name those tensors with ``Part(None, ...,
holders=True)`` and it commits the snapshot once every process confirmed its blocks.

Tensors no axis of which the device count divides (and probe activations) still reach
process 0 whole.
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

AXIS = "traintape"


@dataclass(frozen=True)
class Devices:
    """Every device of the job in process-major order, and this process's place in it."""

    mesh: Mesh
    local: int
    """Devices per process (the same on every process)."""
    process: int
    processes: int

    @property
    def count(self) -> int:
        return self.local * self.processes


@functools.cache
def job_devices() -> Devices | None:
    """The job's devices, if this is a multi-process job whose processes hold the same
    number of devices (else None: snapshots reach process 0 whole)."""
    if jax.process_count() < 2:
        return None
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per = collections.Counter(d.process_index for d in devs)
    local = jax.local_device_count()
    if set(per.values()) != {local} or len(per) != jax.process_count():
        return None
    return Devices(Mesh(np.array(devs), (AXIS,)), local, jax.process_index(), jax.process_count())


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

    def placeholder(self) -> Part:
        """What process 0's rows name for the tensor: the blocks come from the holders."""
        return Part(None, (0,) * len(self.shape), self.shape, self.block, self.dtype, True)


def split_for(a: jax.Array) -> Split | None:
    """The :class:`Split` of the (traced) snapshot tensor ``a``, or None if it reaches
    process 0 whole: a single-process job, unequal devices per process, no axis the
    device count divides, or a program whose mesh this cannot lay out on (manual axes
    of ``shard_map``; a mesh over a subset of the devices)."""
    devs = job_devices()
    if devs is None:
        return None
    mesh = _program_mesh(a)
    if mesh is not None:
        sizes = tuple(getattr(mesh, "axis_sizes", ()) or ())
        if getattr(mesh, "manual_axes", ()) or (sizes and int(np.prod(sizes)) != devs.count):
            return None
    shape = tuple(np.shape(a))
    for axis, n in enumerate(shape):
        if n >= devs.count and n % devs.count == 0:
            return Split(shape, jnp.dtype(a.dtype).name, axis, n // devs.count, devs)
    return None


def _program_mesh(a: jax.Array) -> Any:
    """The abstract mesh of the program ``a`` is traced in (from its type), or None."""
    typeof = getattr(jax, "typeof", None)  # (jax >= 0.6)
    try:
        return None if typeof is None else typeof(a).sharding.mesh
    except AttributeError:
        return None


def spread(a: jax.Array, split: Split, step: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(traced) ``a`` laid out as ``split`` says, the global index along its axis laid
    out alike (each device's first entry: where its slab starts), and ``step``
    replicated on every device (the result of a host callback, e.g. the automatic step
    number, lives on device 0 only: a partitioned callback elsewhere would read 0).

    A jitted program may use one mesh shape only, so the layout is expressed on the
    program's own mesh (found in ``a``'s type) with the job's devices placed in it in
    process-major order, sharded over all of its axes at once: device ``k`` of that
    order holds slab ``k``."""
    mesh = _mesh_like(_program_mesh(a), split.devices)
    axes = tuple(mesh.axis_names)
    spec: list[Any] = [None] * a.ndim
    spec[split.axis] = axes
    a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))
    pos = jnp.arange(split.shape[split.axis], dtype=jnp.int32)
    pos = jax.lax.with_sharding_constraint(pos, NamedSharding(mesh, P(axes)))
    step = jax.lax.with_sharding_constraint(step, NamedSharding(mesh, P()))
    return a, pos, step


@functools.cache
def _mesh_like(abstract: Any, devices: Devices) -> Mesh:
    """A mesh of the same shape and axes as ``abstract`` (the program's), or a 1-D one
    if the program has none, over the job's devices in process-major order."""
    devs = np.array(devices.mesh.devices).reshape(-1)
    sizes = tuple(getattr(abstract, "axis_sizes", ()) or ())
    if not sizes:
        return devices.mesh
    types = getattr(abstract, "axis_types", None)
    kw = {} if types is None else {"axis_types": tuple(types)}
    return Mesh(devs.reshape(sizes), tuple(abstract.axis_names), **kw)


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
        self._slabs: dict[tuple[int, int], dict[int, np.ndarray]] = {}
        self._done: dict[tuple[int, Kind], dict[str, Part]] = {}
        self._lock = threading.Lock()

    def put(self, j: int, step: Any, pos: Any, slab: Any) -> None:
        """(device callback) the slab of spread tensor ``j`` starting at global index
        ``pos[0]`` along its axis, at ``step``."""
        s, start = int(np.asarray(step)), int(np.asarray(pos).reshape(-1)[0])
        copy = np.array(slab, copy=True)  # the callback's buffer lives only for the call
        self.run(lambda: self._add(j, s, start, copy))

    def _add(self, j: int, step: int, start: int, slab: np.ndarray) -> None:
        sp = self.splits[j]
        with self._lock:
            got = self._slabs.setdefault((step, j), {})
            got[start] = slab
            if len(got) < sp.devices.local:
                return
            del self._slabs[(step, j)]
            data = np.concatenate([got[k] for k in sorted(got)], axis=sp.axis)
            if data.shape != sp.block or min(got) != sp.offset[sp.axis]:
                raise RuntimeError(
                    f"traintape.jax: step {step}: the devices of process "
                    f"{sp.devices.process} hold {self.names[j]!r} rows from {min(got)} "
                    f"of shape {data.shape}, expected {sp.block} from {sp.offset[sp.axis]}"
                )
            kind = self.kinds[j]
            parts = self._done.setdefault((step, kind), {})
            parts[self.names[j]] = Part(data, sp.offset, sp.shape, sp.block, sp.dtype, True)
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
