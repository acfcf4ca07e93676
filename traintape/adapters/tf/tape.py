"""``traintape.tf.GradientTape``: a drop-in ``tf.GradientTape`` that records.

``tape.gradient(loss, variables)`` returns exactly what ``tf.GradientTape.gradient``
returns and records ``grad`` (∇L(θ_t)) and ``param`` (θ_t) of the watched variables in
their canonical names/layouts, eagerly or inside ``tf.function`` (one host transfer per
step, full tensors only on full-capture steps). With ``optimizer=`` the optimizer is
observed too (:func:`~traintape.adapters.tf.optimizer.observe_optimizer`) so ``update``
(and ``opt_state``, the optimizer's slots after the step, when the policy records that
kind: :mod:`~traintape.adapters.tf.opt_state`) is recorded when it applies the
gradients, and the step is ``optimizer.iterations``.
With ``model=`` the outputs of the model's parametrised layers called with
``training=True`` inside the tape are recorded as ``activation`` (stats over the batch,
the names the Keras callback gives them; :mod:`~traintape.adapters.tf.activations`).

Step: ``step=`` (int or scalar tensor) if given, else ``optimizer.iterations``, else a
counter kept per recorder (a ``tf.Variable``) that advances by one per ``gradient`` call.
Counting starts at ``Recorder.next_step`` (a resumed run's ``resume_step``; a fresh
optimizer's ``iterations`` is offset to it); an explicit ``step=`` that disagrees with it
at the recorder's first record is a ``RecordError`` naming both numbers.

``grad`` is the gradient ``gradient()`` returns (before any clipping); an observed
optimizer that clips (``clipnorm``/``global_clipnorm``/``clipvalue``) logs the factor it
applied as the metric ``grad/clip_factor``. ``update`` is θ_{t+1} − θ_t as applied, read
from the variables in their storage dtype (0 where the step is below half an ulp).

Inside ``tf.function`` the returned gradients are ``tf.identity`` of TF's (same values,
same structure, ``None`` kept) with a control dependency on the recording, so whatever
applies them runs after θ_t and the gradients were read: the optimizer then updates the
variables in place instead of copying each one (copy-on-write) because the recording
still holds its buffer.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from traintape.core.errors import RecordError
from traintape.core.naming import NameMap
from traintape.core.recorder import Recorder
from traintape.schema import Kind

from .activations import capture_for
from .capture import Group, declare, emit
from .optimizer import observe_optimizer, observer
from .recording import next_step
from .stats import stats_backend
from .strategy import refuse_replicas

_COUNTERS: dict[int, tuple[Recorder, tf.Variable]] = {}
_CHECKED: dict[int, Recorder] = {}  # recorders whose first explicit step was checked


def _counter(rec: Recorder) -> tf.Variable:
    """The recorder's step counter, starting at ``Recorder.next_step``."""
    got = _COUNTERS.get(id(rec))
    if got is None or got[0] is not rec:
        with tf.init_scope():
            v = tf.Variable(next_step(rec), dtype=tf.int64, trainable=False,
                            name="traintape_step")  # fmt: skip
        got = (rec, v)
        _COUNTERS[id(rec)] = got
    return got[1]


