"""``traintape.keras.Callback``: record a Keras 3 ``model.fit`` on any backend.

Works the same under ``KERAS_BACKEND=tensorflow``, ``jax`` and ``torch``: the same
canonical names, and per optimizer step t ``param`` (θ_t, plus BatchNorm running
statistics as they were before batch t), ``grad`` (the gradient the optimizer received,
before its ``clipnorm``/``global_clipnorm``/``clipvalue``), ``update`` (θ_{t+1} − θ_t as
applied, in the storage dtype), ``opt_state`` when the policy records it (the
optimizer's slots after the step, ``<param>/mu``...: :mod:`~traintape.adapters.tf.opt_state`)
and ``activation`` stats of every parametrised layer's output on batch t
(``<layer>/output``, channels-last as Keras computes them; stats only — snapshots come
from the ``probe`` batch on full-capture steps). Metrics per captured step: Keras's
``logs`` (``loss`` and compiled metrics are running means over the epoch), ``lr``,
``batch_loss`` (the step's own loss) and, when the optimizer clips,
``grad/clip_factor``. Step t = ``optimizer.iterations`` before the update (+ the
recorder's ``next_step`` when a fresh optimizer continues a resumed run).

How each backend is recorded (docs/keras.md):

- tensorflow: the optimizer's ``apply`` is observed (:mod:`.optimizer`) inside Keras's
  ``tf.function``; one ``tf.numpy_function`` per step carries the stats. XLA cannot
  compile it, so ``jit_compile`` is turned off during ``fit`` (with a warning when it was
  on) and restored afterwards.
- jax: the statistics are computed inside Keras's jitted train step
  (:mod:`.keras_jax`); ``jit_compile`` stays on.
- torch: the eager train step is read on the host (:mod:`.keras_torch`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from traintape.core.naming import NameMap
from traintape.core.recorder import Recorder
from traintape.schema import Kind

from .activations import ActivationCapture
from .names import model_entries
from .recording import producer, request_kinds, start_offset

_log = logging.getLogger("traintape")
TENSOR_KINDS = (Kind.PARAM, Kind.GRAD, Kind.UPDATE, Kind.OPT_STATE)


class Callback(keras.callbacks.Callback):
    """Records a ``model.fit`` run into ``recorder``.

    Args:
        recorder: the :class:`~traintape.Recorder` (not closed by the callback; it is
            flushed at the end of ``fit``).
        name_map: rename canonical names (see :mod:`traintape.core.naming`).
        activations: record activation stats of parametrised layers.
        probe: a fixed input batch; on full-capture steps the activations of the model
            run on it (``training=False``, with θ_t) are written as snapshots.
        metrics: log the scalar ``logs`` of each train batch (and ``batch_loss``).
        kinds: record exactly these kinds (of ``param``, ``grad``, ``update``,
            ``opt_state``, ``activation``), also where the recorder's policy leaves
            them out (an explicit request wins). Default: every kind the policy records.
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        name_map: NameMap = None,
        activations: bool = True,
        probe: Any = None,
        metrics: bool = True,
        kinds: Sequence[Kind | str] | None = None,
    ) -> None:
        super().__init__()
        self.recorder = recorder
        self.name_map = name_map
        self.explicit = None if kinds is None else tuple(Kind(k) for k in kinds)
        self.want_activations = (
            activations if self.explicit is None else Kind.ACTIVATION in self.explicit
        )
        self.metrics = metrics
        self.probe = probe
        self._acts: ActivationCapture | None = None
        self._hooks: Any = None
        self._backend = ""
        self._jit: Any = None
        self._next = 0  # the step the next train batch runs
        self._epoch_base = 0

    @property
    def activations(self) -> bool:
        """Whether activation stats are recorded (the option and the policy)."""
        return self.want_activations and self.recorder.policy.records_kind(Kind.ACTIVATION)

    # ---------------------------------------------------------------- lifecycle
    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model  # (JAX: syncs the variables)
        rec = self.recorder
        self._backend = backend = keras.backend.backend()
        if self.explicit is not None:
            request_kinds(rec, self.explicit, "traintape.keras.Callback")
        kinds = tuple(
            k for k in (self.explicit or TENSOR_KINDS)
            if k in TENSOR_KINDS and rec.policy.records_kind(k)
        )  # fmt: skip
        opt = model.optimizer
        iterations = int(np.asarray(keras.ops.convert_to_numpy(opt.iterations)))
        offset = start_offset(rec, iterations, "traintape.keras.Callback")
        self._next = self._epoch_base = iterations + offset
        rec.set_producer(**producer("traintape.keras"), stats_backend=_stats_backend(backend))
        model_entries(model, self.name_map)  # a name clash fails here, before training
        if self.activations:
            self._acts = ActivationCapture(rec, model, self.name_map)
            self._acts.install()
        if backend == "tensorflow":
            self._begin_tf(model, kinds, offset)
        elif backend == "jax":
            from .keras_jax import JaxStep

            self._hooks = JaxStep(rec, model, name_map=self.name_map, kinds=kinds,
                                  acts=self._acts, offset=offset, metrics=self.metrics)  # fmt: skip
            self._hooks.install()
        elif backend == "torch":
            from .keras_torch import TorchStep

            self._hooks = TorchStep(rec, model, name_map=self.name_map, kinds=kinds,
                                    acts=self._acts, offset=offset, metrics=self.metrics)  # fmt: skip
            self._hooks.install()
        else:
            raise NotImplementedError(
                f"traintape.keras.Callback: Keras backend {backend!r} is not supported "
                f"(tensorflow, jax, torch are)"
            )
        model.make_train_function(force=True)

    def _begin_tf(self, model: Any, kinds: tuple[Kind, ...], offset: int) -> None:
        import tensorflow as tf

        from .keras_tf import TfStep
        from .optimizer import observe_optimizer, observer
        from .strategy import refuse_replicas

        rec = self.recorder
        refuse_replicas("traintape.keras.Callback", getattr(model, "distribute_strategy", None))
        opt = model.optimizer
        observe_optimizer(opt, rec, model=model, name_map=self.name_map, kinds=kinds)
        obs = observer(opt)
        assert obs is not None
        obs.offset = offset
        entries = model_entries(model, self.name_map)
        with tf.init_scope():
            obs.state = [
                (e, tf.Variable(e.read(), trainable=False, name="traintape_shadow"))
                for e in entries if not e.trainable
            ]  # fmt: skip
        if self._acts is not None:
            obs.extra.append(self._acts.groups)
        if self.metrics:
            self._hooks = TfStep(rec, model, offset)
            self._hooks.install()
        self._jit = getattr(model, "jit_compile", None)
        if self._jit:
            _log.warning(
                "traintape.keras.Callback: jit_compile turned off during fit on the "
                "TensorFlow backend (the host transfer, tf.numpy_function, cannot be "
                "compiled by XLA); restored after fit. The JAX backend keeps it on."
            )
            model.jit_compile = False

    def on_train_end(self, logs: Any = None) -> None:
        model = self._model
        if self._backend == "tensorflow":
            from .optimizer import unobserve_optimizer

            unobserve_optimizer(model.optimizer)
            if self._jit:
                model.jit_compile = self._jit
            self._jit = None
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._acts is not None:
            self._acts.remove()
            self._acts = None
        model.make_train_function(force=True)
        self.recorder.flush()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch_base = self._next

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        step = self._epoch_base + batch
        if self.probe is None or self._acts is None:
            return
        if not self.recorder.snapshots(step, Kind.ACTIVATION):
            return
        _ = self.model  # JAX: the variables hold their values again (a sync)
        self._acts.run_probe(step, self.probe)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        step = self._epoch_base + batch  # the last step of this batch's execution
        self._next = step + 1
        if not self.metrics or not logs:
            return
        rec = self.recorder
        if not rec.policy.captures(step) or not rec.enabled:
            return
        vals: dict[str, float] = {}
        for k, v in logs.items():
            a = np.asarray(v)
            if a.size == 1 and a.dtype.kind in "fiu":
                vals[k] = float(a)
        if self._backend != "jax":  # JAX: the variables hold no value during fit; the
            lr = getattr(self._model.optimizer, "learning_rate", None)  # step logs lr
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                vals.setdefault("lr", float(np.asarray(keras.ops.convert_to_numpy(lr))))
        rec.log(step, vals)


def _stats_backend(backend: str) -> str:
    """``Producer.stats_backend`` of a Keras run on ``backend``."""
    if backend == "jax":
        from .keras_jax import stats_backend as jax_stats_backend

        return jax_stats_backend()
    if backend == "torch":
        from traintape.core.stats import backend as host_backend

        return host_backend()
    from .stats import stats_backend

    return stats_backend()
