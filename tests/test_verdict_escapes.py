"""Verdicts that must be able to fail (issue 29): each test here was checked to fail with
the bug named in its docstring planted, and to pass on the real code.

- compare honours ``tolerances=`` in both directions (a tolerance that turns "differs"
  into "identical" and one that turns "identical" into "differs");
- compare judges a row that only one side has as missing (all-NaN) — it drops a row
  only when both sides lack it;
- anomalies names the first NaN step of a run crossing several read blocks (>= 10,000
  steps, NaN from a late step): the block's row offset must be kept;
- validate refuses repeated, decreasing and negative steps.

Stores are written fast with :meth:`traintape.Recorder.record_stats` from stat vectors of
random tensors (:func:`traintape.schema.stats.reference_stats`).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

import traintape as tt
from traintape.analysis import anomalies, compare, health, render_markdown
from traintape.schema import STAT_INDEX, TensorSpec
from traintape.schema.stats import reference_stats

SHAPES = {"layers/0/kernel": (4, 8), "layers/0/bias": (8,), "layers/1/kernel": (8, 3)}
NAMES = sorted(SHAPES)


def _specs(kind: str) -> list[TensorSpec]:
    out = []
    for n, s in SHAPES.items():
        layer, _, role = n.rpartition("/")
        out.append(
            TensorSpec(name=n, kind=kind, role=role, layer=layer, dtype="float32", shape=list(s))
        )
    return out


def _vectors(step: int, scale: float = 1.0) -> np.ndarray:
    """Stat vectors ``[len(NAMES), N_STATS]`` of step ``step``'s (seeded) grads."""
    rng = np.random.default_rng(step)
    arrays = [rng.normal(size=SHAPES[n]) * scale for n in NAMES]
    return reference_stats(arrays)


def _write(url: str, steps: int, scale: float = 1.0, edit=None, flush: int = 50) -> None:
    """A run of ``steps`` steps of grad stats; ``edit(step, vectors)`` may change them."""
    with tt.Recorder(
        url, tt.CapturePolicy(kinds=("grad",)), system_metrics=False, flush_every_steps=flush
    ) as rec:
        rec.declare(_specs("grad"))
        for t in range(steps):
            v = _vectors(t % 97, scale)
            if edit is not None:
                edit(t, v)
            rec.record_stats(t, "grad", v, names=NAMES)


# ----------------------------------------------------------------------------- compare
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdicts")
    out = {k: str(root / k) for k in ("a", "rel1e-3", "rel1e-6")}
    _write(out["a"], 8)
    _write(out["rel1e-3"], 8, scale=1 + 1e-3)
    _write(out["rel1e-6"], 8, scale=1 + 1e-6)
    return out


def test_compare_tolerances_loosen_a_verdict(pair):
    """Planted bug: compare ignores ``tolerances=``."""
    assert not compare(pair["a"], pair["rel1e-3"]).identical  # grad rtol 1e-4 by default
    loose = compare(pair["a"], pair["rel1e-3"], tolerances={"grad": {"rtol": 1e-2}})
    assert loose.identical, loose.first_divergence
    # a tolerance for another kind changes nothing
    other = compare(pair["a"], pair["rel1e-3"], tolerances={"param": {"rtol": 1.0}})
    assert not other.identical


def test_compare_tolerances_tighten_a_verdict(pair):
    """Planted bug: compare ignores ``tolerances=``."""
    assert compare(pair["a"], pair["rel1e-6"]).identical
    tight = compare(pair["a"], pair["rel1e-6"], tolerances={"grad": {"rtol": 1e-9, "atol": 0}})
    assert not tight.identical
    first = tight.first_divergence
    assert first is not None and first.kind == "grad" and first.first_step_out == 0


def test_compare_atol_and_rtol_arguments_change_the_verdict(pair):
    """Planted bug: compare ignores ``atol=`` (or ``rtol=``) for every kind."""
    assert not compare(pair["a"], pair["rel1e-3"]).identical
    assert compare(pair["a"], pair["rel1e-3"], atol=0.1).identical
    assert compare(pair["a"], pair["rel1e-3"], rtol=1e-2).identical
    assert not compare(pair["a"], pair["rel1e-6"], atol=0.0, rtol=1e-9).identical