class GradientTape(tf.GradientTape):
    """``tf.GradientTape`` that records ``param`` and ``grad`` at ``gradient()``.

    Args:
        recorder: the :class:`~traintape.Recorder`.
        model: optional Keras model, for canonical layer paths (see
            :mod:`traintape.adapters.tf.names`) and activations (layer outputs of calls
            with ``training=True`` inside the tape); without it names come from
            ``variable.path`` (e.g. ``dense/kernel``) and no activations are recorded.
        optimizer: optional Keras optimizer; observed so ``update`` (and ``opt_state``
            when the policy records it) is recorded, and its ``iterations`` is the step.
        step: explicit optimizer step (int or scalar int tensor); overrides the others.
        name_map: rename canonical names (mapping or callable; see core.naming).
        persistent, watch_accessed_variables: as in ``tf.GradientTape``.
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        model: Any = None,
        optimizer: Any = None,
        step: Any = None,
        name_map: NameMap = None,
        persistent: bool = False,
        watch_accessed_variables: bool = True,
    ) -> None:
        refuse_replicas("traintape.tf.GradientTape")
        super().__init__(persistent=persistent, watch_accessed_variables=watch_accessed_variables)
        self._tt_rec = recorder
        self._tt_model = model
        self._tt_opt = optimizer
        self._tt_step = step
        self._tt_map = name_map
        recorder.set_producer(framework="tensorflow", framework_version=tf.__version__,
                              adapter="traintape.tf", stats_backend=stats_backend())  # fmt: skip
        self._tt_acts = (
            capture_for(recorder, model, name_map)
            if model is not None and recorder.policy.records_kind(Kind.ACTIVATION)
            else None
        )
        if optimizer is not None:
            obs = observer(optimizer)
            if obs is None or obs.recorder is not recorder:
                observe_optimizer(optimizer, recorder, model=model, name_map=name_map)

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:  # fmt: skip
        """Exactly ``tf.GradientTape.gradient``; also records ``param`` and ``grad``."""
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)  # fmt: skip
        if self._tt_step is not None:  # a usage error, raised whatever ``strict`` says
            self._check_first(self._tt_step)
        try:
            done = self._record(sources, grads)
        except Exception:
            if self._tt_rec.strict:
                raise
            import logging

            logging.getLogger("traintape").exception("traintape.tf: recording failed")
            done = None
        if done is not None:
            grads = _after(done, grads)
        return grads

    def _step(self) -> Any:
        if self._tt_step is not None:
            return self._tt_step
        if self._tt_opt is not None:
            it = self._tt_opt.iterations
            obs = observer(self._tt_opt)
            off = obs.offset if obs is not None and obs.recorder is self._tt_rec else 0
            return int(it.numpy()) + off if tf.executing_eagerly() else tf.identity(it.value) + off
        c = _counter(self._tt_rec)
        if tf.executing_eagerly():
            s = int(c.numpy())
            c.assign_add(1)
            return s
        s = tf.identity(c.read_value())
        with tf.control_dependencies([s]):
            c.assign_add(1)
        return s

    def _check_first(self, step: Any) -> None:
        """An explicit ``step=`` must agree with a resumed recorder's ``next_step`` at its
        first use (a Python int or an eager tensor; a traced step is not checked)."""
        rec = self._tt_rec
        if _CHECKED.get(id(rec)) is rec:
            return
        if isinstance(step, tf.Tensor) and not tf.executing_eagerly():
            return
        _CHECKED[id(rec)] = rec
        nxt, got = next_step(rec), int(step)
        if nxt and got != nxt:
            raise RecordError(
                f"traintape.tf.GradientTape: step={got} but the recorder {rec.url} resumes "
                f"at step {nxt} (Recorder(resume_step={nxt})); pass step={nxt} for this "
                f"batch or leave step= out (the tape then counts from {nxt})"
            )

    def _record(self, sources: Any, grads: Any) -> Any:
        """Emit ``param`` and ``grad``; in a graph, return the emission's output tensor."""
        from .names import variable_entries

        rec = self._tt_rec
        src = tf.nest.flatten(sources)
        gs = tf.nest.flatten(grads)
        per_var = variable_entries(src, self._tt_model, self._tt_map)
        pairs = [(e, g) for es, g in zip(per_var, gs, strict=True) for e in es
                 if g is not None and rec.policy.selects(e.name)]  # fmt: skip
        step = self._step()
        acts = self._tt_acts.groups() if self._tt_acts is not None else []
        if not pairs:
            return emit(rec, step, acts) if acts else None
        ents = [e for e, _ in pairs]
        declare(rec, Kind.PARAM, ents)
        declare(rec, Kind.GRAD, ents)
        names = [e.name for e in ents]
        return emit(rec, step, [
            Group(Kind.PARAM, names, lambda: [e.read() for e in ents]),
            Group(Kind.GRAD, names, lambda: [e.grad(g) for e, g in pairs]),
            *acts,
        ])  # fmt: skip


def _after(done: Any, grads: Any) -> Any:
    """``grads`` (same values, same structure) that exist only once ``done`` has run.

    Inside ``tf.function`` the emission reads θ_t straight from the variables' buffers
    (no copy) and TF's automatic control dependencies do not order a
    ``tf.numpy_function`` before the optimizer's assignments. An optimizer applying
    these gradients therefore waits for the recording; otherwise it would update the
    variables while the buffers are still referenced, and every variable would be
    copied (copy-on-write: one more memory pass over all parameters per step).
    """
    if tf.executing_eagerly() or not isinstance(done, (tf.Tensor, tf.Operation)):
        return grads

    def dep(g: Any) -> Any:
        if g is None:
            return None
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
        return tf.identity(g)

    with tf.control_dependencies([done]):
        return tf.nest.map_structure(dep, grads)
