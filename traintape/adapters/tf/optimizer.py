"""Observing a Keras 3 optimizer: ``update`` = θ_{t+1} − θ_t as applied.

:func:`observe_optimizer` replaces the optimizer *instance's* ``apply`` method (the one
``apply_gradients`` and Keras's compiled ``train_step`` both call) by a wrapper that

1. reads ``step = optimizer.iterations`` (completed optimizer steps = step t) and the
   variables' values θ_t (only inside the capture branch's data flow),
2. calls the original ``apply``,
3. reads θ_{t+1} and records ``update`` and ``opt_state`` (the optimizer's slots after
   the step, :mod:`.opt_state`; when the policy records that kind) — and, for the Keras
   callback, also ``param`` = θ_t, ``grad`` and activations — in one host transfer.

It works eagerly and inside ``tf.function`` (TF's automatic control dependencies order
the reads around the optimizer's assignments). :func:`unobserve_optimizer` restores it.
Gradient accumulation (``gradient_accumulation_steps``) is not supported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from traintape.core.naming import NameMap
from traintape.core.recorder import Recorder
from traintape.schema import Kind

from .capture import Group, declare, emit, selected
from .keras_hooks import CLIP_FACTOR, clip_factor, unscaled
from .names import Entry, variable_entries
from .opt_state import Slot, find_slots
from .recording import request_kinds, start_offset

_OBSERVERS: dict[int, _Observer] = {}
_log = logging.getLogger("traintape")


class _Reshaped:
    """A flat tensor seen in its canonical shape (reshaped lazily, inside the branch)."""

    def __init__(self, flat: Any, shape: tuple[int, ...]) -> None:
        self.flat, self.shape = flat, shape


class _Observer:
    def __init__(
        self,
        optimizer: Any,
        recorder: Recorder,
        model: Any,
        name_map: NameMap,
        kinds: Sequence[Kind],
    ) -> None:
        self.optimizer = optimizer
        self.recorder = recorder
        self.model = model
        self.name_map = name_map
        self.kinds = tuple(Kind(k) for k in kinds)
        self.extra: list[Callable[[], list[Group]]] = []  # more groups (activations)
        self.state: list[tuple[Entry, Any]] = []  # (running-stat entry, θ_t shadow variable)
        self.orig = optimizer.apply
        self.offset = 0
        """Recorded step = ``optimizer.iterations`` + offset (:func:`.recording.start_offset`)."""
        self._slots: dict[tuple[int, ...], list[Slot]] = {}

    def entries(self, variables: Sequence[Any]) -> list[list[Entry]]:
        return variable_entries(variables, self.model, self.name_map)

    def slots(self, ents: list[Entry]) -> list[Slot]:
        """The optimizer slots of ``ents`` recorded as ``opt_state`` (declared; found
        once per set of entries, after the optimizer is built)."""
        rec = self.recorder
        if Kind.OPT_STATE not in self.kinds or not rec.policy.records_kind(Kind.OPT_STATE):
            return []
        key = tuple(id(e.variable) for e in ents)
        got = self._slots.get(key)
        if got is None:
            got = [s for s in find_slots(self.optimizer, ents) if rec.policy.selects(s.name)]
            if not got:
                return []  # not built yet (or no state): look again next time
            self._slots[key] = got
            rec.declare([s.spec for s in got])
        return got

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        rec = self.recorder
        opt = self.optimizer
        if trainable_variables is None:
            if not opt.built:
                return self.orig(grads, trainable_variables)
            variables = list(opt._trainable_variables)
        else:
            variables = list(trainable_variables)
        grads_l = list(grads)
        step = self._step()
        self._log_clip(step, grads_l)
        per_var = self.entries(variables)
        pairs = [(e, g) for es, g in zip(per_var, grads_l, strict=True) for e in es
                 if g is not None]  # fmt: skip
        pairs = [p for p in pairs if rec.policy.selects(p[0].name)]
        ents = [e for e, _ in pairs]
        for k in self.kinds:
            if k != Kind.OPT_STATE and (k != Kind.PARAM or not self.state):
                declare(rec, k, ents)
        extra = [g for f in self.extra for g in f()]
        wanted = any(rec.policy.records_kind(k) for k in self.kinds) or extra
        if not wanted or not ents:
            return self._skip(grads, trainable_variables)
        eager = tf.executing_eagerly()
        if (
            eager
            and not rec.wants(step, Kind.UPDATE)
            and not any(rec.wants(step, g.kind) for g in extra)
            and not any(rec.wants(step, k) for k in self.kinds)
        ):
            return self._skip(grads, trainable_variables)
        before = self._snapshot_before(ents, step)
        out = self.orig(grads, trainable_variables)
        groups = list(extra)
        names = [e.name for e in ents]
        state = [(e, sh) for e, sh in self.state if rec.policy.selects(e.name)]
        if Kind.PARAM in self.kinds:
            if state:
                declare(rec, Kind.PARAM, ents + [e for e, _ in state])
            groups.append(Group(Kind.PARAM, names + [e.name for e, _ in state],
                                lambda: _dense(before) + [sh.read_value() for _, sh in state]))  # fmt: skip
        if Kind.GRAD in self.kinds:  # raw: Keras clips inside ``apply``
            scale = getattr(opt, "loss_scale_factor", None)
            groups.append(Group(Kind.GRAD, names, lambda: [
                e.grad(g if scale is None else g / scale) for e, g in pairs]))  # fmt: skip
        if Kind.UPDATE in self.kinds:
            groups.append(Group(Kind.UPDATE, names, lambda: [
                e.read() - b for e, b in zip(ents, _dense(before), strict=True)]))  # fmt: skip
        slots = self.slots(ents)  # read after the step, like θ_{t+1}
        if slots:
            groups.append(Group(Kind.OPT_STATE, [s.name for s in slots],
                                lambda: [s.read() for s in slots]))  # fmt: skip
        emit(rec, step, groups)
        self._sync()
        return out

    def _step(self) -> Any:
        """The recorded step of this call: ``iterations`` + the offset (a scalar tensor in
        a graph)."""
        opt = self.optimizer
        if not tf.executing_eagerly():
            return tf.identity(opt.iterations.value) + self.offset
        return int(opt.iterations.numpy()) + self.offset

    def _log_clip(self, step: Any, grads: list[Any]) -> None:
        """Log ``grad/clip_factor`` (the optimizer's clipping of these raw gradients)."""
        rec = self.recorder
        factor = clip_factor(self.optimizer, unscaled(self.optimizer, grads))
        if factor is None or not rec.enabled:
            return

        def host(s: Any, f: Any) -> np.int64:
            s = int(s)
            try:
                if rec.policy.captures(s):
                    rec.log(s, {CLIP_FACTOR: float(f)})
            except Exception:
                if rec.strict:
                    raise
                _log.exception("traintape.tf: logging %s at step %s failed", CLIP_FACTOR, s)
            return np.int64(0)

        if tf.executing_eagerly():
            host(step, factor.numpy())
        else:
            tf.numpy_function(host, [tf.cast(step, tf.int64), tf.cast(factor, tf.float64)],
                              tf.int64, stateful=True)  # fmt: skip

    def _snapshot_before(self, ents: list[Entry], step: Any) -> list[Any]:
        """θ_t of ``ents``, read before the update. In a graph the copy is only made on
        captured steps (a ``tf.cond`` returns an empty tensor otherwise, so the
        optimizer's in-place update needs no copy-on-write of the variables)."""
        if tf.executing_eagerly():
            return [tf.identity(e.read()) for e in ents]
        captured = tf.equal(step % self.recorder.policy.every, 0)
        out: list[Any] = []
        for e in ents:
            flat = tf.cond(captured, lambda e=e: tf.reshape(e.read(), [-1]),
                           lambda e=e: tf.zeros([0], e.read().dtype))  # fmt: skip
            out.append(_Reshaped(flat, e.shape))
        return out

    def _sync(self) -> None:
        for e, sh in self.state:  # shadow <- current: θ_{t+1}'s running statistics
            sh.assign(e.read())

    def _skip(self, grads: Any, trainable_variables: Any) -> Any:
        out = self.orig(grads, trainable_variables)
        self._sync()
        return out


def _dense(xs: list[Any]) -> list[Any]:
    return [tf.reshape(x.flat, x.shape) if isinstance(x, _Reshaped) else x for x in xs]


def observe_optimizer(
    optimizer: Any,
    recorder: Recorder,
    *,
    model: Any = None,
    name_map: NameMap = None,
    kinds: Sequence[Kind | str] | None = None,
) -> Any:
    """Record ``kinds`` (default ``update`` and ``opt_state``) each time ``optimizer``
    applies gradients; a kind the recorder's policy does not record is skipped.

    Args:
        model: names tensors as :func:`~traintape.adapters.tf.names.model_entries` does;
            without it names come from ``variable.path``.
        kinds: any of ``param`` (θ_t), ``grad``, ``update`` (θ_{t+1} − θ_t),
            ``opt_state`` (the optimizer's slots after the step, ``<param>/mu``...: see
            :mod:`~traintape.adapters.tf.opt_state`); the step is the optimizer's
            ``iterations`` before the update (a fresh optimizer counts from
            ``Recorder.next_step``). Default ``update`` and ``opt_state`` where the
            policy records them; kinds passed explicitly are recorded even where the
            policy leaves them out.
    ``grad`` is the gradient given to ``apply`` (before the optimizer's ``clipnorm``/
    ``global_clipnorm``/``clipvalue``); when the optimizer clips, the factor is logged as
    the metric ``grad/clip_factor``.
    Returns the same optimizer (observed in place; observing twice replaces the first).
    """
    unobserve_optimizer(optimizer)
    if kinds is None:
        kinds = (Kind.UPDATE, Kind.OPT_STATE)
    else:
        request_kinds(recorder, kinds, "traintape.tf observe_optimizer")
    obs = _Observer(optimizer, recorder, model, name_map, [Kind(k) for k in kinds])
    with tf.init_scope():
        it = int(optimizer.iterations.numpy())
    obs.offset = start_offset(recorder, it, "traintape.tf observe_optimizer")
    _OBSERVERS[id(optimizer)] = obs
    object.__setattr__(optimizer, "apply", obs.apply)
    return optimizer


def observer(optimizer: Any) -> _Observer | None:
    return _OBSERVERS.get(id(optimizer))


def unobserve_optimizer(optimizer: Any) -> None:
    """Undo :func:`observe_optimizer` (no-op if not observed)."""
    obs = _OBSERVERS.pop(id(optimizer), None)
    if obs is not None:
        try:
            object.__delattr__(optimizer, "apply")
        except AttributeError:
            object.__setattr__(optimizer, "apply", obs.orig)


__all__ = ["observe_optimizer", "selected", "unobserve_optimizer"]
