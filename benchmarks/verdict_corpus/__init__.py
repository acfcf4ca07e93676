"""The verdict corpus (issue 24): real training cases with a known right answer.

Each section module (``compare_cases``: correct ports and planted bugs, judged by
``traintape.analysis.compare``; ``health_cases``: healthy trainings and planted
pathologies, judged by ``health`` and ``anomalies``) records its cases into stores under
a work directory and returns a :class:`Section`: one :class:`CaseResult` per case and the
summary :class:`Rate` rows that ``benchmarks/verdicts.py`` prints against the targets.

A case is a claim about a verdict, measured — never tuned on a single case: every false
verdict that is found becomes a new case here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Group = Literal["port", "bug", "healthy", "pathology"]


@dataclass
class CaseResult:
    """One case: what the tool should say (``expected``) and what it said (``got``).

    ``ok``: the verdict is right (a port compares identical, a bug differs, a healthy run
    has no critical/warning, a pathology is detected with the right issue type).
    ``localised``: for bugs and pathologies, whether the first divergence / the issue
    names the right tensor or layer and step (``None`` where it does not apply).
    """

    name: str
    group: Group
    frameworks: str
    expected: str
    got: str
    ok: bool
    localised: bool | None = None
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Rate:
    """A summary row: ``hits`` of ``total`` cases, and whether the target is met."""

    name: str
    hits: int
    total: int
    target: str
    met: bool

    @property
    def value(self) -> str:
        return f"{self.hits}/{self.total}"


@dataclass
class Section:
    title: str
    cases: list[CaseResult] = field(default_factory=list)
    rates: list[Rate] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "cases": [asdict(c) for c in self.cases],
            "rates": [asdict(r) | {"value": r.value} for r in self.rates],
        }
