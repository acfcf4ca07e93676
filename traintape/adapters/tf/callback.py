"""``traintape.keras.Callback``: record a Keras 3 ``model.fit``.

Keras's compiled train step computes gradients internally, so the callback observes
the model's optimizer (:func:`~traintape.adapters.tf.optimizer.observe_optimizer`):
when the train step applies gradients it records, in one host transfer, ``param``
(θ_t, plus BatchNorm running statistics as they were before batch t), ``grad``,
``update`` (θ_{t+1} − θ_t), ``opt_state`` when the policy records it (the optimizer's
slots after the step, ``<param>/mu``, ``<param>/nu``, ``<param>/trace``...:
:mod:`~traintape.adapters.tf.opt_state`) and ``activation`` stats of every parametrised
layer's output on batch t (``<layer>/output``, channels-last as Keras computes them;
stats only, no snapshots of training batches). ``logs`` metrics are logged per step
(``loss``, compiled metrics — Keras reports running means over the epoch — and
``lr``). Step t = ``optimizer.iterations`` before the update. Works for Sequential,
Functional and subclassed models; ``steps_per_execution > 1`` is fine for tensors
(metrics are logged at the batch-end callbacks Keras makes).
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from traintape.core.naming import NameMap
from traintape.core.recorder import Recorder
from traintape.schema import Kind

from .activations import ActivationCapture
from .names import model_entries
from .optimizer import observe_optimizer, observer, unobserve_optimizer
from .stats import stats_backend
from .strategy import refuse_replicas


class Callback(keras.callbacks.Callback):
    """Records a ``model.fit`` run into ``recorder``.

    Args:
        recorder: the :class:`~traintape.Recorder` (not closed by the callback; it is
            flushed at the end of ``fit``).
        name_map: rename canonical names (see :mod:`traintape.core.naming`).
        activations: record activation stats of parametrised layers.
        probe: a fixed input batch; on full-capture steps the activations of the model
            run on it (``training=False``, with θ_t) are written as snapshots.
        metrics: log the scalar ``logs`` of each train batch.

    The host transfer is a ``tf.numpy_function``, which XLA cannot compile: the callback
    sets ``model.jit_compile = False`` (Keras turns XLA on by default on GPUs) and
    rebuilds the train function at the start and end of ``fit`` so no stale trace
    keeps recording.
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        name_map: NameMap = None,
        activations: bool = True,
        probe: Any = None,
        metrics: bool = True,
    ) -> None:
        super().__init__()
        self.recorder = recorder
        self.name_map = name_map
        self.activations = activations and recorder.policy.records_kind(Kind.ACTIVATION)
        self.metrics = metrics
        self.probe = probe
        self._acts: ActivationCapture | None = None

    # ---------------------------------------------------------------- lifecycle
    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        rec = self.recorder
        refuse_replicas("traintape.keras.Callback", getattr(model, "distribute_strategy", None))
        rec.set_producer(framework="tensorflow", framework_version=tf.__version__,
                         adapter="traintape.keras", stats_backend=stats_backend())  # fmt: skip
        opt = model.optimizer
        observe_optimizer(opt, rec, model=model, name_map=self.name_map,
                          kinds=(Kind.PARAM, Kind.GRAD, Kind.UPDATE, Kind.OPT_STATE))  # fmt: skip
        obs = observer(opt)
        assert obs is not None
        entries = model_entries(model, self.name_map)
        with tf.init_scope():
            obs.state = [
                (e, tf.Variable(e.read(), trainable=False, name="traintape_shadow"))
                for e in entries if not e.trainable
            ]  # fmt: skip
        if self.activations:
            self._acts = ActivationCapture(rec, model, self.name_map)
            self._acts.install()
            obs.extra.append(self._acts.groups)
        if getattr(model, "jit_compile", False):
            model.jit_compile = False
        model.make_train_function(force=True)

    def on_train_end(self, logs: Any = None) -> None:
        unobserve_optimizer(self.model.optimizer)
        if self._acts is not None:
            self._acts.remove()
            self._acts = None
        self.model.make_train_function(force=True)
        self.recorder.flush()

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.probe is None or self._acts is None:
            return
        self._acts.run_probe(int(self.model.optimizer.iterations.numpy()), self.probe)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.metrics or not logs:
            return
        step = int(self.model.optimizer.iterations.numpy()) - 1
        if step < 0 or not self.recorder.policy.captures(step) or not self.recorder.enabled:
            return
        vals: dict[str, float] = {}
        for k, v in logs.items():
            a = np.asarray(v)
            if a.size == 1 and a.dtype.kind in "fiu":
                vals[k] = float(a)
        lr = getattr(self.model.optimizer, "learning_rate", None)
        with contextlib.suppress(TypeError, ValueError):
            vals.setdefault("lr", float(np.asarray(lr)))
        self.recorder.log(step, vals)
