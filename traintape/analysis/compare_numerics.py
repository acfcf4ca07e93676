"""The numerics behind ``compare``: unit roundoff, precision modes, noise floors, and how
an optimizer propagates a gradient's rounding into ``update`` and ``opt_state``.

Everything here is numpy over stat vectors (no store access); :mod:`.compare` reads the
stores and applies these rules. The derivations are written out in ``docs/compare.md``.

Notation: ``u`` the unit roundoff of the precision the runs computed in (half the
distance from 1 to the next number: float32 2⁻²⁴, bfloat16 2⁻⁸); ``G_k(t)`` the global
l2 norm of kind ``k`` at step ``t`` (sqrt of the sum of every tensor's squared ``l2``;
the larger of the two runs; ``opt_state`` per field, ``mu`` apart from ``nu``);
``k`` the position of a step among the common steps (0 for the first).

- **Noise floor** of a tensor of kind ``k`` at step ``t``: ``NOISE_FACTOR · u · G_k(t)``
  (``param``: ``u`` of its stored dtype).
  Rounding alone can give a tensor whose exact value is 0 (the key-projection bias
  gradient of attention, zero because softmax is shift-invariant) an l2 of this size.
  A tensor is **within noise** at a step when its ``l2`` is at or below the floor in
  both runs (its ``update`` and ``opt_state`` also when its ``grad`` is): it is equal
  there, except for its NaN/Inf counts. Scale-free statistics (``sig``, ``zero_frac``)
  are judged only for tensors above the floor in at least one run.
- **Precision mode** (``bf16``, ``fp16``, ``tf32``, ``fp32``, ``fp64``): per kind,
  ``rtol = min(RTOL_CAP, C_kind · u · sqrt(k + 1))`` and ``atol = u · G_kind(t) · sqrt(k + 1)``
  (metrics: ``atol = C · u · sqrt(k + 1)``), never below the calibrated float32 defaults
  (fp32) or the conformance suite's float64 column (fp64). Without a mode (and none
  recorded in the stores) the per-kind defaults apply, constant over steps.
- **Optimizer gain**: the update of a parameter moves by ``gain · δg`` when its gradient
  moves by ``δg``; ``gain`` is estimated per tensor and step as ``l2(update) / l2(m)``,
  ``m`` the first-moment state (``opt_state`` ``mu`` or ``trace``) where recorded, else
  the gradient. For Adam, ``update = −lr·m̂/(√v̂ + ε)``, so ``update/m`` is
  ``lr/((1 − β₁ᵗ)(√v̂ + ε))`` element by element: exactly the factor (times
  ``(1−β₁)/(1−β₁ᵗ) ≤ 1``) by which a gradient's rounding reaches the update, and large
  (up to lr/ε) where ``v̂`` is small. For SGD it is ``lr`` (``lr/(1−momentum)`` at most
  with momentum). ``update``'s absolute tolerance gains ``gain · δg``, ``δg`` the
  gradient difference the grad comparison allows for that tensor's ``l2``
  (``atol_grad + rtol_grad · l2(grad)``, plus the grad's noise floor where the grad is
  within noise). ``opt_state`` first moments gain ``l2(state)/l2(grad) · δg``; second
  moments (``nu``: ``v = β₂v + (1−β₂)g²``, so ``δv/v ≈ 2 δg/|g|``) gain
  ``2 · δg/l2(grad) · l2(nu)``. Where a second moment ``nu`` is recorded (Adam), the
  element with the smallest ``v`` amplifies most, by ``lr/(√v_min + ε)`` (lr estimated
  per step as the largest |update|, ε :data:`ASSUMED_EPS`, the element's rounding
  ``ELEMENT_ROUNDING · u · rms(grad)``): that allowance, at most ``2·lr``, widens the
  snapshots' atol per element and the statistics' by ``sqrt(numel)`` times it, at most
  :data:`ADAM_NOISE_SHARE` of the update's l2.
  A parameter accumulates its updates' allowed
  differences: ``param``'s absolute tolerance at step t gains the sum of ``update``'s
  (within noise: ``2 · max l2``) over the earlier compared steps.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from traintape.core.reader import Run

UNIT_ROUNDOFF: dict[str, float] = {
    "fp64": 2.0**-53,
    "fp32": 2.0**-24,
    "tf32": 2.0**-11,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
}
"""Unit roundoff ``u`` of each precision mode (tf32: matmul inputs keep 10 mantissa bits)."""

PRECISION_ALIASES: dict[str, str] = {
    "bf16": "bf16", "bfloat16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "16": "fp16", "16-mixed": "fp16",
    "16-true": "fp16", "tf32": "tf32", "tensorfloat32": "tf32",
    "fp32": "fp32", "float32": "fp32", "32": "fp32", "32-true": "fp32",
    "fp64": "fp64", "float64": "fp64", "double": "fp64", "64": "fp64", "64-true": "fp64",
}  # fmt: skip
"""Names a store or a user may give a precision (Lightning's ``precision`` strings too)."""

PRECISION_KEYS = ("precision", "mixed_precision", "compute_dtype", "amp_dtype")
"""``manifest.user`` keys read as the run's compute precision (first found wins)."""

NOISE_FACTOR = 1.0
"""Noise floor = NOISE_FACTOR · u · G_k(t). Calibrated on the GPT port
(tests/test_compare_ports.py): the key-bias gradient (zero in exact arithmetic) records
0.03–0.1 · u · G_grad of rounding noise, in float32 (NNX and torch) and under bf16
autocast alike, while the smallest gradient that is signal sits at 9 · u · G_grad under
bf16 (and 6e5 · u · G_grad in float32): a factor of 1 leaves ~10x each side. ``param``
uses the unit roundoff of its stored dtype (master weights stay float32 under mixed
precision)."""
RTOL_FACTOR: dict[str, float] = {
    "param": 4.0, "activation": 16.0, "grad": 16.0, "update": 16.0, "opt_state": 16.0,
    "metrics": 4.0,
}  # fmt: skip
"""``C_kind`` of the precision rule ``rtol = C_kind · u · sqrt(k + 1)``: params are
stored values (a few roundings per step); activations, gradients and what the optimizer
derives from them are results of long reduction chains."""
RTOL_CAP = 0.25
"""Largest relative tolerance a precision mode grows to (a tensor 25% off is a bug)."""

FLOAT64_TOLERANCES: dict[str, tuple[float, float]] = {
    "param": (1e-13, 1e-12), "grad": (1e-13, 1e-11), "update": (1e-14, 1e-11),
    "activation": (1e-12, 1e-11), "opt_state": (1e-14, 1e-11), "metrics": (1e-13, 1e-12),
}  # fmt: skip
"""The lower bound of fp64 mode: the conformance suite's float64 column (atol, rtol)."""

ASSUMED_EPS = 1e-8
"""Adam's ε where the store does not say (torch, optax and most trainers default to 1e-8;
Keras 1e-7: a larger ε only lowers the true gain, so assuming 1e-8 errs loose)."""
ADAM_NOISE_SHARE = 0.1
"""The most of a tensor's update l2 that Adam-amplified rounding may account for in its
statistics (every element at the worst gain would be ``sqrt(numel)`` times the
per-element allowance: for a large embedding that exceeds the update itself, and the
statistics — and the params that accumulate them — would judge nothing)."""
ELEMENT_ROUNDING = 4.0
"""An element's gradient rounding, in units of ``u · rms(grad)`` of its tensor (a few
roundings of terms of the tensor's typical size)."""

SECOND_MOMENTS = frozenset({"nu", "exp_avg_sq", "v", "velocity"})
"""``opt_state`` fields that are running means of g² (their error is relative to g)."""
FIRST_MOMENTS = ("mu", "trace", "momentum", "exp_avg", "m")
"""``opt_state`` fields linear in g, in the order the optimizer gain looks for them."""


class Precision(BaseModel):
    """The precision a comparison assumes, and where that came from."""

    mode: str | None = Field(description="bf16, fp16, tf32, fp32, fp64; None: default tolerances")
    unit_roundoff: float = Field(description="u of the mode (of the stored dtype without one)")
    source: str = Field(description="'--precision', a store's manifest, the dtypes, or default")


def normalise_precision(name: str) -> str:
    """``'bfloat16'``, ``'bf16-mixed'`` ... → ``'bf16'``; ValueError naming the choices."""
    key = str(name).strip().lower()
    if key not in PRECISION_ALIASES:
        raise ValueError(f"precision {name!r}: use one of {sorted(UNIT_ROUNDOFF)}")
    return PRECISION_ALIASES[key]


def _recorded_precision(run: Run) -> str | None:
    user = run.manifest.user or {}
    for key in PRECISION_KEYS:
        if key in user and user[key] is not None:
            try:
                return normalise_precision(str(user[key]))
            except ValueError:
                continue
    dtypes = {s.dtype for s in run.manifest.tensors}
    for dtype, mode in (("bfloat16", "bf16"), ("float16", "fp16")):
        if dtype in dtypes:
            return mode
    return None


def resolve_precision(runs: Sequence[Run], given: str | None) -> Precision:
    """``given`` (``--precision``) wins; else the coarser precision either store records
    (``manifest.user['precision']``, ``'mixed_precision'`` ...; or tensors stored in
    bfloat16/float16); else no mode, with ``u`` of the stored float dtype (float64 only
    if every tensor is float64)."""
    if given is not None:
        mode = normalise_precision(given)
        return Precision(mode=mode, unit_roundoff=UNIT_ROUNDOFF[mode], source="--precision")
    found = [(m, r.url) for r in runs if (m := _recorded_precision(r)) is not None]
    if found:
        mode, url = max(found, key=lambda f: UNIT_ROUNDOFF[f[0]])
        return Precision(mode=mode, unit_roundoff=UNIT_ROUNDOFF[mode], source=f"recorded in {url}")
    dtypes = {s.dtype for r in runs for s in r.manifest.tensors}
    u = UNIT_ROUNDOFF["fp64"] if dtypes and dtypes <= {"float64"} else UNIT_ROUNDOFF["fp32"]
    return Precision(mode=None, unit_roundoff=u, source="default (stored dtype)")


def kind_tolerance(
    kind: str,
    precision: Precision,
    position: np.ndarray,
    scale: np.ndarray,
    base: tuple[float, float],
) -> tuple[np.ndarray, np.ndarray]:
    """(atol, rtol) of ``kind`` at each of ``n`` steps: ``position`` [n] their positions
    among the common steps, ``scale`` [n] the kind's global norm ``G_kind(t)`` (ignored
    for metrics), ``base`` the (atol, rtol) without a mode (the defaults, or what the
    caller set). Without a mode: ``base``, constant. With one: see the module docstring."""
    pos = np.asarray(position, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    if precision.mode is None:
        return np.full(scale.shape, base[0]), np.full(pos.shape, base[1])
    u, grow = precision.unit_roundoff, np.sqrt(pos + 1.0)
    rtol = np.minimum(RTOL_CAP, RTOL_FACTOR[kind] * u * grow)
    grown = grow.reshape(grow.shape + (1,) * (scale.ndim - 1))
    if kind == "metrics":
        atol = RTOL_FACTOR[kind] * u * grown * np.ones_like(scale)
    else:
        atol = u * scale * grown
    floor = {"fp32": base, "fp64": FLOAT64_TOLERANCES[kind]}.get(precision.mode)
    if floor is not None:
        atol, rtol = np.maximum(atol, floor[0]), np.maximum(rtol, floor[1])
    return atol, rtol


def global_norm(l2: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
    """Per row, sqrt(sum l2²) over the tensors [rows, tensors] (NaN = not recorded);
    with ``groups`` [tensors] (ints), per group: returns [rows, tensors] (each tensor
    gets its group's norm)."""
    sq = np.where(np.isfinite(l2), l2, 0.0) ** 2
    if groups is None:
        return np.sqrt(sq.sum(axis=1))
    out = np.zeros_like(sq)
    for g in np.unique(groups):
        cols = groups == g
        out[:, cols] = np.sqrt(sq[:, cols].sum(axis=1))[:, None]
    return out


def field_groups(names: Sequence[str]) -> np.ndarray:
    """Group index per opt_state tensor by its field (last name segment)."""
    fields = [n.rpartition("/")[2] for n in names]
    index = {f: i for i, f in enumerate(dict.fromkeys(fields))}
    return np.array([index[f] for f in fields], dtype=np.int64)


def gain(update_l2: np.ndarray, moment_l2: np.ndarray) -> np.ndarray:
    """Optimizer gain estimates ``l2(update)/l2(m)`` for both runs → the smaller finite
    positive one (a planted change in one run cannot loosen its own tolerance); 0 where
    neither is defined. Arrays [2, rows]."""
    with np.errstate(all="ignore"):
        r = np.abs(update_l2) / np.abs(moment_l2)
    r = np.where(np.isfinite(r) & (r > 0), r, np.inf)
    out = r.min(axis=0)
    return np.where(np.isfinite(out), out, 0.0)


def excluded(name: str, patterns: Iterable[str]) -> bool:
    """``fnmatch`` globs (``*`` crosses ``/``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def explain_rules(precision: Precision, kinds: dict[str, dict[str, Any]]) -> list[str]:
    """The rule and the numbers used per kind, as lines of text (``compare --explain``)."""
    u = precision.unit_roundoff
    mode = precision.mode or "none (default tolerances, constant over steps)"
    lines = [
        f"precision: {mode}; unit roundoff u = {u:.3g} ({precision.source})",
        f"noise floor of a tensor of kind k at step t: {NOISE_FACTOR:g} * u * G_k(t) "
        f"= {NOISE_FACTOR * u:.3g} * G_k(t) (param: u of its stored dtype), G_k(t) the "
        "kind's global l2 (larger run; "
        "opt_state per field). Within noise in both runs: equal (NaN/Inf counts still "
        "compared); sig and zero_frac judged only above the floor in at least one run.",
        "a stat agrees when |a - b| <= atol + rtol*|b|; sig: atol/l2 + max(atol0, rtol) + "
        "rtol*|sig_b| (its error is the data's relative error); zero_frac: "
        "max(1, rtol*numel)/numel + max(atol0, rtol); nan_count, inf_count: exactly.",
    ]
    if precision.mode is not None:
        lines.append(
            f"precision rule: rtol = min({RTOL_CAP:g}, C_kind * u * sqrt(k+1)), atol = "
            "u * G_kind(t) * sqrt(k+1) (metrics: C * u * sqrt(k+1)); k = position among "
            "the common steps"
            + (
                ", never below the fp32 defaults"
                if precision.mode == "fp32"
                else ", never below the float64 conformance column"
                if precision.mode == "fp64"
                else ""
            )
        )
    lines.append(
        "update: atol += gain * dg, gain = l2(update)/l2(mu|trace|grad) (Adam: "
        "lr/((1-b1^t)(sqrt(v_hat)+eps)); the smaller of the two runs), dg = atol_grad + "
        "rtol_grad*l2(grad) (+ grad noise floor where the grad is within noise); "
        "opt_state first moments: += l2(state)/l2(grad)*dg; second moments (nu): "
        "+= 2*dg/l2(grad)*l2(nu); param: += the sum of the earlier updates' allowances."
    )
    for kind, info in kinds.items():
        parts = [f"{k} {_fmt(v)}" for k, v in info.items()]
        lines.append(f"  {kind}: " + ", ".join(parts))
    return lines


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)
