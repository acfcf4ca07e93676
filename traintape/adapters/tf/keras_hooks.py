"""Hooks into a compiled Keras 3 model's train step, shared by every backend.

:class:`StepHooks` replaces, on the *instances* only (undone by :meth:`StepHooks.remove`):

- ``model.train_step`` — the body Keras compiles (``tf.function``, ``jax.jit``) or runs
  eagerly (torch): the wrapper opens a :class:`StepContext` for the call (at trace time
  under a compiler) and hands it to the backend's ``finish`` after the original step;
- ``model._loss_tracker.update_state`` — Keras feeds it the *batch* loss (before it
  averages it into the epoch's running mean ``loss``): kept as ``StepContext.loss`` and
  logged as the metric ``batch_loss``;
- activations: :class:`~traintape.adapters.tf.activations.ActivationCapture` sends
  training-mode layer outputs to ``StepContext.acts`` (JAX and torch; TF keeps its stash).

Backends subclass it (:mod:`.keras_jax`, :mod:`.keras_torch`; the TF backend uses
:mod:`.optimizer`'s observer and this class for the batch loss only).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from traintape.core.recorder import Recorder

BATCH_LOSS = "batch_loss"
"""Metric name of the batch loss (Keras's ``loss`` log is the epoch's running mean)."""
CLIP_FACTOR = "grad/clip_factor"
"""Metric name of the clipping factor the optimizer applied to the gradients:
``‖clip(g)‖ / ‖g‖`` over all gradients (1.0 = not clipped; docs/keras.md)."""


@dataclass
class StepContext:
    """What one (traced or eager) train step gathered for recording."""

    state: Any = None
    """The step's input state (JAX: ``(trainable, non_trainable, optimizer, metrics)``
    values), or θ_t read before the step (torch)."""
    step: Any = None
    """The recorded step: a traced scalar (JAX, TF) or an int (torch)."""
    loss: Any = None
    grads: list[Any] | None = None
    clip: Any = None
    lr: Any = None
    acts: list[tuple[str, str, str | None, Any]] = field(default_factory=list)
    """(name, layer, layer_kind, output) of the parametrised layers, in call order."""


class StepHooks:
    """Installs the train-step, loss-tracker and activation hooks (see module)."""

    def __init__(
        self, recorder: Recorder, model: Any, acts: Any = None, *, metrics: bool = True
    ) -> None:
        self.recorder = recorder
        self.metrics = metrics
        """Log ``batch_loss`` (and ``lr`` where the backend logs it from the step);
        ``grad/clip_factor`` is logged either way (it belongs to ``grad``)."""
        self.model = model
        self.acts = acts
        self.ctx: StepContext | None = None
        self._patched: list[tuple[Any, str]] = []

    # -------------------------------------------------------------- install
    def _patch(self, obj: Any, name: str, fn: Any) -> None:
        object.__setattr__(obj, name, fn)
        self._patched.append((obj, name))

    def install(self) -> None:
        model = self.model
        orig_step = model.train_step

        def train_step(*args: Any) -> Any:
            ctx = StepContext()
            self.ctx = ctx
            try:
                self.begin(ctx, args)
                out = orig_step(*args)
            finally:
                self.ctx = None
            return self.finish(ctx, args, out)

        self._patch(model, "train_step", train_step)
        tracker = getattr(model, "_loss_tracker", None)
        if tracker is not None and self.metrics:
            orig_update = tracker.update_state

            def update_state(values: Any, *a: Any, **kw: Any) -> Any:
                if self.ctx is not None and self.ctx.loss is None:
                    self.ctx.loss = self.batch_loss(values)
                return orig_update(values, *a, **kw)

            self._patch(tracker, "update_state", update_state)
        if self.acts is not None:
            self.acts.sink = self.sink

    def remove(self) -> None:
        for obj, name in reversed(self._patched):
            with contextlib.suppress(AttributeError):
                object.__delattr__(obj, name)
        self._patched.clear()
        if self.acts is not None:
            self.acts.sink = None

    # -------------------------------------------------------------- per backend
    def begin(self, ctx: StepContext, args: tuple[Any, ...]) -> None:
        """Before the original step runs (read θ_t, the step number)."""

    def finish(self, ctx: StepContext, args: tuple[Any, ...], out: Any) -> Any:
        """After the original step: record; returns the step's outputs."""
        return out

    def batch_loss(self, values: Any) -> Any:
        """The batch loss as the backend keeps it (detached from autodiff)."""
        return values

    def sink(self, name: str, layer: str, kind: str | None, t: Any) -> None:
        if self.ctx is not None:
            self.ctx.acts.append((name, layer, kind, t))


def clip_factor(optimizer: Any, grads: list[Any]) -> Any:
    """``‖clip(g)‖ / ‖g‖`` over all of ``grads`` as ``optimizer`` clips them
    (``clipnorm`` per tensor, ``global_clipnorm``, ``clipvalue``), a backend scalar;
    None when the optimizer does not clip. 1.0 when every gradient is zero."""
    if not (optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue):
        return None
    import keras

    ops = keras.ops
    gs = [g for g in grads if g is not None]
    if not gs:
        return None
    clipped = optimizer._clip_gradients(gs)

    def sq(xs: list[Any]) -> Any:
        return sum(ops.sum(ops.square(ops.cast(x, "float32"))) for x in xs)

    raw, got = sq(gs), sq(clipped)
    return ops.where(raw > 0, ops.sqrt(got / ops.where(raw > 0, raw, 1.0)), 1.0)


def unscaled(optimizer: Any, grads: list[Any]) -> list[Any]:
    """The gradients of the loss: Keras's ``loss_scale_factor`` divided out (the
    optimizer does the same first thing in ``apply``)."""
    scale = getattr(optimizer, "loss_scale_factor", None)
    if scale is None:
        return list(grads)
    return [g if g is None else g / scale for g in grads]
