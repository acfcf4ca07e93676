"""What a recorded tensor is, relative to optimizer step t: the closed set of kinds.

Step semantics are defined in ``docs/store-format.md`` ("Kinds and step semantics").
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    """What a recorded tensor is, relative to optimizer step t (docs/store-format.md).

    - ``param``: θ_t, the values used to compute the gradient of step t.
    - ``grad``: ∇L(θ_t) on batch t, after gradient accumulation.
    - ``update``: θ_{t+1} − θ_t as applied by the optimizer.
    - ``activation``: output of a parametrised layer on batch t, channels-last.
    - ``opt_state``: optimizer state after step t (e.g. Adam moments), parameter layout.
    """

    PARAM = "param"
    GRAD = "grad"
    UPDATE = "update"
    ACTIVATION = "activation"
    OPT_STATE = "opt_state"


ALL_KINDS: tuple[Kind, ...] = tuple(Kind)
