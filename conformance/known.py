"""Known, reported adapter gaps that make conformance cells differ.

Each entry names the adapter, what differs and why; ``tests/test_conformance.py``
turns the affected cells into *strict* xfails, so fixing the adapter makes the test
XPASS (and fail) until the entry is deleted here. Keep this list empty when you can.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gap:
    frameworks: tuple[str, ...]
    models: tuple[str, ...] | None
    """None: every model."""
    dtypes: tuple[str, ...]
    reason: str
    within: bool = False
    """True: also cells between two of ``frameworks`` differ (e.g. the worker fails)."""


KERAS_FLOAT64 = Gap(
    frameworks=("keras-jax", "keras-torch"),
    models=None,
    dtypes=("float64",),
    reason="Keras 3.15's JAX and torch backends compute parts of a float64 model in "
    "float32 (measured, no traintape involved: keras.ops.tanh of a float64 array returns "
    "float32 on JAX, 8.9e-8 from np.tanh; keras.ops.matmul of float64 arrays returns "
    "float32 on torch, 8.6e-7 from numpy; the float64 mlp's forward pass is 9e-8 from "
    "numpy's on both, 4e-16 on the TensorFlow backend), so their float64 runs are "
    "float32-accurate; every float32 cell of both columns is identical",
    within=True,
)
"""A Keras backend's numerics, not an adapter's: the stores hold what Keras computed."""

KNOWN_GAPS: tuple[Gap, ...] = (KERAS_FLOAT64,)
"""Only the Keras columns' float64 cells (:data:`KERAS_FLOAT64`, Keras's own float64
numerics on JAX/torch). (The last adapter entry, equinox ``gru``, went when the equinox
GRU was written out with PyTorch's four parameters, as the Flax ones are:
``eqx.nn.GRUCell``'s single r/z bias cannot hold torch's two; conformance/README.md.)"""


def known_gap(dtype: str, model: str, a: str, b: str) -> str | None:
    """The reason cell (dtype[+optimizer], model, a ↔ b) is expected to differ, or None."""
    dtype = dtype.partition("+")[0]
    for g in KNOWN_GAPS:
        if dtype not in g.dtypes or (g.models is not None and model not in g.models):
            continue
        ina, inb = a in g.frameworks, b in g.frameworks
        if (ina != inb) or (g.within and ina and inb):
            return g.reason
    return None
