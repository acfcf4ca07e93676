"""JAX adapter (reference adapter): gradients, Flax Linen/NNX activations, optax updates.

Public API (re-exported as ``traintape.jax``):

- :func:`value_and_grad` — drop-in for ``jax.value_and_grad`` recording param/grad
  (+ Linen activations);
- :func:`nnx_value_and_grad` — the same for ``flax.nnx.value_and_grad``;
- :func:`watch` — optax transformation recording update (+ grad, param, opt_state);
- :func:`raw_matrix` — raw rows of the stat algebra inside a computation (XLA path);
  :func:`stat_matrix` / :func:`stat_vector` — stat vectors of concrete arrays;
- :func:`named_leaves` — the canonical names a pytree's leaves get.
"""

from traintape.adapters.jax import group as _group  # noqa: F401  (registers the detector)
from traintape.adapters.jax.grad import nnx_value_and_grad, value_and_grad
from traintape.adapters.jax.names import named_leaves
from traintape.adapters.jax.optax import WatchState, watch
from traintape.adapters.jax.stats import raw_matrix, stat_matrix, stat_vector

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
