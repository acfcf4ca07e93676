"""tf.distribute strategies the TF/Keras adapter supports: one replica.

Under a strategy with several replicas in sync (``MirroredStrategy`` over 2 devices, ...)
each replica computes its own gradients and activations, which the adapter would record
as if they were the step's (per-replica gradients before aggregation, one replica's part
of the batch; measured: gradient l2 off by up to 670x against the single-device run). Until
per-replica statistics are merged (:func:`traintape.schema.stats.merge`, as the torch and
JAX adapters do over processes), such a strategy is refused before training starts.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def refuse_replicas(owner: str, strategy: Any = None) -> None:
    """Raise ``NotImplementedError`` naming the strategy if it has more than one replica
    in sync (``strategy`` default: the current one)."""
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    n = int(getattr(strategy, "num_replicas_in_sync", 1))
    if n > 1:
        raise NotImplementedError(
            f"{owner}: {type(strategy).__name__} with {n} replicas in sync is not supported "
            f"(each replica's gradients and activations would be recorded as the step's, "
            f"before aggregation). Supported: the default strategy / one replica. For "
            f"multi-device training record with traintape.jax (jax.distributed, sharded "
            f"arrays) or traintape.torch (DDP, FSDP2)."
        )
