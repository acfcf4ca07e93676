"""``grad`` as the backward pass produced it, and the clip factor applied after it.

docs/store-format.md defines ``grad`` as the gradient after accumulation and the
data-parallel reduction, *before* clipping or any other change on the way to the
optimizer. Training loops change ``p.grad`` in place between the end of backward and
``optimizer.step()``: ``clip_grad_norm_`` scales every gradient by one factor
``c = min(1, max_norm / (total_norm + 1e-6))``; AMP's ``GradScaler.unscale_`` divides
by the loss scale ``S`` (a power of two). The torch adapter therefore takes the
gradient's raw statistics at the **end of each backward pass** (an autograd engine
callback, queued from a gradient hook — the mechanism DDP finalises its reduction with;
re-queued once so it runs after the callbacks DDP/FSDP queue during the backward pass:
the gradients are reduced then). The last backward pass of a step leaves the gradient
accumulated over its micro-batches.

At the optimizer step, if every gradient is the same tensor at the same in-place
version counter as at the end of backward (:func:`versions`), nothing changed and
nothing more is read. Otherwise — and on full-capture steps, whose ``grad`` snapshots
are read from ``p.grad`` then, and for DTensor gradients, whose counters FSDP2's
``clip_grad_norm_`` does not bump — :func:`norm_pairs` takes every gradient's L2 norm
again (one pass of the same reduction as at the end of backward) and :func:`clip_factor` compares
them with the norms at the end of backward, on the host with the step's one transfer:
one common ratio ``r`` is a uniform rescale, ``r = c / S``, with ``S`` the loss scale
of a ``GradScaler`` stepping this optimizer (found on the call stack:
``GradScaler.step`` calls ``optimizer.step``; 1 without one). The recorded
``grad`` is then the end-of-backward statistics divided by ``S`` (exact: a power of two)
and ``c`` is logged as the run metric ``grad/clip_factor``. A change that is not one
common factor (``clip_grad_value_``, per-parameter clipping, edited gradients) leaves
``grad`` as backward produced it (divided by ``S``) and logs no factor, with a warning
once per watch. A change made through ``p.grad.data`` (which has a counter of its own)
is seen on full-capture steps only; ``grad``'s statistics are the backward's either way.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch

from traintape.adapters.torch.stats import raw_stats
from traintape.schema.stats import RAW_INDEX

RATIO_RTOL = 1e-4
"""Largest relative spread of the per-tensor norm ratios still called one common factor
(the two norms come from different reductions: float32 rounding, ~1e-7)."""


def queue_end_of_backward(fn: Any) -> None:
    """Run ``fn()`` once the current backward pass has finished, after the callbacks
    queued during it (DDP's reduction finaliser, FSDP2's post-backward): a callback that
    queues ``fn`` behind them. Call from inside a backward pass (a gradient hook)."""
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    engine.queue_callback(lambda: engine.queue_callback(fn))


def versions(tensors: list[torch.Tensor]) -> tuple[tuple[int, int] | None, ...] | None:
    """Identity and in-place version counter of each tensor's ``.grad`` (None: no grad):
    unchanged means no gradient was replaced or changed in place through the tensor
    itself. None when that cannot be told: a DTensor gradient (FSDP2's
    ``clip_grad_norm_`` changes its local tensor without bumping a counter)."""
    out: list[tuple[int, int] | None] = []
    for p in tensors:
        g = p.grad
        if g is None:
            out.append(None)
        elif type(g) is not torch.Tensor and hasattr(g, "_local_tensor"):
            return None
        else:
            out.append((id(g), int(g._version)))
    return tuple(out)


def _scaler_step_codes() -> tuple[Any, ...]:
    """Code objects of ``GradScaler``'s methods that call ``optimizer.step``."""
    try:
        from torch.amp import GradScaler
    except ImportError:  # pragma: no cover
        return ()
    names = ("step", "_maybe_opt_step")
    return tuple(getattr(GradScaler, n).__code__ for n in names if hasattr(GradScaler, n))


