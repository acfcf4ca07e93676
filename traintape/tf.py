"""TensorFlow entry points: ``traintape.tf.GradientTape(recorder, ...)`` for custom loops.

Quick start::

    rec = traintape.Recorder("runs/tf")
    with traintape.tf.GradientTape(rec, model=model, optimizer=opt) as tape:
        loss = loss_fn(model(x, training=True), y)
    grads = tape.gradient(loss, model.trainable_variables)   # records param + grad
    opt.apply_gradients(zip(grads, model.trainable_variables))  # records update

Works eagerly and inside ``tf.function``. See :mod:`traintape.adapters.tf`.
"""

from traintape.adapters.tf import (
    GradientTape,
    from_canonical,
    model_entries,
    observe_optimizer,
    stat_matrix,
    stat_vector,
    to_canonical,
    unobserve_optimizer,
)

__all__ = [
    "GradientTape",
    "from_canonical",
    "model_entries",
    "observe_optimizer",
    "stat_matrix",
    "stat_vector",
    "to_canonical",
    "unobserve_optimizer",
]
