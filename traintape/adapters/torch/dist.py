"""torch.distributed for the torch adapter: the job's processes and DTensor shards.

- :class:`TorchProcesses`: the initialised default process group as a
  :class:`traintape.core.group.ProcessGroup` (registered as a detector, so
  ``Recorder(url)`` finds it on every rank).
- DTensor helpers: FSDP2 (``fully_shard``) turns parameters, gradients and optimizer
  state into DTensors. Statistics are reduced over each rank's **local shard**
  (:func:`local`) and merged over ranks by core (:func:`traintape.core.group.merge_over`);
  a shard replicated on several ranks (a ``Replicate`` mesh dimension, HSDP) counts once
  (:func:`counts_here`). Full snapshots are assembled with ``full_tensor()`` (a
  collective every rank makes at the same point, in the training thread).
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np
import torch
import torch.distributed as dist

from traintape.core.group import register_detector
from traintape.core.writer import Part

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = Partial = Replicate = None  # type: ignore[assignment,misc]


class TorchProcesses:
    """The default process group: ``all_gather`` of small host arrays as tensors (CPU on
    gloo, the current CUDA device on NCCL)."""

    @property
    def index(self) -> int:
        return dist.get_rank()

    @property
    def count(self) -> int:
        return dist.get_world_size()

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        t = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float64))
        if dist.get_backend() == "nccl":
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        out = [torch.empty_like(t) for _ in range(self.count)]
        dist.all_gather(out, t)
        return np.stack([o.cpu().numpy() for o in out])

    def __repr__(self) -> str:
        return f"TorchProcesses(index={self.index}, count={self.count})"


def detect() -> TorchProcesses | None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchProcesses()
    return None


register_detector(detect)


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


@overload
def local(t: torch.Tensor) -> torch.Tensor: ...
@overload
def local(t: None) -> None: ...
@overload
def local(t: torch.Tensor | None) -> torch.Tensor | None: ...
def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The part of ``t`` this rank holds (``t`` itself unless a DTensor)."""
    if t is None or not is_dtensor(t):
        return t
    d: Any = t
    if any(isinstance(p, Partial) for p in d.placements):
        raise ValueError(
            f"traintape.torch: a DTensor with Partial placement {d.placements} holds "
            f"unreduced partial sums; its statistics would be wrong"
        )
    return d.to_local()


@overload
def full(t: torch.Tensor) -> torch.Tensor: ...
@overload
def full(t: torch.Tensor | None) -> torch.Tensor | None: ...
def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor (``full_tensor()`` of a DTensor: a collective on every rank)."""
    d: Any = t
    return d.full_tensor() if t is not None and is_dtensor(t) else t


def counts_here(t: torch.Tensor | None, rank: int) -> bool:
    """Whether this rank's statistics of ``t`` enter the global merge: a DTensor's shard
    counts on the ranks at coordinate 0 of every ``Replicate`` mesh dimension; a plain
    tensor is the same on every rank (DDP, replicated) and counts on rank 0 only."""
    if t is None or not is_dtensor(t):
        return rank == 0
    d: Any = t
    coord = d.device_mesh.get_coordinate()
    if coord is None:  # this rank holds no part of t
        return False
    return all(c == 0 for c, p in zip(coord, d.placements, strict=True) if isinstance(p, Replicate))


def shard_start(t: torch.Tensor | None) -> tuple[int, ...] | None:
    """Source-layout index at which the part of ``t`` this rank holds (:func:`local`)
    starts: zeros for a plain tensor; for a DTensor sharded in plain blocks
    (``Shard(d)``/``Replicate()``, ``torch.chunk`` blocks as in FSDP2) its block's
    offset; None for other placements (strided/nested shards: the caller reduces the
    whole tensor instead). Needed for the ``sig`` statistic, a function of the canonical
    index of each element (:func:`traintape.schema.stats.index_map`)."""
    from torch.distributed.tensor import Shard

    if t is None or not is_dtensor(t):
        return None if t is None else (0,) * t.ndim
    dt: Any = t
    shape = tuple(dt.shape)
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    offset = [0] * len(shape)
    seen: set[int] = set()
    for i, p in enumerate(dt.placements):
        if isinstance(p, Shard) and type(p) is Shard and p.dim not in seen:
            seen.add(p.dim)
            if coord is not None:
                block = -(-shape[p.dim] // mesh.size(i))
                offset[p.dim] = min(coord[i] * block, shape[p.dim])
        elif not isinstance(p, Replicate):
            return None
    return tuple(offset)


def snapshot_part(t: torch.Tensor, permutation: tuple[int, ...] | None, rank: int) -> Part | None:
    """This rank's block of DTensor ``t`` for a snapshot (canonical layout: source axes
    permuted by ``permutation``), or None when ``t`` is not a DTensor sharded in plain
    blocks (then the caller assembles the whole tensor with :func:`full`).

    Plain blocks: every mesh dimension is ``Shard(d)`` or ``Replicate()``, no tensor
    dimension is sharded by two mesh dimensions. Shard ``d`` over ``n`` ranks splits like
    ``torch.chunk`` (FSDP2): blocks of ``ceil(size/n)`` rows, the last ones shorter or
    empty — the snapshot array is sharded by that block so no two ranks write one shard.
    A block replicated over ranks is written by the ranks at coordinate 0 of the
    ``Replicate`` dimensions only. Decided from the global shape and placements, so every
    rank decides alike.
    """
    from torch.distributed.tensor import Shard

    from traintape.adapters.torch.host import host_copy, numpy_dtype_name

    if not is_dtensor(t):
        return None
    dt: Any = t
    sharded: dict[int, int] = {}
    for i, p in enumerate(dt.placements):
        if isinstance(p, Shard) and type(p) is Shard and p.dim not in sharded:
            sharded[p.dim] = i
        elif not isinstance(p, Replicate):
            return None  # strided/nested shards, Partial: assemble the whole tensor
    shape = tuple(dt.shape)
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    block, offset = list(shape), [0] * len(shape)
    for d, i in sharded.items():
        n = mesh.size(i)
        block[d] = -(-shape[d] // n)
        if coord is not None:
            offset[d] = min(coord[i] * block[d], shape[d])
    loc = dt.to_local().detach()
    want = [min(b, s - o) for b, s, o in zip(block, shape, offset, strict=True)]
    if coord is None or list(loc.shape) != want:
        raise ValueError(
            f"traintape.torch: local shard of shape {list(loc.shape)} at offset {offset} "
            f"of a {list(shape)} DTensor {dt.placements}; expected {want} (torch.chunk blocks)"
        )
    here = counts_here(t, rank) and loc.numel() > 0
    perm = permutation or tuple(range(len(shape)))
    canon = loc.permute(perm) if permutation is not None else loc
    return Part(
        data=host_copy(canon) if here else None,
        offset=tuple(offset[i] for i in perm),
        shape=tuple(shape[i] for i in perm),
        block=tuple(block[i] for i in perm),
        dtype=numpy_dtype_name(t.dtype),
    )
