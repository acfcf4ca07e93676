"""TensorFlow / Keras 3 adapter (see :mod:`traintape.tf` and :mod:`traintape.keras`).

Attributes are imported on first use: the Keras callback, names and canonical weights
need only Keras (any backend); the tape, the optimizer observer and the TF stat ops
import TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Callback": "callback",
    "GradientTape": "tape",
    "from_canonical": "canonical",
    "to_canonical": "canonical",
    "model_entries": "names",
    "observe_optimizer": "optimizer",
    "unobserve_optimizer": "optimizer",
    "stat_matrix": "stats",
    "stat_vector": "stats",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
