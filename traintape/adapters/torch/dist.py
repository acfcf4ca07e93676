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

import numpy as np
import torch
import torch.distributed as dist

from traintape.core.group import register_detector

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


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The part of ``t`` this rank holds (``t`` itself unless a DTensor)."""
    if t is None or not is_dtensor(t):
        return t
    if any(isinstance(p, Partial) for p in t.placements):
        raise ValueError(
            f"traintape.torch: a DTensor with Partial placement {t.placements} holds "
            f"unreduced partial sums; its statistics would be wrong"
        )
    return t.to_local()


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor (``full_tensor()`` of a DTensor: a collective on every rank)."""
    return t.full_tensor() if t is not None and is_dtensor(t) else t


def counts_here(t: torch.Tensor | None, rank: int) -> bool:
    """Whether this rank's statistics of ``t`` enter the global merge: a DTensor's shard
    counts on the ranks at coordinate 0 of every ``Replicate`` mesh dimension; a plain
    tensor is the same on every rank (DDP, replicated) and counts on rank 0 only."""
    if t is None or not is_dtensor(t):
        return rank == 0
    coord = t.device_mesh.get_coordinate()
    if coord is None:  # this rank holds no part of t
        return False
    return all(c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate))
