"""Hugging Face ``transformers.Trainer`` integration (imports transformers and torch).

:class:`Callback` attaches :func:`traintape.torch.watch` to the Trainer's model and
optimizer when training begins and removes every hook when it ends.

Step semantics: row ``t`` is the ``t``-th completed optimizer step counted from 0, i.e.
``state.global_step - 1`` after the step (``state.global_step`` at ``on_train_begin``
when resuming). With ``gradient_accumulation_steps = k > 1`` there is one row per
optimizer step and its ``grad`` is the accumulated gradient of the k micro-batches.
``grad`` is the gradient as the backward pass produced it, *before* clipping
(docs/store-format.md): its global L2 norm is Trainer's own ``grad_norm`` (logged as
``train/grad_norm``). With ``max_grad_norm`` set (Trainer's default is 1.0) the factor
Trainer's clipping applied, ``min(1, max_grad_norm / (grad_norm + 1e-6))``, is logged as
``grad/clip_factor`` at every captured step (1.0: not clipped); the clipping shows in
``update``.

Resume: the first row is ``state.global_step`` at ``on_train_begin``; a recorder that
continues a run (``Recorder(url, resume_step=N)``) must continue at that step, else
``on_train_begin`` raises a ``RecordError`` naming both steps.

Metrics: every numeric value of Trainer's logs (``on_log``: ``loss``, ``learning_rate``,
``grad_norm``, ``epoch``, end-of-train summaries) is recorded as ``train/<key>`` on the
row of the optimizer step it describes (``state.global_step - 1``), never one row late.

The callback does not close the recorder (the user owns it): close it (or use it as a
context manager) after ``trainer.train()`` returns.

DeepSpeed is refused (the engine steps the optimizer inside ``backward``, so the
optimizer hooks would not see the gradient it applies); plain DDP/single-process
training, AMP and gradient accumulation are supported.
"""

from __future__ import annotations

import numbers
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from traintape.adapters.torch.watch import WatchHandle, callback_watch_kwargs, watch
from traintape.core.recorder import Recorder


class Callback(TrainerCallback):
    """``transformers.TrainerCallback`` recording a Trainer run into ``recorder``.

    Args:
        recorder: the :class:`traintape.Recorder` (not closed by the callback).
        **watch_kwargs: passed to :func:`traintape.torch.watch` (``name_map``,
            ``activations``, ``probe``); ``optimizer`` and ``start_step`` are set by
            the callback.
    """

    def __init__(self, recorder: Recorder, **watch_kwargs: Any) -> None:
        self.recorder = recorder
        self.watch_kwargs = callback_watch_kwargs("traintape.transformers.Callback", watch_kwargs)
        self.handle: WatchHandle | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if getattr(args, "deepspeed", None):
            raise RuntimeError(
                "traintape.transformers.Callback does not support DeepSpeed: the engine "
                "steps the optimizer inside backward, where traintape cannot read the "
                "gradient it applies. Supported: single-process/DDP Trainer runs, AMP, "
                "gradient accumulation, max_grad_norm clipping."
            )
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise RuntimeError(
                "traintape.transformers.Callback: Trainer passed no model/optimizer to "
                "on_train_begin"
            )
        self.handle = watch(
            model,
            self.recorder,
            optimizer=optimizer,
            start_step=int(state.global_step),
            **self.watch_kwargs,
        )
        self.handle.clipping = bool(args.max_grad_norm and args.max_grad_norm > 0)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not logs or state.global_step < 1:
            return
        values = {
            f"train/{k}": float(v)
            for k, v in logs.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool)
        }
        if values:
            self.recorder.log(state.global_step - 1, values)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


__all__ = ["Callback"]
