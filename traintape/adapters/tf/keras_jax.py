"""Keras 3 on the JAX backend: statistics computed inside Keras's jitted train step.

Keras's JAX trainer compiles ``model.train_step(state, data)`` with ``jax.jit`` (unless
``jit_compile=False``) over explicit state: ``state = (trainable, non_trainable,
optimizer, metrics)`` value lists; during ``fit`` the ``keras.Variable`` objects hold no
value (Keras purges them). :class:`JaxStep` therefore reads everything from the traced
state, through :class:`~traintape.adapters.tf.keras_hooks.StepHooks` and one more hook,
``optimizer.stateless_apply`` (it receives the gradients):

- ``param`` θ_t: the input trainable values, plus BatchNorm moving statistics from the
  input non-trainable values (as they were before batch t, as on the TF backend);
- ``grad``: the gradients ``stateless_apply`` receives — before Keras's clipping
  (``clipnorm``/``global_clipnorm``/``clipvalue``, done inside the optimizer) and with a
  ``loss_scale_factor`` divided out; the clipping factor is the metric ``grad/clip_factor``;
- ``update``: θ_{t+1} − θ_t of the output and input values in the storage dtype (the
  update as applied); ``opt_state``: the optimizer's slots after the step;
- ``activation``: stats of the training-mode outputs of parametrised layers, computed in
  the forward pass (inside ``jax.value_and_grad``, of ``stop_gradient`` values) and sent
  by their own ordered callback; probe snapshots (``probe=``) come from an eager probe
  run on the host on full-capture steps (:meth:`ActivationCapture.run_probe`);
- the metrics ``batch_loss``, ``lr`` (the rate applied at step t; Keras's variables hold
  no value during ``fit``, so the callback cannot read it from the host) and
  ``grad/clip_factor``.

Everything goes through the JAX adapter's transport (:func:`traintape.adapters.jax.capture.emit`:
the stat matrix computed in the compiled step by XLA or the FFI kernel, one ordered
``io_callback`` per record point, full tensors only on full-capture steps), so
``jit_compile`` stays on. The step is the optimizer's traced ``iterations`` + the offset
from :func:`~traintape.adapters.tf.recording.start_offset`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.experimental import io_callback

from traintape.core.recorder import KindRows, Recorder
from traintape.schema import Kind
from traintape.schema.stats import activation_map

from ..jax.capture import Group as JaxGroup
from ..jax.capture import emit, pump_for
from ..jax.names import Leaf
from ..jax.stats import device_stats, stats_backend
from .canonical import activation_spec
from .keras_hooks import BATCH_LOSS, CLIP_FACTOR, StepContext, StepHooks, clip_factor, unscaled
from .names import Entry, model_entries
from .opt_state import find_slots
from .recording import declare, selected

__all__ = ["JaxStep", "stats_backend"]


class JaxStep(StepHooks):
    """Records a Keras model's JAX train step (see module)."""

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
        opt = model.optimizer
        rec = recorder
        entries = selected(rec, model_entries(model, name_map))
        tv = {id(v): i for i, v in enumerate(model.trainable_variables)}
        ntv = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        ov = {id(v): i for i, v in enumerate(opt.variables)}
        og = {id(v): i for i, v in enumerate(opt._trainable_variables)}
        self.params = [e for e in entries if e.trainable and id(e.variable) in tv]
        self.state = [e for e in entries if not e.trainable and id(e.variable) in ntv]
        self.tv, self.ntv, self.ov, self.og = tv, ntv, ov, og
        self.iter_index = next(i for i, v in enumerate(opt.variables) if v is opt.iterations)
        self.slots = (
            [s for s in find_slots(opt, self.params) if rec.policy.selects(s.name)]
            if Kind.OPT_STATE in kinds
            else []
        )
        self._declare()

    def _declare(self) -> None:
        rec = self.recorder
        for k in self.kinds:
            if k is Kind.PARAM:
                declare(rec, k, self.params + self.state)
            elif k is not Kind.OPT_STATE:
                declare(rec, k, self.params)
        if self.slots and rec.policy.records_kind(Kind.OPT_STATE):
            rec.declare([s.spec for s in self.slots])

    def install(self) -> None:
        super().install()
        model, opt = self.model, self.model.optimizer
        orig_apply = opt.stateless_apply
        orig_loss = model.compute_loss_and_updates

        def stateless_apply(optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
            ctx = self.ctx
            if ctx is not None:
                ctx.grads = unscaled(opt, list(grads))
                ctx.clip = clip_factor(opt, ctx.grads)
                if self.metrics:
                    mapping = list(zip(opt.variables, optimizer_variables, strict=True))
                    with keras.StatelessScope(state_mapping=mapping):
                        lr = opt._get_current_learning_rate()  # the rate applied at step t
                        ctx.lr = keras.ops.convert_to_tensor(lr)
            return orig_apply(optimizer_variables, grads, trainable_variables)

        def compute_loss_and_updates(*args: Any, **kwargs: Any) -> Any:
            out = orig_loss(*args, **kwargs)
            ctx = self.ctx
            if ctx is not None and ctx.acts and kwargs.get("training", False):
                self._emit_activations(ctx)
            return out

        self._patch(opt, "stateless_apply", stateless_apply)
        self._patch(model, "compute_loss_and_updates", compute_loss_and_updates)

    # ------------------------------------------------------------------ step
    def begin(self, ctx: StepContext, args: tuple[Any, ...]) -> None:
        state = args[0]
        ctx.state = state
        ctx.step = jnp.asarray(state[2][self.iter_index], jnp.int32) + self.offset

    def batch_loss(self, values: Any) -> Any:
        return jax.lax.stop_gradient(values)

    def sink(self, name: str, layer: str, kind: str | None, t: Any) -> None:
        if self.ctx is not None:
            self.ctx.acts.append((name, layer, kind, jax.lax.stop_gradient(t)))

    def finish(self, ctx: StepContext, args: tuple[Any, ...], out: Any) -> Any:
        logs, new_state = out
        if self.recorder.enabled:
            self._emit_tensors(ctx, ctx.state, new_state)
            self._emit_metrics(ctx)
        return logs, new_state

    def _emit_tensors(self, ctx: StepContext, old: Any, new: Any) -> None:
        tv0, ntv0 = old[0], old[1]
        tv1, ov1 = new[0], new[2]
        ps = self.params
        groups: list[JaxGroup] = []

        def group(kind: Kind, ents: list[Entry], arrays: list[Any]) -> JaxGroup:
            leaves = [
                Leaf(e.name, e.source_name, i, e.shape, np.dtype(a.dtype))
                for i, (e, a) in enumerate(zip(ents, arrays, strict=True))
            ]
            return JaxGroup(kind, leaves, arrays)

        if Kind.PARAM in self.kinds:
            arrays = [e.canonical(tv0[self.tv[id(e.variable)]]) for e in ps]
            arrays += [e.canonical(ntv0[self.ntv[id(e.variable)]]) for e in self.state]
            groups.append(group(Kind.PARAM, ps + self.state, arrays))
        if Kind.GRAD in self.kinds and ctx.grads is not None:
            grads = [e.grad(ctx.grads[self.og[id(e.variable)]]) for e in ps]
            groups.append(group(Kind.GRAD, ps, grads))
        if Kind.UPDATE in self.kinds:
            upd = []
            for e in ps:
                i = self.tv[id(e.variable)]
                upd.append(e.canonical(tv1[i] - tv0[i]))  # as applied, storage dtype
            groups.append(group(Kind.UPDATE, ps, upd))
        if self.slots:
            arrays = [s.entry.transform.tf(ov1[self.ov[id(s.variable)]]) for s in self.slots]
            leaves = [
                Leaf(s.name, s.spec.source_name or s.name, i, s.entry.shape, np.dtype(a.dtype))
                for i, (s, a) in enumerate(zip(self.slots, arrays, strict=True))
            ]
            groups.append(JaxGroup(Kind.OPT_STATE, leaves, arrays))
        emit(self.recorder, groups, step=ctx.step)

    def _emit_metrics(self, ctx: StepContext) -> None:
        names, values = [], []
        if ctx.loss is not None:
            names.append(BATCH_LOSS)
            values.append(jnp.asarray(ctx.loss, jnp.float32))
        if ctx.lr is not None:
            names.append("lr")
            values.append(jnp.asarray(ctx.lr, jnp.float32))
        if ctx.clip is not None:
            names.append(CLIP_FACTOR)
            values.append(jnp.asarray(ctx.clip, jnp.float32))
        if not names:
            return
        rec = self.recorder
        pump = pump_for(rec)

        def host(step: Any, vals: Any) -> None:
            s = int(step)
            if rec.policy.captures(s):
                v = np.asarray(vals, np.float64)
                pump.put(lambda: rec.log(s, dict(zip(names, v.tolist(), strict=True))))

        io_callback(host, None, ctx.step, jnp.stack(values), ordered=True)

    def _emit_activations(self, ctx: StepContext) -> None:
        """Stats of the stashed training-mode outputs, sent from inside the forward pass
        (their values live in the ``value_and_grad`` trace)."""
        rec = self.recorder
        items = [a for a in ctx.acts if rec.policy.selects(a[0])]
        ctx.acts = []
        if not items or not rec.policy.records_kind(Kind.ACTIVATION):
            return
        rec.declare([activation_spec(n, k, str(np.dtype(t.dtype)), [None, *t.shape[1:]])
                     for n, _, k, t in items])  # fmt: skip
        arrays = [t for *_, t in items]
        names = tuple(n for n, *_ in items)
        stats, decode = device_stats(arrays, [activation_map(tuple(a.shape)) for a in arrays])
        pump = pump_for(rec)
        acts = self.acts

        def host(step: Any, payload: Any) -> None:
            s = int(step)

            def apply() -> None:
                snaps = acts._probe_snapshots(s) if acts is not None else None
                rec.record_step(s, [KindRows(Kind.ACTIVATION, names, decode(payload), snaps)])

            pump.put(apply)

        io_callback(host, None, ctx.step, stats, ordered=True)
