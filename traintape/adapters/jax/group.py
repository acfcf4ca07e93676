"""The JAX job's processes as a :class:`traintape.core.group.ProcessGroup`.

Found by :func:`detect` once ``jax.distributed.initialize`` has run (registered with core
when :mod:`traintape.adapters.jax` is imported). Under ``jax.distributed`` the adapter
needs no merge of its own: statistics are reduced inside the jitted step over the global
(sharded) arrays, so XLA's partitioner computes them over every shard exactly once, and
the ordered host callback that carries them runs on the process that owns device 0 —
process 0, the store's writer. The other processes' recorders receive only their
blocks of snapshots (:mod:`.blocks`).
"""

from __future__ import annotations

import jax
import numpy as np

from traintape.core.group import register_detector


class JaxProcesses:
    """``jax.process_index()`` / ``jax.process_count()``; ``all_gather`` through
    ``multihost_utils.process_allgather`` (a jitted collective: training thread only)."""

    @property
    def index(self) -> int:
        return int(jax.process_index())

    @property
    def count(self) -> int:
        return int(jax.process_count())

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        x = np.asarray(x, dtype=np.float64)
        # float64 survives only with x64 enabled: ship the bytes as uint32 words
        words = np.ascontiguousarray(x).view(np.uint32)
        out = np.asarray(multihost_utils.process_allgather(words, tiled=False))
        return np.ascontiguousarray(out).view(np.float64).reshape(self.count, *x.shape)

    def __repr__(self) -> str:
        return f"JaxProcesses(index={self.index}, count={self.count})"


def detect() -> JaxProcesses | None:
    """The job's group if ``jax.distributed`` is initialised (never initialises it)."""
    if not jax.distributed.is_initialized():
        return None
    return JaxProcesses()


register_detector(detect)
