"""The one issue model every analysis reports (health, its rules, the architecture checks,
health over time and user checks).

An :class:`Issue` says what (``type``: an :class:`IssueType` of a built-in rule, or the
name of a user check), how bad (``severity``), where (``layer``: a layer, tensor, block or
attention path; None: the whole run), when (``step`` for one step; ``first_step`` /
``last_step`` / ``windows`` for an episode of consecutive windows of health over time),
what was measured (``message``, ``evidence``) and what to do (``recommendation``).

Severities: ``critical`` and ``warning`` make a layer (and the run) critical / warning;
``info`` is shown but never changes a status or a score (a healthy run may carry info).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import finite_float


class IssueType(StrEnum):
    """The issue types of the built-in rules (user checks name their own)."""

    VANISHING = "VANISHING"
    EXPLODING = "EXPLODING"
    DEAD = "DEAD"
    SATURATED = "SATURATED"
    DECAY_WITH_DEPTH = "DECAY_WITH_DEPTH"
    LAYER_IMBALANCE = "LAYER_IMBALANCE"
    ATTENTION_QKV_IMBALANCE = "ATTENTION_QKV_IMBALANCE"
    ACCUMULATING_GRAD = "ACCUMULATING_GRAD"
    NOT_UPDATED = "NOT_UPDATED"
    LR_TOO_SMALL = "LR_TOO_SMALL"
    NORM_STATS_FROZEN = "NORM_STATS_FROZEN"
    PERIODIC_LOSS = "PERIODIC_LOSS"
    TURBULENT = "TURBULENT"
    PRESSURE_SPIKE = "PRESSURE_SPIKE"
    ACCELERATING = "ACCELERATING"
    BOTTLENECK = "BOTTLENECK"
    RESIDUAL_DECAY = "RESIDUAL_DECAY"
    ATTENTION_FFN_IMBALANCE = "ATTENTION_FFN_IMBALANCE"
    ATTENTION_HEAD_IMBALANCE = "ATTENTION_HEAD_IMBALANCE"
    GATE_SATURATION = "GATE_SATURATION"
    FORGET_GATE_CLOSED = "FORGET_GATE_CLOSED"


class Status(StrEnum):
    """A layer's or a run's status (the worst severity of its issues; info counts as
    healthy)."""

    HEALTHY = "healthy"
    WARNING = "warning"
    CRITICAL = "critical"


class Severity(StrEnum):
    """How bad one issue is."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class Issue(BaseModel):
    """One finding of an analysis (see the module docstring)."""

    type: IssueType | str = Field(
        "CHECK", description="a built-in IssueType, or a user check's own name"
    )
    severity: Severity = Severity.WARNING
    layer: str | None = Field(None, description="layer, tensor, block or attention; None: run")
    message: str
    recommendation: str = ""
    step: int | None = Field(None, description="the step it concerns, if one")
    first_step: int | None = Field(None, description="health over time: first step of the episode")
    last_step: int | None = Field(None, description="health over time: last step of the episode")
    windows: int | None = Field(None, description="health over time: windows in the episode")
    evidence: dict[str, Any] = Field(default_factory=dict)


def clean_evidence(evidence: dict[str, Any]) -> dict[str, Any]:
    """``evidence`` with float values made JSON-safe (NaN/Inf → None)."""
    return {
        k: (finite_float(v) if isinstance(v, float | np.floating) else v)
        for k, v in evidence.items()
    }


def worst(severities: Iterable[str]) -> Status:
    """The status the ``severities`` give (``info`` counts as healthy)."""
    sev = set(severities)
    return (Status.CRITICAL if Status.CRITICAL in sev
            else Status.WARNING if Status.WARNING in sev else Status.HEALTHY)  # fmt: skip


class Recommendation(BaseModel):
    """One recommendation of a run, once, with every layer it applies to."""

    type: str
    severity: Severity = Field(description="the worst severity among its issues")
    recommendation: str
    layers: list[str] = Field(default_factory=list, description="'run' for run-level issues")


def recommendations(issues: Iterable[Issue]) -> list[Recommendation]:
    """Each distinct recommendation of ``issues`` once, with the layers it applies to (in
    order of first appearance; worst severity first)."""
    out: dict[tuple[str, str], Recommendation] = {}
    rank = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}
    for i in issues:
        if not i.recommendation:
            continue
        key = (str(i.type), i.recommendation)
        r = out.get(key)
        if r is None:
            r = out[key] = Recommendation(type=str(i.type), severity=i.severity,
                                          recommendation=i.recommendation)  # fmt: skip
        elif rank[i.severity] > rank[r.severity]:
            r.severity = i.severity
        where = i.layer or "run"
        if where not in r.layers:
            r.layers.append(where)
    return sorted(out.values(), key=lambda r: -rank[r.severity])


__all__ = [
    "Issue",
    "IssueType",
    "Recommendation",
    "Severity",
    "Status",
    "clean_evidence",
    "recommendations",
    "worst",
]
