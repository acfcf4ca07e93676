"""Keras 3 on the TensorFlow backend: the batch loss of Keras's compiled train step.

On TensorFlow the tensors are recorded by the optimizer observer
(:mod:`~traintape.adapters.tf.optimizer`) and the activation stash
(:mod:`~traintape.adapters.tf.activations`). :class:`TfStep` adds the metric
``batch_loss``: the loss Keras hands its loss tracker (before averaging it into the
epoch's running mean ``loss``), logged from inside the step at the optimizer's step
(``iterations − 1`` after the update, + the start offset) by one ``tf.numpy_function``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorflow as tf

from traintape.core.recorder import Recorder

from .keras_hooks import BATCH_LOSS, StepContext, StepHooks

_log = logging.getLogger("traintape")


class TfStep(StepHooks):
    """Logs ``batch_loss`` of each captured step (see module)."""

    def __init__(self, recorder: Recorder, model: Any, offset: int) -> None:
        super().__init__(recorder, model, None)
        self.offset = offset

    def finish(self, ctx: StepContext, args: tuple[Any, ...], out: Any) -> Any:
        if ctx.loss is None:
            return out
        rec = self.recorder
        it = self.model.optimizer.iterations

        def host(step: Any, loss: Any) -> np.int64:
            s = int(step)
            try:
                if rec.enabled and rec.policy.captures(s):
                    rec.log(s, {BATCH_LOSS: float(loss)})
            except Exception:
                if rec.strict:
                    raise
                _log.exception("traintape.keras: logging %s at step %s failed", BATCH_LOSS, s)
            return np.int64(0)

        if tf.executing_eagerly():
            host(int(it.numpy()) - 1 + self.offset, float(np.asarray(ctx.loss)))
            return out
        with tf.control_dependencies(tf.nest.flatten(out)):
            step = tf.cast(it.value, tf.int64) - 1 + self.offset
        tf.numpy_function(host, [step, tf.cast(ctx.loss, tf.float64)], tf.int64, stateful=True)
        return out
