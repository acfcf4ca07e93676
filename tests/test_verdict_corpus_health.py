"""The health half of the verdict corpus (benchmarks/verdict_corpus/health_cases.py) on a
few fast cases: the Section it returns and the verdicts that hold today.

Asserts only what today's ``health``/``anomalies`` get right (a healthy tanh MLP under SGD
is judged healthy; a deep sigmoid stack is VANISHING on its first layers; SGD at 100x the
learning rate is EXPLODING) plus the structure the runner prints; the full corpus and its
rates are ``python benchmarks/verdicts.py --only health``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from verdict_corpus import CaseResult, Rate, Section
from verdict_corpus import health_cases as H
from verdict_corpus.health_case import ISSUE_TYPES

NAMES = ("mlp_regression_sgd", "vanishing_deep_sigmoid", "exploding_lr")


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory) -> Section:
    return H.run(quick=False, workdir=tmp_path_factory.mktemp("health"), names=NAMES)


def test_corpus_declares_enough_cases_with_known_concepts() -> None:
    healthy = [c for c in H.CASES if c.group == "healthy"]
    sick = [c for c in H.CASES if c.group == "pathology"]
    assert len({c.name for c in H.CASES}) == len(H.CASES)
    assert healthy and sick
    assert all(set(c.expect) <= set(ISSUE_TYPES) for c in sick)
    assert all(c.max_final_loss is not None for c in healthy)
    assert H.cases(quick=True) and len(H.cases(quick=True)) < len(H.CASES)


def test_section_structure(section: Section) -> None:
    assert section.title == H.TITLE
    assert [c.name for c in section.cases] == list(NAMES)
    assert all(isinstance(c, CaseResult) and c.seconds > 0 for c in section.cases)
    assert [r.name for r in section.rates] == [
        "critical or warning on healthy runs",
        "pathologies detected with the right issue type",
        "pathologies detected with the right issue type on the right layer",
        f"healthy runs with critical or warning in health --window {H.WINDOW}",
    ]
    assert all(isinstance(r, Rate) for r in section.rates)
    assert (section.rates[0].total, section.rates[1].total) == (1, 2)
    js = section.to_json()
    assert {c["name"] for c in js["cases"]} == set(NAMES)


def test_verdicts_that_hold_today(section: Section) -> None:
    by = {c.name: c for c in section.cases}
    healthy = by["mlp_regression_sgd"]
    assert healthy.ok and healthy.got == "healthy", healthy.detail
    assert "CORPUS" not in healthy.detail  # the run reached its target loss
    for name in ("vanishing_deep_sigmoid", "exploding_lr"):
        assert by[name].ok and by[name].localised, (name, by[name].got, by[name].detail)
    assert section.rates[0].hits == 0 and section.rates[1].hits == 2


def test_stores_are_recorded_once_and_judged_again(tmp_path: Path) -> None:
    case = next(c for c in H.CASES if c.name == "exploding_lr")
    store, seconds = H.record(case, tmp_path)
    assert seconds > 0
    again, seconds2 = H.record(case, tmp_path)
    assert again == store and seconds2 == 0.0
    assert H.judge(case, store).ok


@pytest.fixture(scope="module")
def dead_relu_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    case = next(c for c in H.CASES if c.name == "dead_relu")
    return H.record(case, tmp_path_factory.mktemp("dead"))[0]


class _Issue:
    def __init__(self, type: str, severity: str, layer: str | None) -> None:
        self.type, self.severity, self.layer, self.message = type, severity, layer, ""


class _Report:
    """The two fields of a health / anomalies report that the judge reads."""

    def __init__(self, issues: list[_Issue]) -> None:
        self._issues, self.anomalies = issues, []

    def issues(self) -> list[_Issue]:
        return self._issues


@pytest.mark.parametrize(
    ("issues", "ok", "localised"),
    [
        ([_Issue("DEAD", "critical", "2")], True, True),
        ([_Issue("DEAD", "warning", "0")], True, False),  # right type, wrong layer
        ([_Issue("DEAD", "healthy", "2")], False, False),  # below warning: not a detection
        ([_Issue("VANISHING", "critical", "2")], False, False),  # wrong type
        ([], False, False),
    ],
)
def test_judge_reads_type_severity_and_layer(
    dead_relu_store: Path, issues: list[_Issue], ok: bool, localised: bool
) -> None:
    """The verdict rules on an injected report (a renamed rule only needs ISSUE_TYPES)."""
    case = next(c for c in H.CASES if c.name == "dead_relu")
    res = H.judge(case, dead_relu_store, health_fn=lambda run: _Report(issues),
                  anomalies_fn=lambda run: _Report([]))  # fmt: skip
    assert (res.ok, res.localised) == (ok, localised), res.got
