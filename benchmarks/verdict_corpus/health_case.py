"""What a health case of the verdict corpus is: a recorded training and its right verdict.

A :class:`HealthCase` records one real training with traintape's adapters into a store
(``record(workdir) -> store path``) and says what ``health``/``anomalies`` should find:

- a *healthy* case (``expect`` empty): no critical or warning health issue and no error
  or warning anomaly (info is fine); ``max_final_loss`` is the loss the training must
  reach for the case to be a healthy training at all (checked from the store's metrics);
- a *pathology* (``expect`` = issue concepts, see :data:`ISSUE_TYPES`): at least one
  health issue or anomaly of warning severity or worse whose type is one the concept
  maps to; *localised* when such an issue names a layer matching ``layers`` (``fnmatch``
  globs over layer paths; empty: the issue is about the run, any layer or none is right)
  and, where ``step`` is given, an anomaly of the right type at that step.

The concepts are the pathology names of issue 24; :data:`ISSUE_TYPES` maps each to the
issue type names the analyses emit (health's ``IssueType`` values, anomalies'
``Anomaly.type``). When a rule is renamed or added, update that table only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ISSUE_TYPES: dict[str, frozenset[str]] = {
    # gradients vanish towards the input (deep sigmoid stack)
    "vanishing": frozenset({"VANISHING", "DECAY_WITH_DEPTH", "BOTTLENECK"}),
    # the step diverges (learning rate far too large): huge or non-finite gradients
    "exploding": frozenset({"EXPLODING", "ACCELERATING"}),
    # units that never activate: zero activations or exactly zero gradients
    "dead": frozenset({"DEAD", "dead_units"}),
    # opt.zero_grad() forgotten: p.grad sums every step's gradient (no rule today)
    "accumulating_grad": frozenset({"ACCUMULATING_GRAD", "GRAD_ACCUMULATION"}),
    # a layer that should learn never moves (requires_grad off, or left out of the
    # optimizer): no update while the rest of the model trains
    "not_updated": frozenset({"NOT_UPDATED", "FROZEN_LAYER", "update_ratio"}),
    # the learning rate is orders of magnitude too small: updates negligible, no progress
    "lr_too_small": frozenset({"LR_TOO_SMALL", "update_ratio", "stalled"}),
    # BatchNorm left in eval mode while training: running statistics never change
    "norm_stats_frozen": frozenset({"NORM_STATS_FROZEN", "BATCHNORM_EVAL"}),
    # LSTM forget gate biased shut
    "forget_gate_closed": frozenset({"FORGET_GATE_CLOSED", "GATE_SATURATION"}),
    # one attention head's softmax saturated: it gets (almost) no gradient
    "head_collapsed": frozenset({"ATTENTION_HEAD_IMBALANCE"}),
    # tanh/sigmoid outputs pinned at their bounds
    "saturated": frozenset({"SATURATED", "GATE_SATURATION"}),
    # a non-finite loss/gradient appears at a step
    "nonfinite": frozenset({"nan", "inf"}),
    # data not shuffled: the loss cycles with the data order
    "periodic_loss": frozenset({"PERIODIC_LOSS", "UNSHUFFLED_DATA"}),
}
"""Pathology concept → the issue/anomaly type names that detect it (warning or worse)."""

Group = Literal["healthy", "pathology"]


@dataclass(frozen=True)
class HealthCase:
    """One case. ``record(workdir)`` trains and records into a new store under ``workdir``
    and returns the store's path (it replaces a store of the same name). ``quick``: part of
    the ``--quick`` subset. ``why``: what is planted (or why the run is healthy)."""

    name: str
    group: Group
    frameworks: str
    record: Callable[[Path], Path]
    why: str
    expect: tuple[str, ...] = ()
    layers: tuple[str, ...] = ()
    step: int | None = None
    max_final_loss: float | None = None
    quick: bool = False
    tags: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        unknown = [c for c in self.expect if c not in ISSUE_TYPES]
        if unknown:
            raise ValueError(f"case {self.name!r}: unknown issue concept(s) {unknown}")
        if (self.group == "healthy") != (not self.expect):
            raise ValueError(f"case {self.name!r}: a pathology expects issues, a healthy run none")

    def accepted_types(self) -> frozenset[str]:
        """Every issue type name that detects this case's pathology."""
        return frozenset().union(*(ISSUE_TYPES[c] for c in self.expect))
