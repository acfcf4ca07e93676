"""`traintape change` (parameter change between two snapshot steps) and the
`--threshold NAME=VALUE` options of `health` and `anomalies`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import traintape
from traintape.analysis import parameter_change
from traintape.cli import app
from traintape.schema import CapturePolicy

cli = CliRunner()

NAMES = ("enc/attn/q/kernel", "enc/attn/k/kernel", "enc/mlp/kernel", "enc/mlp/bias")


def _record(url: str, steps: int = 12, full_every: int | None = 5, seed: int = 0) -> dict:
    """A small numpy 'training': params, grads and updates; returns the params at every
    step (θ_t, as recorded at step t)."""
    rng = np.random.default_rng(seed)
    p = {
        "enc/attn/q/kernel": rng.standard_normal((4, 4)).astype(np.float32),
        "enc/attn/k/kernel": rng.standard_normal((4, 4)).astype(np.float32),
        "enc/mlp/kernel": rng.standard_normal((4, 8)).astype(np.float32),
        "enc/mlp/bias": np.zeros(8, np.float32),
    }
    seen = {}
    with traintape.Recorder(url, CapturePolicy(full_every=full_every)) as rec:
        for t in range(steps):
            g = {k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in p.items()}
            # the bias moves only in its first half: a sparse update
            g["enc/mlp/bias"][4:] = 0
            new = {k: (v - 0.1 * g[k]).astype(np.float32) for k, v in p.items()}
            rec.record(t, "param", p)
            rec.record(t, "grad", g)
            rec.record(t, "update", {k: new[k] - p[k] for k in p})
            rec.log(t, loss=1.0 / (t + 1))
            seen[t] = {k: v.copy() for k, v in p.items()}
            p = new
    return seen


@pytest.fixture(scope="module")
def run_path(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("change") / "run")
    return url, _record(url)


def _delta(seen: dict, a: int, b: int, names=NAMES) -> np.ndarray:
    return np.concatenate(
        [(seen[b][n].astype(np.float64) - seen[a][n].astype(np.float64)).ravel() for n in names]
    )


def test_change_json_between_two_steps(run_path):
    url, seen = run_path
    r = cli.invoke(
        app, ["change", url, "--from", "0", "--to", "10", "--thresholds", "1e-3,1e-2", "--json"]
    )
    assert r.exit_code == 0, r.output
    pc = json.loads(r.output)
    assert pc["thresholds"] == [1e-3, 1e-2]
    (pair,) = pc["pairs"]
    assert (pair["step_old"], pair["step_new"]) == (0, 10)
    d = _delta(seen, 0, 10)
    old = np.concatenate([seen[0][n].astype(np.float64).ravel() for n in NAMES])
    new = np.concatenate([seen[10][n].astype(np.float64).ravel() for n in NAMES])
    tot = pair["total"]
    assert tot["numel"] == d.size
    assert tot["l1"] == pytest.approx(np.abs(d).sum(), rel=1e-6)
    assert tot["l2"] == pytest.approx(np.linalg.norm(d), rel=1e-6)
    assert tot["max"] == pytest.approx(np.abs(d).max(), rel=1e-6)
    assert tot["mean"] == pytest.approx(d.mean(), rel=1e-6, abs=1e-12)
    assert tot["std"] == pytest.approx(d.std(), rel=1e-6)
    assert tot["mean_shift"] == pytest.approx(new.mean() - old.mean(), rel=1e-5, abs=1e-9)
    assert tot["std_shift"] == pytest.approx(new.std() - old.std(), rel=1e-5, abs=1e-9)
    assert tot["relative"] == pytest.approx(np.linalg.norm(d) / np.linalg.norm(old), rel=1e-6)
    for thr in ("0.001", "0.01"):
        assert tot["sparsity"][thr] == pytest.approx(np.mean(np.abs(d) <= float(thr)))
    # per layer and per component
    mlp = _delta(seen, 0, 10, ("enc/mlp/kernel", "enc/mlp/bias"))
    assert pair["per_layer"]["enc/mlp"]["l2"] == pytest.approx(np.linalg.norm(mlp), rel=1e-6)
    assert pair["per_layer"]["enc/mlp"]["std"] == pytest.approx(mlp.std(), rel=1e-6)
    assert set(pair["per_component"]) == {"attention/q", "attention/k", "mlp"}
    q = _delta(seen, 0, 10, ("enc/attn/q/kernel",))
    assert pair["per_component"]["attention/q"]["l1"] == pytest.approx(np.abs(q).sum(), rel=1e-6)
    # the bias's frozen half is exactly unchanged
    assert pair["per_tensor"]["enc/mlp/bias"]["sparsity"]["0.001"] == pytest.approx(0.5)


def test_change_defaults_first_to_last_snapshot_and_table(run_path):
    url, seen = run_path
    j = json.loads(cli.invoke(app, ["change", url, "--json"]).output)
    (pair,) = j["pairs"]
    assert (pair["step_old"], pair["step_new"]) == (0, 10)
    assert j["thresholds"] == [1e-8, 1e-6, 1e-4]
    r = cli.invoke(app, ["change", url, "--from", "5"], env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    assert "θ(step 10) − θ(step 5)" in r.output
    for word in ("per component", "per layer", "attention/q", "enc/mlp", "total"):
        assert word in r.output
    l2 = np.linalg.norm(_delta(seen, 5, 10))
    assert f"{l2:.3g}" in r.output


def test_change_library_steps_any_pair(run_path):
    url, seen = run_path
    run = traintape.open_run(url)
    pc = parameter_change(run, (1e-3,), steps=(0, 10))
    assert len(pc.pairs) == 1
    assert pc.pairs[0].total.l2 == pytest.approx(np.linalg.norm(_delta(seen, 0, 10)), rel=1e-6)
    # consecutive pairs by default, each with Δ mean/std too
    pcs = parameter_change(run)
    assert [(p.step_old, p.step_new) for p in pcs.pairs] == [(0, 5), (5, 10)]
    assert pcs.pairs[0].total.std == pytest.approx(_delta(seen, 0, 5).std(), rel=1e-6)
    with pytest.raises(KeyError, match="no param snapshot at step 3"):
        parameter_change(run, steps=(3, 10))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from", "3"], "--from 3: "),
        (["--to", "11"], "no param snapshot at step 11"),
        (["--from", "10", "--to", "5"], "--from 10 must be before --to 5"),
        (["--from", "5", "--to", "5"], "must be before"),
        (["--thresholds", "1e-3,abc"], "--thresholds 'abc': not a number"),
        (["--thresholds", "-1"], "must be a finite number >= 0"),
        (["--thresholds", "nan"], "must be a finite number >= 0"),
    ],
)
def test_change_bad_input_exits_2(run_path, args, message):
    url, _ = run_path
    r = cli.invoke(app, ["change", url, *args])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output
    if "snapshot" in message:
        assert "snapshot steps: 0, 5, 10" in r.output


def test_change_without_snapshots(tmp_path):
    url = str(tmp_path / "nosnap")
    _record(url, steps=4, full_every=None)
    r = cli.invoke(app, ["change", url])
    assert r.exit_code == 2
    assert "needs param snapshots at two steps, found 0" in r.output
    assert "full_every" in r.output
    r = cli.invoke(app, ["change", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no run at" in r.output


# ----------------------------------------------------------------- --threshold options


def test_health_threshold_option_changes_the_verdict(run_path):
    url, _ = run_path
    base = json.loads(cli.invoke(app, ["health", url, "--json"]).output)
    assert base["thresholds"]["update_ratio_high"] == 0.1
    assert not any(i["type"] == "EXPLODING" for lh in base["layers"] for i in lh["issues"])
    r = cli.invoke(
        app, ["health", url, "--json", "-t", "update_ratio_high=1e-6", "-t", "qkv_ratio=20"]
    )
    assert r.exit_code == 1, r.output  # every layer now updates "too fast": critical
    j = json.loads(r.output)
    assert j["thresholds"]["update_ratio_high"] == 1e-6 and j["thresholds"]["qkv_ratio"] == 20
    assert all(any(i["type"] == "EXPLODING" for i in lh["issues"]) for lh in j["layers"])
    # the windowed and the --against forms take them too
    r = cli.invoke(app, ["health", url, "-w", "4", "--json", "-t", "update_ratio_high=1e-6"])
    assert r.exit_code == 1
    w = json.loads(r.output)
    assert w["thresholds"]["update_ratio_high"] == 1e-6 and "critical" in w["status"]
    r = cli.invoke(app, ["health", url, "--against", url, "-t", "update_ratio_high=1e-6"])
    assert r.exit_code == 0 and "unchanged" in r.output  # the same thresholds on both


def test_anomalies_threshold_option(run_path):
    url, _ = run_path
    base = json.loads(cli.invoke(app, ["anomalies", url, "--json"]).output)
    assert not base["anomalies"]
    r = cli.invoke(app, ["anomalies", url, "--json", "--threshold", "update_ratio_high=1e-6"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    assert j["thresholds"]["update_ratio_high"] == 1e-6
    assert j["anomalies"] and {a["type"] for a in j["anomalies"]} == {"update_ratio"}


@pytest.mark.parametrize(
    ("cmd", "item", "message"),
    [
        ("health", "nope=1", "health has no threshold 'nope'"),
        ("health", "vanishing_rel", "expected NAME=VALUE"),
        ("health", "vanishing_rel=", "expected NAME=VALUE"),
        ("health", "vanishing_rel=abc", "--threshold vanishing_rel=abc: Input should be a valid"),
        ("anomalies", "vanishing_rel=1", "anomalies has no threshold 'vanishing_rel'"),
        ("anomalies", "window=0", "--threshold window=0: Input should be greater than or equal"),
        ("anomalies", "window=2.5", "--threshold window=2.5"),
    ],
)
def test_threshold_option_errors(run_path, cmd, item, message):
    url, _ = run_path
    r = cli.invoke(app, [cmd, url, "--threshold", item])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output
    if "has no threshold" in message:  # the known names are listed
        assert ("update_ratio_high" in r.output) and ("fields:" in r.output)


def test_change_lora_adapter(tmp_path):
    """A LoRA layer (numpy-recorded PEFT names): the adapter's ΔW = A·B between the two
    steps, scale unknown (1)."""
    url = str(tmp_path / "lora")
    rng = np.random.default_rng(3)
    pre = "blocks/0/attn/q_proj"
    p = {
        f"{pre}/base_layer/kernel": rng.standard_normal((6, 5)).astype(np.float32),
        f"{pre}/lora_A/kernel": rng.standard_normal((6, 2)).astype(np.float32),
        f"{pre}/lora_B/kernel": np.zeros((2, 5), np.float32),
    }
    seen = {}
    with traintape.Recorder(url, CapturePolicy(full_every=3)) as rec:
        for t in range(7):
            g = {k: (0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in p.items()}
            g[f"{pre}/base_layer/kernel"][:] = 0  # frozen base
            rec.record(t, "param", p)
            rec.record(t, "grad", g)
            seen[t] = {k: v.astype(np.float64) for k, v in p.items()}
            p = {k: (v - 0.5 * g[k]).astype(np.float32) for k, v in p.items()}
    r = cli.invoke(app, ["change", url, "--json"])
    assert r.exit_code == 0, r.output
    pair = json.loads(r.output)["pairs"][0]
    assert (pair["step_old"], pair["step_new"]) == (0, 6)
    a0, b0 = seen[0][f"{pre}/lora_A/kernel"], seen[0][f"{pre}/lora_B/kernel"]
    a1, b1 = seen[6][f"{pre}/lora_A/kernel"], seen[6][f"{pre}/lora_B/kernel"]
    lc = pair["lora"][pre]
    assert lc["norm_old"] == pytest.approx(0.0, abs=1e-12)  # B starts at zero
    assert lc["norm"] == pytest.approx(np.linalg.norm(a1 @ b1), rel=1e-6)
    assert lc["change"] == pytest.approx(np.linalg.norm(a1 @ b1 - a0 @ b0), rel=1e-6)
    base = np.linalg.norm(seen[0][f"{pre}/base_layer/kernel"])
    assert lc["relative"] == pytest.approx(lc["change"] / base, rel=1e-6)
    assert "lora/attention/q" in pair["per_component"]
    t = cli.invoke(app, ["change", url], env={"COLUMNS": "160"})
    assert t.exit_code == 0, t.output
    assert "LoRA effective update ΔW = s·A·B" in t.output and pre in t.output
    assert "ΔW is up to s" in t.output
