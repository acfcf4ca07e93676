"""Optimizer state (kind ``opt_state``) of a torch optimizer, under optax's field names.

Every parameter-shaped tensor in ``optimizer.state[p]`` after step t is recorded under
``<parameter canonical name>/<field>`` with the parameter's row block and permutation.
Fields use optax's state names so stores agree with the JAX adapter (see
:data:`OPTAX_FIELDS`); other optimizers keep torch's key. The set is fixed at the first
captured step with any state; a parameter with no state yet is recorded as zeros
(optax's initial state); state that appears later is warned about, not recorded.
"""

from __future__ import annotations

import warnings

import torch

from traintape.adapters.torch.host import numpy_dtype_name
from traintape.adapters.torch.names import ParamEntry
from traintape.core.naming import canonical_name
from traintape.core.recorder import Recorder
from traintape.schema import Kind, TensorSpec

OPTAX_FIELDS: dict[str, dict[str, str]] = {
    "Adam": {"exp_avg": "mu", "exp_avg_sq": "nu", "max_exp_avg_sq": "nu_max"},
    "AdamW": {"exp_avg": "mu", "exp_avg_sq": "nu", "max_exp_avg_sq": "nu_max"},
    "NAdam": {"exp_avg": "mu", "exp_avg_sq": "nu"},
    "RAdam": {"exp_avg": "mu", "exp_avg_sq": "nu"},
    "Adamax": {"exp_avg": "mu", "exp_inf": "nu"},
    "SGD": {"momentum_buffer": "trace"},
    "RMSprop": {"square_avg": "nu", "grad_avg": "mu", "momentum_buffer": "trace"},
    "Adagrad": {"sum": "sum_of_squares"},
    "Adadelta": {"square_avg": "e_g", "acc_delta": "e_x"},
}
"""torch optimizer class name → {``optimizer.state[p]`` key → optax state field}: the
canonical ``opt_state`` leaf of each state tensor (``<param>/<field>``), the name the
JAX adapter gives the equivalent optax state (``optax.adam`` → ``mu``/``nu``,
``optax.sgd(momentum=...)`` → ``trace``, ...). Looked up along the optimizer's MRO;
keys of other optimizers keep their torch name."""


def opt_state_field(optimizer: torch.optim.Optimizer, key: str) -> str:
    """Canonical ``opt_state`` leaf of ``optimizer.state[p][key]`` (see :data:`OPTAX_FIELDS`)."""
    for cls in type(optimizer).__mro__:
        table = OPTAX_FIELDS.get(cls.__name__)
        if table is not None and cls.__module__.startswith("torch.optim"):
            return table.get(key, key)
    return key


class OptStateLeaf:
    """One recorded optimizer-state tensor: ``optimizer.state[entry param][key]``."""

    __slots__ = ("dtype", "entry", "key", "name")

    def __init__(self, entry: ParamEntry, key: str, name: str, dtype: torch.dtype) -> None:
        self.entry, self.key, self.name, self.dtype = entry, key, name, dtype

    def read(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The entry's row block of the state tensor (source layout), None if absent.

        ``state.get``: never creates an entry in the optimizer's ``defaultdict``.
        """
        v = self.whole(optimizer)
        return None if v is None else self.entry.part(v)

    def whole(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The whole state tensor of the entry's parameter (a DTensor under FSDP2), None
        if absent."""
        st = optimizer.state.get(self.entry.tensor())
        v = None if st is None else st.get(self.key)
        return v.detach() if isinstance(v, torch.Tensor) else None


class OptStateTracker:
    """Finds, declares and reads the ``opt_state`` tensors of ``optimizer`` for the
    trainable parameter ``entries``."""

    def __init__(self, optimizer: torch.optim.Optimizer, entries: list[ParamEntry]) -> None:
        self.optimizer = optimizer
        self.entries = entries
        self._leaves: list[OptStateLeaf] | None = None
        self._warned: set[str] = set()

    def leaves(self, rec: Recorder) -> list[OptStateLeaf]:
        """The recorded state tensors (declared to ``rec`` on the first call that finds
        any; empty while the optimizer holds no parameter-shaped state yet)."""
        if self._leaves is None and not self._declare(rec):
            return []
        self._warn_new()
        return self._leaves or []

    def _find(self) -> list[tuple[ParamEntry, str, torch.Tensor]]:
        """(entry, key, state tensor) of every parameter-shaped optimizer-state tensor.

        A key is taken when its tensor has the parameter's shape; ``step`` and, for a
        0-d parameter, keys unknown to :data:`OPTAX_FIELDS` (scalar counters such as
        NAdam's ``mu_product``) are skipped.
        """
        opt = self.optimizer
        out = []
        for e in self.entries:
            p = e.tensor()
            st = opt.state.get(p)
            if not st:
                continue
            for key, v in st.items():
                if key == "step" or not isinstance(v, torch.Tensor) or v.shape != p.shape:
                    continue
                if p.ndim == 0 and opt_state_field(opt, key) == key:
                    continue
                out.append((e, key, v))
        return out

    def _declare(self, rec: Recorder) -> bool:
        """Fix and declare the ``opt_state`` tensors (first captured step with any state).

        Returns False while the optimizer holds no parameter-shaped state yet.
        """
        found = self._find()
        if not found:
            return False
        opt = self.optimizer
        leaves: list[OptStateLeaf] = []
        specs: list[TensorSpec] = []
        for e, key, v in found:
            field = opt_state_field(opt, key)
            source = f"{e.source_name}:{key}"
            name = canonical_name([e.name, field], None, source)
            leaves.append(OptStateLeaf(e, key, name, v.dtype))
            specs.append(  # as in the JAX adapter, the parameter is the "layer"
                TensorSpec.build(
                    name,
                    Kind.OPT_STATE,
                    dtype=numpy_dtype_name(v.dtype),
                    shape=e.shape,
                    source_name=source,
                    source_shape=e.source_shape,
                    permutation=e.permutation,
                )
            )
        rec.declare(specs)
        self._leaves = leaves
        return True

    def _warn_new(self) -> None:
        known = {(id(leaf.entry), leaf.key) for leaf in self._leaves or []}
        for e, key, _ in self._find():
            tag = f"{e.name}:{key}"
            if (id(e), key) not in known and tag not in self._warned:
                self._warned.add(tag)
                warnings.warn(
                    f"traintape.torch: optimizer state {key!r} of {e.name!r} first appeared "
                    f"after the opt_state set was declared; it is not recorded",
                    stacklevel=4,
                )
