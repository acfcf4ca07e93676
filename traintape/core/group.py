"""The processes of one training job, as core sees them (framework-free).

Every process of a multi-process job runs the same code with the same store URL. Core
needs only four things from the job's process group, which an adapter supplies from its
framework (``traintape.jax``: ``jax.distributed``; ``traintape.torch``:
``torch.distributed``) or the user passes explicitly (``Recorder(process_group=...)``):

- ``index`` / ``count``: this process's rank and the number of processes;
- ``all_gather(x)``: every process's small float64 host array ``x`` (same shape on every
  process), stacked ``[count, *x.shape]`` in rank order — called in the training thread,
  at the same point on every process, never from a background thread.

Process 0 (the *leader*) owns the store: the writer claim, the manifest, the stats and
metrics arrays and the commit mark. The adapters merge every statistic over processes
(:func:`merge_over`) before it reaches the recorder, so the leader's rows are the global
ones. Snapshots of tensors sharded in plain blocks (torch FSDP2; JAX tensors spread
over the job's devices, :mod:`traintape.adapters.jax.blocks`) are written by every
process for the block it holds (:class:`traintape.core.writer.Part`), and the leader
commits them once each process confirmed its blocks; other snapshots reach the leader
whole (JAX: XLA moves them to the device of the host callback; torch: replicated, or
``DTensor.full_tensor()``) and only the leader copies them to the host. See
``docs/store-format.md`` ("Multi-process jobs").

Adapters register a *detector* (:func:`register_detector`) so that ``Recorder`` finds
the job's group by itself when the framework's distributed runtime is initialised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class ProcessGroup(Protocol):
    """What core needs from a job's processes (see the module docstring)."""

    @property
    def index(self) -> int:
        """This process's rank, 0 ≤ index < count."""
        ...

    @property
    def count(self) -> int:
        """Number of processes in the job."""
        ...

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """``[count, *x.shape]`` float64: every process's ``x``, in rank order."""
        ...


class SingleProcess:
    """The group of a job with one process."""

    index = 0
    count = 1

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)[None]

    def __repr__(self) -> str:
        return "SingleProcess()"


Detector = Callable[[], "ProcessGroup | None"]
_DETECTORS: list[Detector] = []


def register_detector(detector: Detector) -> None:
    """Register ``detector() -> ProcessGroup | None`` (adapters call this on import).

    A detector returns the group of an initialised multi-process job of its framework,
    else None; it must not initialise anything itself."""
    if detector not in _DETECTORS:
        _DETECTORS.append(detector)


def detect() -> ProcessGroup:
    """The job's process group: the first registered detector that finds a job of more
    than one process, else :class:`SingleProcess`."""
    for d in _DETECTORS:
        g = d()
        if g is not None and g.count > 1:
            return g
    return SingleProcess()


def check_group(group: object) -> ProcessGroup:
    """``group`` if it is a usable :class:`ProcessGroup`, else a ``TypeError`` naming what
    is missing or wrong."""
    missing = [a for a in ("index", "count", "all_gather") if not hasattr(group, a)]
    if missing:
        raise TypeError(
            f"process_group {group!r} lacks {missing}; it needs index, count and "
            f"all_gather(x) (see traintape.core.group.ProcessGroup)"
        )
    g: ProcessGroup = group  # type: ignore[assignment]
    if not (isinstance(g.count, int) and g.count >= 1 and 0 <= g.index < g.count):
        raise TypeError(f"process_group {group!r}: index {g.index} / count {g.count} invalid")
    return g


def merge_over(group: ProcessGroup, raw: np.ndarray, counts_here: np.ndarray) -> np.ndarray:
    """Raw rows ``[n, N_RAW]`` merged over the processes of ``group``.

    Every process passes its rows of the same ``n`` tensors (same order) and
    ``counts_here [n]`` bool: whether its row of each tensor enters the global merge (a
    shard it holds, its part of the batch: True; a copy that another process counts, a
    replicated tensor on a process other than 0: False). Rows that do not count are
    replaced by empty rows before one :meth:`ProcessGroup.all_gather`; the result,
    identical on every process, is :func:`traintape.schema.stats.merge_all` over processes
    in rank order. A single process returns ``raw`` unchanged.
    """
    if group.count == 1:
        return raw
    from traintape.schema.stats import empty_raw, merge_all

    raw = np.asarray(raw, dtype=np.float64)
    mask = np.asarray(counts_here, dtype=bool)
    if mask.shape != raw.shape[:1]:
        raise ValueError(f"counts_here has shape {mask.shape}, raw rows {raw.shape}")
    mine = np.where(mask[:, None], raw, empty_raw(len(raw)))
    return merge_all(group.all_gather(mine))
