"""Keras 3 entry points: ``model.fit(..., callbacks=[traintape.keras.Callback(rec)])``.

Any Keras backend (``KERAS_BACKEND=tensorflow|jax|torch``); see
:class:`traintape.adapters.tf.callback.Callback` and docs/keras.md.
"""

from traintape.adapters.tf.callback import Callback
from traintape.adapters.tf.canonical import from_canonical, to_canonical
from traintape.adapters.tf.names import model_entries

__all__ = ["Callback", "from_canonical", "model_entries", "to_canonical"]
