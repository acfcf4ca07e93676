"""Keras 3 entry points: ``model.fit(..., callbacks=[traintape.keras.Callback(rec)])``.

See :class:`traintape.adapters.tf.callback.Callback`.
"""

from traintape.adapters.tf import Callback, from_canonical, model_entries, to_canonical

__all__ = ["Callback", "from_canonical", "model_entries", "to_canonical"]
