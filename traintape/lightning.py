"""``traintape.lightning`` — the Lightning integration (imports lightning).

Quick start::

    import traintape, traintape.lightning

    with traintape.Recorder("runs/pl") as rec:
        trainer = lightning.Trainer(callbacks=[traintape.lightning.Callback(rec)])
        trainer.fit(module, loader)

See :mod:`traintape.adapters.torch.lightning` for step semantics and metrics.
"""

from traintape.adapters.torch.lightning import Callback

__all__ = ["Callback"]
