"""``traintape.transformers`` — the Hugging Face Trainer integration (imports transformers).

Quick start::

    import traintape, traintape.transformers

    with traintape.Recorder("runs/hf") as rec:
        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[traintape.transformers.Callback(rec)])
        trainer.train()

See :mod:`traintape.adapters.torch.hf` for step semantics and metrics.
"""

from traintape.adapters.torch.hf import Callback

__all__ = ["Callback"]
