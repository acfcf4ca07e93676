"""Keras 3 on the torch backend: the train step runs eagerly, statistics on the host.

Keras's torch trainer runs ``model.train_step(data)`` eagerly (forward, ``backward``,
``optimizer.apply``; BatchNorm moving statistics and parameters are updated in place).
:class:`TorchStep` (hooks of :class:`~traintape.adapters.tf.keras_hooks.StepHooks` plus
``optimizer.apply``) on a captured step:

- before the step: copies θ_t of the recorded parameters and BatchNorm statistics;
- in ``optimizer.apply``: keeps the gradients it receives (before Keras's clipping,
  ``loss_scale_factor`` divided out) and the clipping factor;
- after the step: ``update`` = θ_{t+1} − θ_t in the storage dtype (as applied),
  ``opt_state`` = the optimizer's slots; activation stats of the training-mode outputs
  (detached) and the probe batch's snapshots on full-capture steps.

Raw rows come from traintape's host C kernel (:func:`traintape.core.stats.raw_rows`, one
call per step over every tensor); tensors reach numpy through ``keras.ops.convert_to_numpy``
(detached; a copy from a GPU).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from traintape.core.recorder import KindRows, Recorder
from traintape.core.stats import raw_rows
from traintape.schema import Kind
from traintape.schema.stats import activation_map

from .canonical import activation_spec
from .keras_hooks import BATCH_LOSS, CLIP_FACTOR, StepContext, StepHooks, clip_factor, unscaled
from .names import Entry, model_entries
from .opt_state import find_slots
from .recording import declare, selected


def _np(x: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(x))


class TorchStep(StepHooks):
    """Records a Keras model's torch train step (see module)."""

    def __init__(
        self,
        recorder: Recorder,
        model: Any,
        *,
        name_map: Any,
        kinds: tuple[Kind, ...],
        acts: Any,
        offset: int,
        metrics: bool = True,
    ) -> None:
        super().__init__(recorder, model, acts, metrics=metrics)
        self.kinds = kinds
        self.offset = offset
        rec = recorder
        entries = selected(rec, model_entries(model, name_map))
        self.params: list[Entry] = [e for e in entries if e.trainable]
        self.state: list[Entry] = [e for e in entries if not e.trainable]
        self._slots: list[Any] | None = None
        for k in kinds:
            if k is Kind.PARAM:
                declare(rec, k, self.params + self.state)
            elif k is not Kind.OPT_STATE:
                declare(rec, k, self.params)

    def slots(self) -> list[Any]:
        rec = self.recorder
        if Kind.OPT_STATE not in self.kinds or not rec.policy.records_kind(Kind.OPT_STATE):
            return []
        if self._slots is None:
            opt = self.model.optimizer
            self._slots = [s for s in find_slots(opt, self.params) if rec.policy.selects(s.name)]
            if self._slots:
                rec.declare([s.spec for s in self._slots])
        return self._slots

    def install(self) -> None:
        super().install()
        opt = self.model.optimizer
        orig_apply = opt.apply
        by_var: dict[int, list[int]] = {}  # an LSTM bias backs two entries
        for i, e in enumerate(self.params):
            by_var.setdefault(id(e.variable), []).append(i)

        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            ctx = self.ctx
            if ctx is not None and ctx.step is not None:
                gs = unscaled(opt, list(grads))
                vs = list(trainable_variables) if trainable_variables is not None else list(
                    opt._trainable_variables)  # fmt: skip
                ctx.grads = [None] * len(self.params)
                for v, g in zip(vs, gs, strict=True):
                    for i in by_var.get(id(v), []) if g is not None else []:
                        ctx.grads[i] = _np(self.params[i].grad(g))
                clip = clip_factor(opt, gs)
                ctx.clip = None if clip is None else float(_np(clip))
            return orig_apply(grads, trainable_variables)

        self._patch(opt, "apply", apply)

    # ------------------------------------------------------------------ step
    def begin(self, ctx: StepContext, args: tuple[Any, ...]) -> None:
        rec = self.recorder
        step = int(_np(self.model.optimizer.iterations)) + self.offset
        if not rec.enabled or not rec.policy.captures(step):
            return  # ctx.step stays None: nothing is read or recorded
        ctx.step = step
        ctx.state = [np.array(_np(e.read()), copy=True) for e in self.params + self.state]

    def batch_loss(self, values: Any) -> Any:
        return values.detach() if hasattr(values, "detach") else values

    def sink(self, name: str, layer: str, kind: str | None, t: Any) -> None:
        if self.ctx is not None and self.ctx.step is not None:
            self.ctx.acts.append((name, layer, kind, t.detach() if hasattr(t, "detach") else t))

    def finish(self, ctx: StepContext, args: tuple[Any, ...], out: Any) -> Any:
        if ctx.step is None:
            return out
        rec = self.recorder
        try:
            self._record(ctx)
        except Exception:
            if rec.strict:
                raise
            import logging

            logging.getLogger("traintape").exception(
                "traintape.keras (torch): recording step %s failed (training goes on)", ctx.step
            )
        return out

    def _record(self, ctx: StepContext) -> None:
        rec, s = self.recorder, int(ctx.step)
        n = len(self.params)
        before = ctx.state
        groups: list[tuple[Kind, list[str], list[np.ndarray], bool]] = []
        names = [e.name for e in self.params]
        if Kind.PARAM in self.kinds:
            groups.append((Kind.PARAM, names + [e.name for e in self.state], before, True))
        if Kind.GRAD in self.kinds and ctx.grads is not None:
            have = [i for i, g in enumerate(ctx.grads) if g is not None]
            groups.append((Kind.GRAD, [names[i] for i in have], [ctx.grads[i] for i in have], True))
        if Kind.UPDATE in self.kinds:
            after = [_np(e.read()) for e in self.params]
            upd = [a - b for a, b in zip(after, before[:n], strict=True)]  # storage dtype
            groups.append((Kind.UPDATE, names, upd, True))
        slots = self.slots()
        if slots:
            groups.append((Kind.OPT_STATE, [x.name for x in slots], [_np(x.read()) for x in slots],
                           True))  # fmt: skip
        acts = [a for a in ctx.acts if rec.policy.selects(a[0])]
        if acts and rec.policy.records_kind(Kind.ACTIVATION):
            arrays = [_np(t) for *_, t in acts]
            rec.declare([activation_spec(nm, k, str(a.dtype), [None, *a.shape[1:]])
                         for (nm, _, k, _t), a in zip(acts, arrays, strict=True)])  # fmt: skip
            groups.append((Kind.ACTIVATION, [a[0] for a in acts], arrays, False))
        groups = [g for g in groups if g[1] and rec.wants(s, g[0])]
        arrays = [a for g in groups for a in g[2]]
        maps = [activation_map(a.shape) if g[0] is Kind.ACTIVATION else None
                for g in groups for a in g[2]]  # fmt: skip
        raw = raw_rows(arrays, maps=maps) if arrays else np.zeros((0, 0))
        parts, k = [], 0
        for kind, nm, arrs, snap in groups:
            snaps = None
            if rec.snapshots(s, kind):
                if snap:
                    snaps = {x: np.array(a, copy=True) for x, a in zip(nm, arrs, strict=True)}
                elif self.acts is not None:
                    snaps = self.acts._probe_snapshots(s)
            parts.append(KindRows(kind, nm, raw[k : k + len(nm)], snaps))
            k += len(nm)
        if parts:
            rec.record_step(s, parts)
        vals: dict[str, float] = {}
        if ctx.loss is not None:
            vals[BATCH_LOSS] = float(_np(ctx.loss))
        if ctx.clip is not None:
            vals[CLIP_FACTOR] = ctx.clip
        if vals:
            rec.log(s, vals)
