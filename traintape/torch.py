"""``traintape.torch`` — the PyTorch adapter (imports torch).

Quick start::

    import traintape, traintape.torch

    with traintape.Recorder("runs/mlp") as rec, traintape.torch.watch(model, rec, optimizer=opt):
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()          # step hooks record param, grad, update, activations

See :mod:`traintape.adapters.torch` for names, layouts and step semantics.
"""

from traintape.adapters.torch import (
    ModelLayout,
    TorchForward,
    WatchHandle,
    as_forward,
    from_canonical,
    model_layout,
    stat_vectors,
    to_canonical,
    watch,
)

__all__ = [
    "ModelLayout",
    "TorchForward",
    "WatchHandle",
    "as_forward",
    "from_canonical",
    "model_layout",
    "stat_vectors",
    "to_canonical",
    "watch",
]
