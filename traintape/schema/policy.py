"""Capture policy: which steps, tensors and kinds are recorded, and when in full."""

from __future__ import annotations

from enum import StrEnum
from fnmatch import fnmatchcase

from pydantic import BaseModel, ConfigDict, Field


class Kind(StrEnum):
    """What a recorded tensor is, relative to optimizer step t (see DESIGN: step semantics).

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


class CapturePolicy(BaseModel):
    """When and what to record. Pure data: adapters and the Recorder ask it questions.

    Step ``t`` is captured (stat vectors) when ``t % every == 0``; it is a full-capture
    step (whole tensors written as snapshots) when ``full_every`` is set and
    ``t % full_every == 0``. A tensor is selected when its canonical name matches one of
    ``include`` and none of ``exclude`` (``fnmatch`` globs, ``*`` also crosses ``/``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    every: int = Field(1, ge=1, description="record stat vectors every N optimizer steps")
    full_every: int | None = Field(
        None, ge=1, description="write full snapshots every N steps (None: never)"
    )
    kinds: tuple[Kind, ...] = Field(
        (Kind.PARAM, Kind.GRAD, Kind.UPDATE, Kind.ACTIVATION),
        description="kinds recorded at all",
    )
    snapshot_kinds: tuple[Kind, ...] = Field(
        (Kind.PARAM, Kind.GRAD, Kind.UPDATE, Kind.ACTIVATION),
        description="kinds written as full snapshots on full-capture steps",
    )
    include: tuple[str, ...] = Field(("*",), description="globs of canonical names to record")
    exclude: tuple[str, ...] = Field((), description="globs of canonical names to skip")

    def captures(self, step: int) -> bool:
        """True if stat vectors are recorded at optimizer step ``step``."""
        return step % self.every == 0

    def is_full(self, step: int) -> bool:
        """True if ``step`` is a full-capture (snapshot) step."""
        return self.full_every is not None and step % self.full_every == 0

    def records_kind(self, kind: Kind | str) -> bool:
        return Kind(kind) in self.kinds

    def snapshots(self, step: int, kind: Kind | str) -> bool:
        """True if tensors of ``kind`` are written in full at ``step``."""
        return self.is_full(step) and Kind(kind) in self.snapshot_kinds and self.records_kind(kind)

    def selects(self, name: str) -> bool:
        """True if the canonical tensor ``name`` passes the include/exclude globs."""
        return any(fnmatchcase(name, g) for g in self.include) and not any(
            fnmatchcase(name, g) for g in self.exclude
        )
