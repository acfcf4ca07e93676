"""Capture policy: which steps, tensors and kinds are recorded, and when in full."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from traintape.schema.kinds import ALL_KINDS, Kind

__all__ = ["ALL_KINDS", "CapturePolicy", "Kind", "StepPlan"]


class StepPlan(BaseModel):
    """What the policy asks for at one optimizer step (:meth:`CapturePolicy.plan`)."""

    model_config = ConfigDict(frozen=True)

    step: int
    kinds: frozenset[Kind] = Field(description="kinds whose stat vectors are recorded")
    snapshot_kinds: frozenset[Kind] = Field(description="kinds written in full as well")

    @property
    def captures(self) -> bool:
        return bool(self.kinds)

    def wants(self, kind: Kind | str) -> bool:
        return Kind(kind) in self.kinds

    def snapshots(self, kind: Kind | str) -> bool:
        return Kind(kind) in self.snapshot_kinds


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
    snapshot_budget_bytes: int | None = Field(
        None,
        gt=0,
        description="host memory (bytes) that snapshots waiting for the writer may hold; a "
        "full capture that would exceed it is skipped (stats rows never are) and recorded "
        "as a snapshot_skipped event. None: no limit but the writer's max_pending_bytes",
    )
    snapshot_budget_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="the same budget as a fraction of the host memory available at the "
        "time (psutil); with both set, the smaller applies",
    )
    include: tuple[str, ...] = Field(("*",), description="globs of canonical names to record")
    exclude: tuple[str, ...] = Field((), description="globs of canonical names to skip")

    def captures(self, step: Any) -> Any:
        """True if stat vectors are recorded at optimizer step ``step`` (a Python int, or
        a traced JAX/TF integer: then a traced boolean — the one formula for both)."""
        return step % self.every == 0

    def is_full(self, step: Any) -> Any:
        """True if ``step`` is a full-capture (snapshot) step (traced steps as above; a
        policy without ``full_every`` gives False)."""
        if self.full_every is None:
            return False
        return step % self.full_every == 0

    def plan(self, step: int) -> StepPlan:
        """What to record at optimizer step ``step`` (host-side int)."""
        if not self.captures(step):
            return StepPlan(step=step, kinds=frozenset(), snapshot_kinds=frozenset())
        kinds = frozenset(self.kinds)
        full = (
            frozenset(k for k in self.snapshot_kinds if k in kinds)
            if self.is_full(step)
            else frozenset()
        )
        return StepPlan(step=step, kinds=kinds, snapshot_kinds=full)

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
