"""Checks of what a user hands the Recorder, made at the call (before anything is
recorded): a bad step, array or metric value raises :class:`RecordError` naming the
step, tensor or metric and the rule — it never reaches the writer thread, where it
would become a storage failure that disables capture."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from traintape.core.errors import RecordError

MAX_STEP = 2**63 - 1
"""Steps are stored as int64."""


def check_step(step: Any) -> int:
    """``step`` as an int if it is a non-negative integer that fits int64, else raise."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise RecordError(
            f"step must be a non-negative integer (the optimizer step), got {step!r} "
            f"({type(step).__name__})"
        )
    s = int(step)
    if s < 0 or s > MAX_STEP:
        raise RecordError(f"step must be between 0 and 2**63 - 1, got {s}")
    return s


def _numeric(dtype: np.dtype) -> bool:
    return dtype.kind in "fiub" or dtype.name == "bfloat16"


def check_array(name: str, kind: Any, value: Any, step: int) -> np.ndarray:
    """``value`` as a numpy array if it holds real numbers (float, int, bool, bfloat16).

    Complex, datetime, string and object arrays are refused naming the tensor.
    """
    try:
        a = np.asarray(value)
    except Exception as e:
        raise RecordError(
            f"tensor {name!r} ({getattr(kind, 'value', kind)}) at step {step}: cannot be "
            f"converted to an array: {type(e).__name__}: {e}"
        ) from e
    if not _numeric(a.dtype):
        raise RecordError(
            f"tensor {name!r} ({getattr(kind, 'value', kind)}) at step {step}: dtype "
            f"{a.dtype.name} is not supported; record real floating-point, integer or "
            f"bool arrays"
        )
    return a


def check_metric(name: str, value: Any, step: int) -> float:
    """``value`` as a float if it is a real number (NaN/Inf allowed: they raise an event)."""
    if isinstance(value, (str, bytes)) or not (
        isinstance(value, numbers.Real) or (isinstance(value, np.ndarray) and value.size == 1)
        or isinstance(value, np.generic) or hasattr(value, "__float__")
    ):  # fmt: skip
        raise RecordError(
            f"metric {name!r} at step {step}: value {value!r} ({type(value).__name__}) is "
            f"not a real number"
        )
    if isinstance(value, complex | np.complexfloating) or (
        isinstance(value, np.ndarray) and np.iscomplexobj(value)
    ):
        raise RecordError(
            f"metric {name!r} at step {step}: value {value!r} is complex; a metric is a "
            f"real number (log the real and imaginary parts, or the magnitude, as two metrics)"
        )
    try:
        return float(value)
    except OverflowError:
        raise RecordError(
            f"metric {name!r} at step {step}: value {value!r} does not fit a float64"
        ) from None
    except (TypeError, ValueError) as e:
        raise RecordError(
            f"metric {name!r} at step {step}: value {value!r} ({type(value).__name__}) is "
            f"not a real number: {e}"
        ) from e


_JSON_SCALARS = (str, bool, int, float, type(None))


def check_user(user: Any) -> dict[str, Any]:
    """The ``user=`` metadata as plain JSON values, or :class:`RecordError` naming the key.

    numpy scalars become Python numbers and small numpy arrays lists; NaN and ±Inf become
    the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (the manifest is strict JSON,
    which has no such numbers); keys must be strings.
    """
    if user is None:
        return {}
    if not isinstance(user, Mapping):
        raise RecordError(
            f"user must be a mapping of str to JSON values, got {type(user).__name__}"
        )
    return {_key(k): _json_value(v, f"user[{k!r}]") for k, v in user.items()}


def _key(k: Any) -> str:
    if not isinstance(k, str):
        raise RecordError(f"user keys must be strings, got {k!r} ({type(k).__name__})")
    return k


def _json_value(v: Any, where: str) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    elif isinstance(v, np.ndarray):
        if v.size > 10_000:
            raise RecordError(f"{where}: an array of {v.size} elements is too large for metadata")
        v = v.tolist()
    if isinstance(v, float):
        if v != v:
            return "NaN"
        if v in (float("inf"), float("-inf")):
            return "Infinity" if v > 0 else "-Infinity"
        return v
    if isinstance(v, _JSON_SCALARS):
        return v
    if isinstance(v, Mapping):
        return {_key(k): _json_value(x, f"{where}[{k!r}]") for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    raise RecordError(
        f"{where}: {type(v).__name__} is not a JSON value (use str, numbers, bools, None, "
        f"lists and dicts of them)"
    )
