"""The compare half of the verdict corpus (benchmarks/verdict_corpus/compare_cases.py):
three of its cases run end to end — a correct MLP port (torch ↔ Flax NNX, SGD, float32)
and two bugs planted in the torch port (Nesterov momentum, dropout left on) — and the
Section they produce has the shape benchmarks/verdicts.py prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytest.importorskip("torch")
pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

from verdict_corpus import CaseResult, Section
from verdict_corpus import compare_cases as C
from verdict_corpus.bugs import BUGS

CASES = ["mlp-sgd-float32", "nesterov", "dropout_left_on"]


@pytest.fixture(scope="module")
def section(tmp_path_factory) -> Section:
    return C.run(quick=False, workdir=tmp_path_factory.mktemp("compare_corpus"), names=CASES)


def test_section_structure(section):
    assert section.title.startswith("compare")
    assert [c.name for c in section.cases] == CASES
    assert [c.group for c in section.cases] == ["port", "bug", "bug"]
    assert all(isinstance(c, CaseResult) and c.seconds > 0 for c in section.cases)
    assert [r.name for r in section.rates] == [
        "false differs on correct ports",
        "planted bugs detected",
        "bugs localised to the right layer and step",
    ]
    assert [(r.hits, r.total) for r in section.rates] == [
        (sum(not c.ok for c in section.cases[:1]), 1),
        (sum(c.ok for c in section.cases[1:]), 2),
        (sum(bool(c.localised) for c in section.cases[1:]), 2),
    ]
    assert section.to_json()["cases"][0]["name"] == "mlp-sgd-float32"


def test_correct_mlp_port_is_identical(section):
    """fc1 → ReLU → dropout(0) → fc2 → ReLU → dropout(0) → head, SGD with momentum:
    no bias is ~0, no update falls below an ulp, no clipping: today's compare agrees."""
    port = section.cases[0]
    assert port.expected == "identical"
    assert port.ok and port.got == "identical", port.got
    assert port.localised is None


def test_nesterov_is_found_in_the_update_of_step_0(section):
    case = section.cases[1]
    assert case.ok and case.localised, case.got
    assert case.got.startswith("differs: update ") and "@0" in case.got


def test_dropout_left_on_is_found_after_the_first_dropout(section):
    case = section.cases[2]
    assert case.ok and case.localised, case.got
    assert case.got.startswith("differs: activation fc2/output @0")


def test_every_bug_has_a_correct_port_to_compare_against():
    ports = {p.name for p in C.PORTS}
    for bug in BUGS:
        assert C._ref_port(bug).name in ports, bug.name
    assert len(BUGS) >= 20 and len({p.arch for p in C.PORTS}) >= 10
    quick_ports, quick_bugs = C.select(quick=True)
    assert {b.name for b in quick_bugs} <= {b.name for b in BUGS}
    assert all(C._ref_port(b) in quick_ports for b in quick_bugs)
