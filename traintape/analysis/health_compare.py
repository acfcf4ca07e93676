"""Comparative health: is run A healthier than a baseline run B, layer by layer?

For "did my fix help?": :func:`compare_health` takes the
:func:`~traintape.analysis.health` reports of A (the run judged) and B (the baseline,
``traintape health A --against B``) and gives every layer both runs have a verdict:

- ``improved`` / ``degraded``: A's layer score is higher / lower than B's; at equal score,
  an issue both runs have whose driving measure moved by at least ``move_factor`` in the
  good / bad direction (VANISHING: ``rel_grad`` up is good; EXPLODING: ``grad_norm``,
  ``update_ratio`` and ``grad_growth`` down; DEAD: ``act_zero_frac`` down, ``grad_norm``
  up), e.g. a layer still VANISHING whose gradient got 30x larger;
- ``unchanged`` otherwise.

The evidence: the issues resolved (B has them, A not), new (A only) and persisting, and
every measure that moved — by a factor of at least ``move_factor`` (scale measures), by
0.1 or more (``act_zero_frac``) or by 0.25 or more with a factor of ``move_factor``
(``grad_norm_cv``) — from B's value (``before``) to A's (``after``). The run's verdict
compares the two runs' scores (mean layer score minus run-level penalties).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from traintape.analysis._common import ProgressCallback, Tracker
from traintape.analysis.health import health
from traintape.analysis.health_model import HealthReport, HealthThresholds, LayerHealth
from traintape.analysis.issues import Issue, IssueType, Severity, Status

if TYPE_CHECKING:
    from traintape.core.reader import Run


class Verdict(StrEnum):
    IMPROVED = "improved"
    DEGRADED = "degraded"
    UNCHANGED = "unchanged"


class NoSharedLayersError(ValueError):
    """The two runs have no layer in common: there is nothing to compare."""


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.3g}"


class MeasureChange(BaseModel):
    """A layer measure (see :class:`~traintape.analysis.LayerHealth`) that moved."""

    measure: str
    before: float | None = Field(description="value in the baseline B")
    after: float | None = Field(description="value in A")
    factor: float | None = Field(None, description="after / before (None: before 0 or None)")

    def text(self) -> str:
        """``rel_grad 2.41e-05 → 0.00312 (×129)``."""
        f = f" (×{self.factor:.3g})" if self.factor else ""
        return f"{self.measure} {_num(self.before)} → {_num(self.after)}{f}"


class IssueChange(BaseModel):
    """An issue in either run: its severity in B (``before``) and in A (``after``);
    None where that run does not have it."""

    type: IssueType
    before: Status | None
    after: Status | None
    message: str = Field(description="A's message (B's for a resolved issue)")
    recommendation: str

    @property
    def change(self) -> str:
        """``resolved``, ``new`` or ``persisting``."""
        return "resolved" if self.after is None else "new" if self.before is None else "persisting"

    def text(self) -> str:
        """``VANISHING resolved``, ``DEAD new``, ``EXPLODING warning → critical``."""
        if self.change != "persisting" or self.before == self.after:
            return f"{self.type.value} {self.change}"
        return f"{self.type.value} {self.before} → {self.after}"


class LayerComparison(BaseModel):
    """One layer of both runs: the verdict for A against B and its evidence."""

    layer: str
    verdict: Verdict
    reason: str = Field(description="why the verdict, in words")
    status_before: Status
    status_after: Status
    score_before: float
    score_after: float
    issues: list[IssueChange] = Field(default_factory=list)
    moved: list[MeasureChange] = Field(default_factory=list)

    def evidence(self) -> str:
        """The issue changes and moved measures in one line ('' when nothing moved)."""
        return "; ".join([*(i.text() for i in self.issues), *(m.text() for m in self.moved)])


class HealthComparison(BaseModel):
    a: str = Field(description="the run judged")
    b: str = Field(description="the baseline (--against)")
    verdict: Verdict
    status_before: Status
    status_after: Status
    score_before: float
    score_after: float
    layers: list[LayerComparison] = Field(description="shared layers, in A's forward order")
    run_issues: list[IssueChange] = Field(default_factory=list)
    only_in_a: list[str] = Field(default_factory=list)
    only_in_b: list[str] = Field(default_factory=list)
    move_factor: float

    def counts(self) -> dict[Verdict, int]:
        """Layers per verdict."""
        return {v: sum(lc.verdict == v for lc in self.layers) for v in Verdict}

    def layer(self, name: str) -> LayerComparison:
        for lc in self.layers:
            if lc.layer == name:
                return lc
        raise KeyError(f"no shared layer {name!r} in {self.a} and {self.b}")


_SCALE = ("grad_norm", "rel_grad", "update_ratio", "grad_growth")
# measures whose move in the given direction (+1: up, -1: down) is good for an issue
_DRIVERS: dict[IssueType, dict[str, int]] = {
    IssueType.VANISHING: {"rel_grad": 1, "grad_norm": 1},
    IssueType.EXPLODING: {"grad_norm": -1, "update_ratio": -1, "grad_growth": -1},
    IssueType.DEAD: {"act_zero_frac": -1, "grad_norm": 1},
}


def _moved(measure: str, before: float | None, after: float | None, factor: float) -> bool:
    if before is None or after is None:
        return before is not after
    if measure == "act_zero_frac":
        return abs(after - before) >= 0.1
    lo, hi = sorted((abs(before), abs(after)))
    far = hi > 0 and (lo == 0 or hi / lo >= factor)
    return far and (measure != "grad_norm_cv" or hi - lo >= 0.25)


def _measure_changes(a: LayerHealth, b: LayerHealth, factor: float) -> list[MeasureChange]:
    out = []
    for m in (*_SCALE, "grad_norm_cv", "act_zero_frac"):
        va, vb = getattr(a, m), getattr(b, m)
        if _moved(m, vb, va, factor):
            ratio = va / vb if va is not None and vb else None
            out.append(MeasureChange(measure=m, before=vb, after=va, factor=ratio))
    return out


def _issue_changes(a: list[Issue], b: list[Issue]) -> list[IssueChange]:
    """Per (type, layer): its severity in B and in A (the worse when one run has several);
    info issues, which never change a status, are left out."""
    order = {Severity.WARNING: 1, Severity.CRITICAL: 2}

    def worst(issues: list[Issue]) -> dict[tuple[IssueType | str, str | None], Issue]:
        out: dict[tuple[IssueType | str, str | None], Issue] = {}
        for i in issues:
            if i.severity == Severity.INFO:
                continue
            key = (i.type, i.layer)
            if key not in out or order[i.severity] > order[out[key].severity]:
                out[key] = i
        return out

    wa, wb = worst(a), worst(b)
    return [
        IssueChange(
            type=key[0], before=wb[key].severity if key in wb else None,
            after=wa[key].severity if key in wa else None,
            message=(wa.get(key) or wb[key]).message,
            recommendation=(wa.get(key) or wb[key]).recommendation,
        )
        for key in [*wb, *(k for k in wa if k not in wb)]
    ]  # fmt: skip


def _layer_verdict(
    a: LayerHealth, issues: list[IssueChange], moved: list[MeasureChange], b: LayerHealth
) -> tuple[Verdict, str]:
    if a.score != b.score:
        v = Verdict.IMPROVED if a.score > b.score else Verdict.DEGRADED
        return v, f"score {b.score:.0f} → {a.score:.0f}"
    by = {m.measure: m for m in moved}
    for i in issues:
        if i.change != "persisting":
            continue
        for m, good in _DRIVERS.get(i.type, {}).items():
            mc = by.get(m)
            if mc is not None and mc.before is not None and mc.after is not None:
                up = mc.after > mc.before
                v = Verdict.IMPROVED if up == (good > 0) else Verdict.DEGRADED
                return v, f"{i.type.value} persists; {mc.text()}"
    return Verdict.UNCHANGED, f"score {a.score:.0f}, status {a.status}"


def compare_health(
    a: HealthReport, b: HealthReport, *, move_factor: float = 2.0
) -> HealthComparison:
    """Layer-by-layer verdicts of run A's health against baseline B's (module docstring).

    Raises:
        NoSharedLayersError: the runs have no layer in common.
        ValueError: ``move_factor`` ≤ 1.
    """
    if move_factor <= 1:
        raise ValueError(f"move_factor must be > 1, got {move_factor}")
    b_by = {lh.layer: lh for lh in b.layers}
    shared = [lh for lh in a.layers if lh.layer in b_by]
    if not shared:
        raise NoSharedLayersError(
            f"{a.url} and {b.url} share no layers: {a.url} has "
            f"{_names([lh.layer for lh in a.layers])}, {b.url} has "
            f"{_names([lh.layer for lh in b.layers])}"
        )
    layers = []
    for la in shared:
        lb = b_by[la.layer]
        issues = _issue_changes(la.issues, lb.issues)
        moved = _measure_changes(la, lb, move_factor)
        verdict, reason = _layer_verdict(la, issues, moved, lb)
        layers.append(LayerComparison(
            layer=la.layer, verdict=verdict, reason=reason, status_before=lb.status,
            status_after=la.status, score_before=lb.score, score_after=la.score,
            issues=issues, moved=moved,
        ))  # fmt: skip
    a_names = {lh.layer for lh in a.layers}
    overall = (Verdict.IMPROVED if a.score > b.score
               else Verdict.DEGRADED if a.score < b.score else Verdict.UNCHANGED)  # fmt: skip
    return HealthComparison(
        a=a.url, b=b.url, verdict=overall, status_before=b.status, status_after=a.status,
        score_before=b.score, score_after=a.score, layers=layers,
        run_issues=_issue_changes(a.run_issues, b.run_issues),
        only_in_a=[lh.layer for lh in a.layers if lh.layer not in b_by],
        only_in_b=[lh.layer for lh in b.layers if lh.layer not in a_names],
        move_factor=move_factor,
    )  # fmt: skip


def _names(names: list[str], most: int = 5) -> str:
    if not names:
        return "no layers"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def health_against(
    run: Run,
    baseline: Run,
    thresholds: HealthThresholds | None = None,
    *,
    move_factor: float = 2.0,
    progress: ProgressCallback | None = None,
) -> HealthComparison:
    """:func:`compare_health` of ``run``'s :func:`~traintape.analysis.health` against
    ``baseline``'s (same thresholds). ``progress``: both analyses' units together."""
    tracker = Tracker(progress)
    a = health(run, thresholds, progress=tracker.child())
    b = health(baseline, thresholds, progress=tracker.child())
    tracker.finish()
    return compare_health(a, b, move_factor=move_factor)
