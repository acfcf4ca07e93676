"""TensorFlow / Keras 3 adapter (see :mod:`traintape.tf` and :mod:`traintape.keras`)."""

from .callback import Callback
from .canonical import from_canonical, to_canonical
from .names import model_entries
from .optimizer import observe_optimizer, unobserve_optimizer
from .stats import stat_matrix, stat_vector
from .tape import GradientTape

__all__ = [
    "Callback",
    "GradientTape",
    "from_canonical",
    "model_entries",
    "observe_optimizer",
    "stat_matrix",
    "stat_vector",
    "to_canonical",
    "unobserve_optimizer",
]
