"""traintape.compare: identical runs, a perturbed tensor, a transposed kernel, tolerances."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _training import train_mlp
from typer.testing import CliRunner

import traintape
from traintape.analysis import DEFAULT_TOLERANCES, compare
from traintape.cli import app

KW = dict(sizes=[8, 16, 4], steps=16, full_every=5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    out = {k: str(root / k) for k in ("a", "b", "perturbed")}
    train_mlp(out["a"], **KW)
    train_mlp(out["b"], **KW)
    train_mlp(out["perturbed"], perturb=(6, "layers/1/kernel", 1e-3), **KW)
    return out


def test_identical_runs(runs):
    rep = compare(runs["a"], runs["b"])
    assert rep.identical and rep.verdict == "identical"
    assert rep.structural == [] and rep.first_divergence is None
    assert rep.common_steps == 16
    k = rep.diff("layers/0/kernel", "param")
    assert k.steps_compared == 16 and k.snapshots_compared == 4
    assert k.max_abs == 0.0 and k.min_cosine == pytest.approx(1.0)


def test_perturbed_tensor_named_with_first_step(runs):
    rep = compare(runs["a"], runs["perturbed"])
    assert not rep.identical and rep.verdict == "differs"
    assert rep.structural == []
    first = rep.first_divergence
    assert (first.tensor, first.kind, first.first_step_out) == ("layers/1/kernel", "param", 6)
    d = rep.diff("layers/1/kernel", "param")
    assert d.max_abs == pytest.approx(1e-3, rel=0.05)
    # everything before step 6 agreed; gradients of step 6 follow
    assert all(t.first_step_out is None or t.first_step_out >= 6 for t in rep.tensors)
    assert rep.diff("layers/0/kernel", "grad").first_step_out == 6
    assert rep.diff("loss", "metrics").first_step_out == 6
    # loose enough tolerances absorb the perturbation
    assert compare(runs["a"], runs["perturbed"], atol=1.0, rtol=1.0).identical


def _record(url: str, transpose: bool) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 5)).astype(np.float32)
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=2)) as rec:
        for t in range(4):
            k = w + t
            rec.record(t, "param", {"dense/kernel": k.T if transpose else k})
            rec.log(t, loss=1.0 / (t + 1))


def test_transposed_kernel_is_structural(tmp_path):
    _record(str(tmp_path / "a"), False)
    _record(str(tmp_path / "b"), True)
    rep = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not rep.identical
    shape = [s for s in rep.structural if s.what == "spec" and s.field == "shape"]
    assert shape and shape[0].tensor == "dense/kernel"
    assert (shape[0].a, shape[0].b) == ([3, 5], [5, 3])


def test_structural_step_and_tensor_sets(tmp_path):
    with traintape.Recorder(str(tmp_path / "a")) as rec:
        for t in range(3):
            rec.record(t, "param", {"x/kernel": np.ones((2, 2), np.float32)})
    with traintape.Recorder(str(tmp_path / "b")) as rec:
        for t in range(4):
            rec.record(t, "param", {"x/kernel": np.ones((2, 2), np.float32),
                                    "y/bias": np.zeros(2, np.float32)})  # fmt: skip
    rep = compare(str(tmp_path / "a"), str(tmp_path / "b"), strict=True)
    whats = {s.what for s in rep.structural}
    assert {"tensor", "steps"} <= whats and not rep.identical and rep.mode == "strict"
    assert any(s.tensor == "y/bias" and "only in run B" in s.message for s in rep.structural)
    assert rep.diff("x/kernel", "param").steps_compared == 3  # common steps still compared
    # default: the shared data agree; what only one run holds is listed, not judged
    shared = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert shared.identical and shared.mode == "shared" and not shared.structural
    assert {d.what for d in shared.not_compared} == {"tensor", "steps"}


def test_per_kind_tolerances_and_defaults():
    assert DEFAULT_TOLERANCES["param"].rtol <= DEFAULT_TOLERANCES["grad"].rtol


def test_cli_compare_exit_codes_and_json(runs):
    cli = CliRunner()
    ok = cli.invoke(app, ["compare", runs["a"], runs["b"]])
    assert ok.exit_code == 0, ok.output
    assert "identical" in ok.output
    bad = cli.invoke(app, ["compare", runs["a"], runs["perturbed"]])
    assert bad.exit_code == 1
    assert "layers/1/kernel" in bad.output and "step 6" in bad.output
    js = cli.invoke(app, ["compare", runs["a"], runs["perturbed"], "--json"])
    assert js.exit_code == 1
    data = json.loads(js.output)
    assert data["verdict"] == "differs"
    assert data["first_divergence"]["tensor"] == "layers/1/kernel"
    missing = cli.invoke(app, ["compare", runs["a"], runs["a"] + "-nope"])
    assert missing.exit_code == 2


def test_forward_order_is_a_hint_not_a_difference(tmp_path):
    """Linen/torch/Keras stores carry forward_order, NNX ones may not: equal data
    with and without it compares identical; two different orders give a note."""

    def rec(url: str, user: dict) -> str:
        with traintape.Recorder(url, user=user) as r:
            for t in range(3):
                r.record(t, "param", {"fc/kernel": np.full((2, 2), float(t), np.float32)})
        return url

    a = rec(str(tmp_path / "a"), {"forward_order": ["fc"]})
    b = rec(str(tmp_path / "b"), {})
    c = rec(str(tmp_path / "c"), {"forward_order": ["other", "fc"]})
    assert compare(a, b).identical
    rep = compare(a, c)
    assert rep.identical and any("forward order differs" in n for n in rep.notes)
    d = rec(str(tmp_path / "d"), {"forward_order": ["fc"], "lr": 0.1})
    assert not compare(a, d, strict=True).identical  # the rest of user counts when strict
    rep = compare(a, d)
    assert rep.identical and any("manifest field 'user'" in n for n in rep.notes)


def _updates_and_acts(url: str, *, update: bool, acts: bool, layer_kind: str | None) -> None:
    kinds = ("param", "grad", "update", "activation")
    with traintape.Recorder(url, traintape.CapturePolicy(kinds=kinds)) as rec:
        specs = [traintape.TensorSpec.build("fc/kernel", k, dtype="float32", shape=[2, 2],
                                            layer_kind=layer_kind)
                 for k in ("param", "grad", *(("update",) if update else ()))]  # fmt: skip
        rec.declare(specs)
        for t in range(3):
            w = np.full((2, 2), 1.0 + t, np.float32)
            rec.record(t, "param", {"fc/kernel": w})
            rec.record(t, "grad", {"fc/kernel": w * 0.5})
            if update:
                rec.record(t, "update", {"fc/kernel": -0.1 * w})
            if acts:
                rec.record(t, "activation", {"fc/output": np.ones((4, 2), np.float32) * t})


def test_default_judges_shared_data_strict_judges_structure(tmp_path):
    """One run recorded with updates, activations and layer kinds, one without: the data
    both have agree, so the default verdict is identical (listing what was not compared);
    --strict says they differ."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _updates_and_acts(a, update=True, acts=True, layer_kind="dense")
    _updates_and_acts(b, update=False, acts=False, layer_kind=None)
    rep = compare(a, b)
    assert rep.identical and rep.verdict == "identical" and rep.mode == "shared"
    assert {(d.what, d.kind) for d in rep.not_compared} >= {
        ("kind", "update"),
        ("kind", "activation"),
    }
    assert any("layer_kind" in n for n in rep.notes)
    strict = compare(a, b, strict=True)
    assert not strict.identical and strict.mode == "strict"
    assert {d.what for d in strict.structural} >= {"kind", "spec"}
    # a real difference in the shared data still makes them differ by default
    c = str(tmp_path / "c")
    with traintape.Recorder(c) as rec:
        for t in range(3):
            rec.record(t, "param", {"fc/kernel": np.full((2, 2), 1.0 + t, np.float32) * 1.01})
    bad = compare(a, c)
    assert not bad.identical and bad.first_divergence.tensor == "fc/kernel"