_SCALER_CODES: tuple[Any, ...] | None = None


def grad_scaler_in_stack() -> Any:
    """The ``torch.amp.GradScaler`` whose ``step`` is calling the optimizer, if any (its
    frame is on the stack of the optimizer's step hooks: Accelerate's and Lightning's
    optimizer steps go through it too). Frames are matched by code object: cheap."""
    global _SCALER_CODES
    if _SCALER_CODES is None:
        _SCALER_CODES = _scaler_step_codes()
    f: Any = sys._getframe(1)
    for _ in range(64):
        if f is None:
            return None
        if f.f_code in _SCALER_CODES:
            return f.f_locals.get("self")
        f = f.f_back
    return None


def raw_l2(raw: torch.Tensor) -> torch.Tensor:
    """Per-row L2 norm ``[n]`` float64 of raw rows ``[n, N_RAW]`` (undoing ``exp``)."""
    sumsq = raw[:, RAW_INDEX["sumsq"]]
    return torch.sqrt(sumsq) * torch.exp2(raw[:, RAW_INDEX["exp"]])


def scale_raw(raw: torch.Tensor, f: float) -> torch.Tensor:
    """Raw rows of the tensors times ``f > 0``: first-power sums, min/max times ``f``,
    second-power sums times ``f**2`` (exact when ``f`` is a power of two)."""
    out = raw.clone()
    for name in ("sum", "abs_sum", "sig", "min", "max"):
        out[:, RAW_INDEX[name]] *= f
    for name in ("m2", "sumsq"):
        out[:, RAW_INDEX[name]] *= f * f
    return out


def norm_pairs(before: torch.Tensor, now: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``[2, k]`` float64 on the device: the L2 norms of the parts ``now`` (the
    gradients at the optimizer step, None for no gradient; one raw-stats pass) and
    of the same tensors at the end of backward (from the raw rows ``before``), for the
    k parts with elements; None when there are none. Nothing is synchronised."""
    idx = [i for i, x in enumerate(now) if x is not None and x.numel()]
    if not idx:
        return None
    xs = [now[i] for i in idx]
    # the same reduction as at the end of backward (float64 sums; the C kernel on CPU):
    # a float32 norm drifts ~1e-4 over millions of elements, a float64 one costs a copy
    a = raw_l2(raw_stats(xs)).to(before.device)
    b = raw_l2(before)
    return torch.stack([a, b if len(idx) == len(now) else b[idx]])


def loss_scale() -> float:
    """The loss scale of the ``GradScaler`` stepping the optimizer (1.0 without one):
    call from the optimizer's step hooks."""
    scaler = grad_scaler_in_stack()
    if scaler is not None and scaler.is_enabled():
        return float(scaler.get_scale())
    return 1.0


def clip_factor(pairs: np.ndarray | None, amp: float) -> float | None:
    """The common factor ``c`` the gradients were scaled by between the end of backward
    and the optimizer step beyond AMP's ``1/amp`` (1.0: unchanged; :func:`norm_pairs`
    on the host), or None when the change was not one common factor. ``c`` is the ratio
    of the global norms, ``‖now‖ / ‖before‖`` (exactly the factor of a uniform rescale);
    every tensor's own ratio must agree with it within :data:`RATIO_RTOL`."""
    if pairs is None:
        return 1.0
    now, before = pairs[0].tolist(), pairs[1].tolist()  # a few floats: no numpy per step
    ok = [(a, b) for a, b in zip(now, before, strict=True) if b > 0 and math.isfinite(a + b)]
    if not ok:
        return 1.0
    r = math.sqrt(sum(a * a for a, _ in ok) / sum(b * b for _, b in ok))
    if any(abs(a - r * b) > RATIO_RTOL * r * b for a, b in ok):
        return None
    c = r * amp
    if abs(c - 1.0) <= 1e-6:
        return 1.0
    return c if math.isfinite(c) else None
