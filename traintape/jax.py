"""``traintape.jax``: the JAX adapter (see :mod:`traintape.adapters.jax`)."""

from traintape.adapters.jax import (
    WatchState,
    named_leaves,
    nnx_value_and_grad,
    raw_matrix,
    stat_matrix,
    stat_vector,
    value_and_grad,
    watch,
)

__all__ = [
    "WatchState",
    "named_leaves",
    "nnx_value_and_grad",
    "raw_matrix",
    "stat_matrix",
    "stat_vector",
    "value_and_grad",
    "watch",
]
