"""PyTorch adapter: ``watch`` (hooks → Recorder), canonical names/layouts, weight loading.

Modules: :mod:`.names` (where torch names and layouts are normalised), :mod:`.stats`
(on-device batched raw rows), :mod:`.watch` (hooks and the handle), :mod:`.opt_state`
(optimizer state under optax names), :mod:`.host` (host copies),
:mod:`.canonical` (``to_canonical``/``from_canonical``), :mod:`.forward` (a module as a
forward function for the analyses).
"""

from traintape.adapters.torch import dist as _dist  # noqa: F401  (registers the detector)
from traintape.adapters.torch.canonical import from_canonical, to_canonical
from traintape.adapters.torch.forward import TorchForward, as_forward
from traintape.adapters.torch.names import ModelLayout, ParamEntry, model_layout
from traintape.adapters.torch.stats import stat_vectors
from traintape.adapters.torch.watch import WatchHandle, watch

__all__ = [
    "ModelLayout",
    "ParamEntry",
    "TorchForward",
    "WatchHandle",
    "as_forward",
    "from_canonical",
    "model_layout",
    "stat_vectors",
    "to_canonical",
    "watch",
]