def test_cli_compare_says_which_verdict(tmp_path):
    from typer.testing import CliRunner

    from traintape.cli import app

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _updates_and_acts(a, update=True, acts=False, layer_kind="dense")
    _updates_and_acts(b, update=False, acts=False, layer_kind="dense")
    r = CliRunner().invoke(app, ["compare", a, b])
    assert r.exit_code == 0, r.output
    assert "shared data" in r.output and "not compared" in r.output
    r = CliRunner().invoke(app, ["compare", a, b, "--strict"])
    assert r.exit_code == 1, r.output
    assert "strict" in r.output


def test_gradients_diverge_first_at_the_head(tmp_path):
    """Within a step, gradients are computed backward: when every gradient differs (a
    mistake in the loss), the first divergence is the head's gradient where the run
    records its forward order; activations stay in forward order."""

    def rec(url: str, scale: float) -> str:
        order = ["embed", "block", "head"]
        with traintape.Recorder(url, user={"forward_order": order}) as r:
            for t in range(2):
                g = {f"{n}/kernel": np.full((2, 2), (t + 1) * scale, np.float32) for n in order}
                r.record(t, "grad", g)
        return url

    a, b = rec(str(tmp_path / "a"), 1.0), rec(str(tmp_path / "b"), 2.0)
    first = compare(a, b).first_divergence
    assert (first.tensor, first.kind, first.first_step_out) == ("head/kernel", "grad", 0)


def test_system_metrics_are_never_a_difference(tmp_path):
    """Which sys/* metrics a run holds depends on how long it ran (cpu_percent needs two
    samples) and on the machine: runs of the same model compare identical whatever
    system metrics they hold — here one run has them all and the other none."""

    def rec(url: str, system: bool) -> str:
        with traintape.Recorder(url, system_metrics=system) as r:
            for t in range(3):
                r.record(t, "param", {"fc/kernel": np.full((2, 2), float(t), np.float32)})
                r.log(t, loss=1.0 / (t + 1))
        return url

    a, b = rec(str(tmp_path / "a"), True), rec(str(tmp_path / "b"), False)
    assert any(n.startswith("sys/") for n in traintape.open_run(a).manifest.metrics)
    rep = compare(a, b)
    assert rep.identical, [s.message for s in rep.structural]
