"""``traintape.keras.Callback``: record a Keras 3 ``model.fit``.

Keras's compiled train step computes gradients internally, so the callback observes
the model's optimizer (:func:`~traintape.adapters.tf.optimizer.observe_optimizer`):
when the train step applies gradients it records, in one host transfer, ``param``
(θ_t, plus BatchNorm running statistics as they were before batch t), ``grad``,
``update`` (θ_{t+1} − θ_t) and ``activation`` stats of every parametrised layer's
output on batch t (``<layer>/output``, channels-last as Keras computes them; stats
only, no snapshots of training batches). ``logs`` metrics are logged per step
(``loss``, compiled metrics — Keras reports running means over the epoch — and
``lr``). Step t = ``optimizer.iterations`` before the update. Works for Sequential,
Functional and subclassed models; ``steps_per_execution > 1`` is fine for tensors
(metrics are logged at the batch-end callbacks Keras makes).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from traintape.core.naming import NameMap, canonical_name
from traintape.core.recorder import Recorder
from traintape.schema import Kind
from traintape.schema.names import split_name

from .canonical import activation_spec
from .capture import Group
from .names import layer_paths, model_entries
from .optimizer import observe_optimizer, observer, unobserve_optimizer


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
        self._wrapped: list[Any] = []
        self._stash: dict[str, tuple[str, str | None, Any]] = {}
        self.probe = probe
        self._probing = False
        self._probe_out: dict[str, np.ndarray] = {}
        self._probe_snaps: dict[int, dict[str, np.ndarray]] = {}

    # ---------------------------------------------------------------- lifecycle
    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        rec = self.recorder
        rec.set_producer(framework="tensorflow", framework_version=tf.__version__,
                         adapter="traintape.keras")  # fmt: skip
        opt = model.optimizer
        observe_optimizer(opt, rec, model=model, name_map=self.name_map,
                          kinds=(Kind.PARAM, Kind.GRAD, Kind.UPDATE))  # fmt: skip
        obs = observer(opt)
        assert obs is not None
        entries = model_entries(model, self.name_map)
        with tf.init_scope():
            obs.state = [
                (e, tf.Variable(e.read(), trainable=False, name="traintape_shadow"))
                for e in entries if not e.trainable
            ]  # fmt: skip
        if self.activations:
            owners = {e.layer for e in entries}
            for path, layer in layer_paths(model):
                if not path:
                    continue
                layer_name = canonical_name(path, None)
                name = canonical_name([*path, "output"], self.name_map)
                if isinstance(layer, keras.layers.MultiHeadAttention):
                    # its tensors live on the q/k/v/o sub-layers; the output is the layer's
                    self._wrap(layer, name, "attention")
                elif layer_name in owners or split_name(name)[0] in owners:
                    kind = next((e.layer_kind for e in entries if e.layer == layer_name), None)
                    self._wrap(layer, name, kind)
            obs.extra.append(self._activation_groups)
        if getattr(model, "jit_compile", False):
            model.jit_compile = False
        model.make_train_function(force=True)

    def on_train_end(self, logs: Any = None) -> None:
        unobserve_optimizer(self.model.optimizer)
        for layer in self._wrapped:
            with contextlib.suppress(AttributeError):
                object.__delattr__(layer, "call")
        self._wrapped.clear()
        self._stash.clear()
        self._probe_snaps.clear()
        self.model.make_train_function(force=True)
        self.recorder.flush()

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.probe is None or not self._wrapped:
            return
        step = int(self.model.optimizer.iterations.numpy())
        if not self.recorder.policy.snapshots(step, Kind.ACTIVATION):
            return
        self._probing = True
        self._probe_out = {}
        try:
            self.model(self.probe, training=False)
        finally:
            self._probing = False
        self._probe_snaps = {step: self._probe_out}

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

    # ---------------------------------------------------------------- activations
    def _wrap(self, layer: Any, name: str, kind: str | None) -> None:
        orig = layer.call
        stash = self._stash

        @functools.wraps(orig)
        def call(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            if self._probing:
                t = out[0] if isinstance(out, (list, tuple)) else out
                self._probe_out[name] = np.asarray(t)
                return out
            ctx = layer._get_call_context() if hasattr(layer, "_get_call_context") else None
            training = getattr(ctx, "training", None) if ctx is not None else None
            if training is None:
                training = kwargs.get("training")
            if training:
                t = out[0] if isinstance(out, (list, tuple)) else out
                if isinstance(t, tf.Tensor):
                    old = stash.get(name)
                    if old is not None and _graph_of(old[2]) is not _graph_of(t):
                        del stash[name]  # left from another trace: re-enter in call order
                    stash[name] = (split_name(name)[0], kind, t)
            return out

        object.__setattr__(layer, "call", call)
        self._wrapped.append(layer)

    def _activation_groups(self) -> list[Group]:
        """The activation group of the train step being traced (or run eagerly).

        The stash is in layer call order (outputs enter it as the layers return), so
        the specs are declared in forward order (the recorder keeps it as
        ``manifest.forward_order``).
        """
        rec = self.recorder
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        items = []
        for name, (layer, kind, t) in self._stash.items():
            if _graph_of(t) is graph and rec.policy.selects(name):
                items.append((name, layer, kind, t))
        self._stash.clear()
        if not items:
            return []
        rec.declare([activation_spec(n, k, t.dtype.name, t.shape.as_list())
                     for n, _, k, t in items])  # fmt: skip
        tensors = [t for *_, t in items]
        names = [n for n, *_ in items]
        return [Group(Kind.ACTIVATION, names, lambda: tensors, snapshot=False,
                      host_snapshots=self._probe_snapshots)]  # fmt: skip

    def _probe_snapshots(self, step: int) -> dict[str, np.ndarray] | None:
        snaps = self._probe_snaps.pop(step, None)
        if snaps is None:
            return None
        names = set(self.recorder.manifest.tensor_names(Kind.ACTIVATION))
        return {n: a for n, a in snaps.items() if n in names}


def _graph_of(t: Any) -> Any:
    """The graph a (symbolic) tensor belongs to; None for an eager tensor."""
    return getattr(t, "graph", None)  # EagerTensor.graph raises AttributeError
