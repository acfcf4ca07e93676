"""Optimizer state (kind ``opt_state``) of a Keras 3 optimizer, under optax's field names.

A Keras optimizer keeps one slot variable per trainable variable in lists built by
``add_optimizer_variables`` (``Adam._momentums``, ``SGD.momentums``...), indexed by
``optimizer._get_variable_index(variable)``. After step t every slot of a recorded
parameter is recorded under ``<parameter canonical name>/<field>`` in the parameter's
canonical layout (the slot goes through the parameter's transform: GRU gate permutation,
attention head reshape), with the names the torch and JAX adapters give the same
optimizers' state (:data:`KERAS_FIELDS`). Lists of other optimizers keep their
attribute name (leading underscores dropped); slots not shaped like their parameter
(Adafactor's factored rows/columns) are not recorded. Not recorded: the gradient
accumulators of ``gradient_accumulation_steps`` and the EMA weights of ``use_ema``.

Values are Keras's own. They equal torch's/optax's where the update rules keep the
same quantity (Adam/AdamW/Nadam/Lamb ``mu``/``nu``, RMSprop ``nu``/``mu``, Adagrad,
Adadelta, Lion); two momentum buffers hold a different one under the same name:

- SGD ``trace``: Keras keeps the velocity ``m ← μ·m − lr·g`` (θ += m), torch and optax
  the trace of gradients ``b ← μ·b + g`` (θ −= lr·b): for a constant lr, Keras's
  ``trace`` = −lr × theirs.
- RMSprop ``trace``: Keras accumulates ``lr·g/√(ν+ε)`` (θ −= m), torch
  ``g/(√ν+ε)`` (no lr), optax ``−lr·g/(√ν+ε)``.

An LSTM's ``bias_hh`` (pinned at zero, module :mod:`.names`) gets the Keras bias's
slots: its gradient is the bias's, so these equal the ``bias_hh`` state of the torch LSTM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras

from traintape.core.naming import canonical_name
from traintape.schema import Kind, TensorSpec

from .names import Entry

KERAS_FIELDS: dict[str, dict[str, str]] = {
    "Adam": {"_momentums": "mu", "_velocities": "nu", "_velocity_hats": "nu_max"},
    "Nadam": {"_momentums": "mu", "_velocities": "nu"},
    "Lamb": {"_momentums": "mu", "_velocities": "nu"},
    "Adamax": {"_m": "mu", "_u": "nu"},
    "Lion": {"_momentums": "mu"},
    "SGD": {"momentums": "trace"},
    "RMSprop": {"_velocities": "nu", "_average_gradients": "mu", "_momentums": "trace"},
    "Adagrad": {"_accumulators": "sum_of_squares"},
    "Adadelta": {"_accumulated_grads": "e_g", "_accumulated_delta_vars": "e_x"},
}
"""Keras optimizer class name → {slot list attribute → optax state field} (looked up
along the MRO, so ``AdamW`` takes ``Adam``'s): ``keras.optimizers.Adam`` ``momentums``/
``velocities`` → ``mu``/``nu`` as ``optax.adam`` and torch ``exp_avg``/``exp_avg_sq``,
SGD ``momentums`` → ``trace`` as ``optax.sgd(momentum=...)`` and torch
``momentum_buffer`` (a different quantity, see the module docstring), ..."""

_NOT_STATE = frozenset(
    {"_variables", "_trainable_variables", "_accumulated_gradients",
     "_model_variables_moving_average"}
)  # fmt: skip


def _fields(optimizer: Any) -> dict[str, str]:
    for cls in type(optimizer).__mro__:
        table = KERAS_FIELDS.get(cls.__name__)
        if table is not None and cls.__module__.startswith("keras"):
            return table
    return {}


def slot_lists(optimizer: Any) -> list[tuple[str, Sequence[Any]]]:
    """``(field, slots)`` of every per-variable slot list of a built ``optimizer``
    (``slots[i]`` belongs to ``optimizer._trainable_variables[i]``, None for a variable
    without that slot); the fields of :data:`KERAS_FIELDS` first, in its order."""
    opt = getattr(optimizer, "inner_optimizer", None) or optimizer  # LossScaleOptimizer
    n = len(getattr(opt, "_trainable_variables", ()))
    if not getattr(opt, "built", False) or not n:
        return []
    table = _fields(opt)
    found: dict[str, tuple[str, Sequence[Any]]] = {}
    for attr, val in vars(opt).items():
        if attr in _NOT_STATE or not isinstance(val, (list, tuple)) or len(val) != n:
            continue
        if not all(v is None or isinstance(v, keras.Variable) for v in val):
            continue
        if all(v is None for v in val):
            continue
        found[attr] = (table.get(attr, attr.lstrip("_")), val)
    order = [a for a in table if a in found] + [a for a in found if a not in table]
    return [found[a] for a in order]


@dataclass(frozen=True)
class Slot:
    """One recorded slot: ``variable`` (Keras's) seen through ``entry``'s transform."""

    name: str
    entry: Entry
    variable: Any
    spec: TensorSpec

    def read(self) -> Any:
        """The slot in the parameter's canonical layout (in-graph safe; never zeroed)."""
        return self.entry.transform.tf(keras.ops.convert_to_tensor(self.variable))


def find_slots(optimizer: Any, entries: Sequence[Entry]) -> list[Slot]:
    """The recorded slots of ``entries`` (parameters of ``optimizer``), per entry in
    field order; empty until the optimizer is built."""
    opt = getattr(optimizer, "inner_optimizer", None) or optimizer
    lists = slot_lists(opt)
    if not lists:
        return []
    out: list[Slot] = []
    for e in entries:
        try:
            i = opt._get_variable_index(e.variable)
        except (KeyError, AttributeError):
            continue
        src = tuple(int(d) for d in e.variable.shape)
        path = str(getattr(e.variable, "path", ""))
        own = not e.zero and path and e.source_name.startswith(path)
        suffix = e.source_name[len(path) :] if own else ""  # GRU bias rows: [0], [1]
        for field, slots in lists:
            v = slots[i]
            if v is None or tuple(int(d) for d in v.shape) != src:
                continue
            source = f"{v.path}{suffix}"
            name = canonical_name([e.name, field], None, source)
            spec = TensorSpec.build(  # as in the torch and JAX adapters, the parameter is the layer
                name, Kind.OPT_STATE, dtype=keras.backend.standardize_dtype(v.dtype), shape=e.shape,
                source_name=source, source_shape=src,
            )  # fmt: skip
            out.append(Slot(name, e, v, spec))
    return out