def test_compare_row_missing_on_one_side_differs(tmp_path):
    """Planted bug: compare drops a row when *either* side is all-NaN (should be: both —
    a row missing on one side only is counted as one-sided, and differs when strict)."""
    missing_step, tensor = 5, NAMES.index("layers/1/kernel")

    def one_side(t: int, v: np.ndarray) -> None:
        if t == missing_step:
            v[tensor] = np.nan

    a, b, c = (str(tmp_path / k) for k in "abc")
    _write(a, 8)
    _write(b, 8, edit=one_side)
    _write(c, 8, edit=one_side)
    # shared mode (docs/compare.md): a step recorded in one run only is not compared but
    # counted and listed; strict mode makes it a difference
    rep = compare(a, b)
    d = rep.diff("layers/1/kernel", "grad")
    assert d.steps_one_sided == 1 and d.steps_compared == 7
    assert any(s.what == "rows" and s.tensor == "layers/1/kernel" for s in rep.not_compared)
    assert not compare(a, b, strict=True).identical
    # both sides lack it: nothing to judge, the runs agree, even strictly
    both = compare(b, c)
    assert both.identical and compare(b, c, strict=True).identical
    bd = both.diff("layers/1/kernel", "grad")
    assert bd.steps_compared == 7 and bd.steps_one_sided == 0


# ------------------------------------------------------------------- long-run anomalies
LONG = 10_000
NAN_FROM = 9_321


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("long") / "run")

    def late_nan(t: int, v: np.ndarray) -> None:
        if t >= NAN_FROM:
            j = NAMES.index("layers/0/bias")
            v[j, STAT_INDEX["nan_count"]] = 2.0

    _write(url, LONG, edit=late_nan, flush=2_000)
    return url


def test_anomalies_first_nan_past_several_read_blocks(long_run):
    """Planted bug: the first-NaN reducer loses its read block's row offset (a run of
    10,000 steps with NaN from 9,321 reported at 9,321 - 8,192 = 1,129)."""
    run = tt.open_run(long_run)
    assert len(run.steps) == LONG
    rep = anomalies(run)
    nan = [a for a in rep.anomalies if a.type == "nan"]
    assert [(a.step, a.tensor) for a in nan] == [(NAN_FROM, "layers/0/bias")]
    assert nan[0].evidence["steps_affected"] == LONG - NAN_FROM


def test_health_and_report_see_the_late_nan(long_run):
    run = tt.open_run(long_run)
    h = health(run)
    issues = [i for layer in h.layers for i in layer.issues]
    counts = [i.evidence.get("nonfinite_values") for i in issues if i.layer == "layers/0"]
    assert counts == [2 * (LONG - NAN_FROM)], issues  # 2 NaN a step, every step from NAN_FROM
    md = render_markdown(run)
    assert f"{NAN_FROM:,}" in md or str(NAN_FROM) in md, md[:3000]


# ---------------------------------------------------------------------------- validate
@pytest.mark.parametrize(
    ("row", "value", "message"),
    [
        (3, 2, "not strictly increasing at row 3 (step 2 then 2)"),  # repeated
        (3, 1, "not strictly increasing at row 3 (step 2 then 1)"),  # decreasing
        (0, -1, "row 0 has negative step -1"),
    ],
    ids=["repeated", "decreasing", "negative"],
)
def test_validate_refuses_bad_steps(tmp_path, row, value, message):
    """Planted bug: validate accepts repeated steps (``diff < 0`` for ``diff <= 0``)."""
    url = str(tmp_path / "run")
    _write(url, 6)
    assert tt.validate(url).ok
    steps = zarr.open_group(url, mode="r+")["steps"]
    steps[row] = value
    rep = tt.validate(url)
    assert not rep.ok
    assert any(message in p for p in rep.problems), rep.problems


def test_validate_refuses_commit_mark_disagreeing_with_the_last_step(tmp_path):
    """Planted bug: validate ignores a commit mark whose ``last_step`` is not the step of
    the last committed row."""
    url = tmp_path / "run"
    _write(str(url), 6)
    p = url / "zarr.json"
    doc = json.loads(p.read_text())
    assert doc["attributes"]["traintape"]["commit"]["last_step"] == 5
    doc["attributes"]["traintape"]["commit"]["last_step"] = 4
    p.write_text(json.dumps(doc))
    rep = tt.validate(str(url))
    assert not rep.ok
    assert any("last_step 4 but row 5 holds step 5" in q for q in rep.problems), rep.problems
