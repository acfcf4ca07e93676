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
from traintape.adapters.jax.equinox import filter_value_and_grad

__all__ = [
    "WatchState",
    "filter_value_and_grad",
    "named_leaves",
    "nnx_value_and_grad",
    "raw_matrix",
    "stat_matrix",
    "stat_vector",
    "value_and_grad",
    "watch",
]
