"""Lightning integration (imports ``lightning``, or ``pytorch_lightning``, and torch).

:class:`Callback` attaches :func:`traintape.torch.watch` to the LightningModule and its
(first) optimizer at ``on_train_start`` and removes every hook at ``on_train_end``.

Step semantics: row ``t`` is the optimizer step ``trainer.global_step == t`` *before*
the step (the t-th completed optimizer step from 0; resumed runs continue at the
restored ``global_step``). Lightning steps the optimizer with a closure
(``optimizer.step(closure)``); ``grad`` is the gradient as the last micro-batch's
backward pass left it (with ``accumulate_grad_batches = k`` the accumulated gradient of
k micro-batches, each loss scaled by 1/k as Lightning does): ``watch`` takes its
statistics at the end of that backward pass, *before* ``on_before_optimizer_step`` and
gradient clipping (docs/store-format.md: ``grad`` is pre-clip; AMP's loss scale is
divided out). With ``gradient_clip_val`` set (``gradient_clip_algorithm="norm"``) the
factor the clipping applied is logged as ``grad/clip_factor`` at every captured step
(1.0: not clipped). A recorder continuing a run (``Recorder(url, resume_step=N)``)
must continue at the restored ``global_step``, else ``on_train_start`` raises a
``RecordError`` naming both steps.

Metrics: at ``on_train_batch_end`` of a batch that completed an optimizer step, every
scalar of ``trainer.callback_metrics`` is logged on that step's row
(``global_step - 1``) under its own name when it contains ``/``, else ``train/<name>``.

The callback does not close the recorder: the user owns it.
"""

from __future__ import annotations

import warnings
from typing import Any

try:
    from lightning.pytorch import Callback as _LCallback
except ImportError:  # pragma: no cover - the older package name
    from pytorch_lightning import Callback as _LCallback  # type: ignore[no-redef,assignment]

from traintape.adapters.torch.watch import WatchHandle, callback_watch_kwargs, watch
from traintape.core.recorder import Recorder


class Callback(_LCallback):  # type: ignore[misc]
    """Lightning ``Callback`` recording a ``Trainer.fit`` run into ``recorder``.

    Args:
        recorder: the :class:`traintape.Recorder` (not closed by the callback).
        **watch_kwargs: passed to :func:`traintape.torch.watch` (``name_map``,
            ``activations``, ``probe``); ``optimizer`` and ``start_step`` are set here.
    """

    def __init__(self, recorder: Recorder, **watch_kwargs: Any) -> None:
        self.recorder = recorder
        self.watch_kwargs = callback_watch_kwargs("traintape.lightning.Callback", watch_kwargs)
        self.handle: WatchHandle | None = None
        self._last_step = 0
        self._warned = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        opts = trainer.optimizers
        if len(opts) != 1:
            raise RuntimeError(
                f"traintape.lightning.Callback: supports exactly one optimizer with "
                f"automatic optimization; the trainer has {len(opts)}"
            )
        self._last_step = int(trainer.global_step)
        self.handle = watch(
            pl_module,
            self.recorder,
            optimizer=opts[0],
            start_step=self._last_step,
            **self.watch_kwargs,
        )
        clip = getattr(trainer, "gradient_clip_val", None)
        algo = getattr(trainer, "gradient_clip_algorithm", None) or "norm"
        self.handle.clipping = bool(clip) and str(algo).lower().endswith("norm")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        if step == self._last_step:  # an accumulation micro-batch: no optimizer step yet
            return
        self._last_step = step
        values: dict[str, float] = {}
        for k, v in trainer.callback_metrics.items():
            try:
                f = float(v)
            except (TypeError, ValueError):
                continue
            values[k if "/" in k else f"train/{k}"] = f
        if not values:
            return
        try:
            self.recorder.log(step - 1, values)
        except Exception as e:  # capture must not stop training
            if not self._warned:
                self._warned = True
                warnings.warn(f"traintape.lightning: metrics not logged: {e}", stacklevel=2)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


__all__ = ["Callback"]
