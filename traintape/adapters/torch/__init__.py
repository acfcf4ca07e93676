"""PyTorch adapter: ``watch`` (hooks → Recorder), canonical names/layouts, weight loading.

Modules: :mod:`.names` (where torch names and layouts are normalised), :mod:`.stats`
(on-device batched stat vectors), :mod:`.watch` (hooks and the handle),
:mod:`.canonical` (``to_canonical``/``from_canonical``).
"""

from traintape.adapters.torch.canonical import from_canonical, to_canonical
from traintape.adapters.torch.names import ModelLayout, ParamEntry, model_layout
from traintape.adapters.torch.stats import stat_vectors
from traintape.adapters.torch.watch import WatchHandle, watch

__all__ = [
    "ModelLayout",
    "ParamEntry",
    "WatchHandle",
    "from_canonical",
    "model_layout",
    "stat_vectors",
    "to_canonical",
    "watch",
]
