"""``traintape sparse-update``: forward functions and torch modules loaded by import path."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from _stores import stores  # noqa: F401
from typer.testing import CliRunner

import traintape
from traintape.analysis import sparse_update_from_run
from traintape.cli import app

cli = CliRunner()

FORWARD = textwrap.dedent(
    """
    import numpy as np

    def forward(p, x):
        h = x
        for i in range(3):
            h = h @ p[f"layers/{i}/kernel"] + p[f"layers/{i}/bias"]
            h = np.tanh(h) if i < 2 else h
        return h

    def probe():
        return np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)

    def broken(p, x):
        return p["no/such/kernel"]
    """
)


@pytest.fixture
def fwd_file(tmp_path):
    path = tmp_path / "fwd_mod.py"
    path.write_text(FORWARD)
    return path


def test_sparse_update_with_a_forward_file(stores, fwd_file, tmp_path):  # noqa: F811
    url = stores["healthy"]
    r = cli.invoke(
        app,
        ["sparse-update", url, "--forward", f"{fwd_file}:forward", "--inputs", f"{fwd_file}:probe",
         "-t", "1e-3", "-t", "1e-2", "--json"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["step_old"] == 0 and got["step_new"] == 30 and got["thresholds"] == [1e-3, 1e-2]
    # the same numbers as the Python API
    ns: dict = {}
    exec(FORWARD, ns)
    api = sparse_update_from_run(
        traintape.open_run(url), ns["forward"], ns["probe"](), thresholds=(1e-3, 1e-2)
    )
    assert got == json.loads(api.model_dump_json())
    # the table
    r = cli.invoke(
        app, ["sparse-update", url, "-m", f"{fwd_file}:forward", "-i", f"{fwd_file}:probe",
              "--from", "10", "--to", "20"], env={"COLUMNS": "160"},
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "θ(step 20) − θ(step 10)" in r.output and "no update at all" in r.output
    for thr in ("1e-08", "1e-06", "0.0001"):
        assert thr in r.output
    assert r.output.count("magnitude") >= 3 and r.output.count("random") >= 3


def test_sparse_update_dotted_module_and_npy_inputs(stores, fwd_file, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "probe.npy", np.ones((4, 16), np.float32))
    r = cli.invoke(
        app, ["sparse-update", stores["healthy"], "-m", "fwd_mod:forward", "-i", "probe.npy",
              "--json"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["baseline"]["variant"] == "none"


def test_sparse_update_with_a_torch_module_class(tmp_path):
    torch = pytest.importorskip("torch")
    import traintape.torch as ttorch

    mod = tmp_path / "tmodel.py"
    mod.write_text(
        textwrap.dedent(
            """
            import torch

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc1 = torch.nn.Linear(8, 16)
                    self.fc2 = torch.nn.Linear(16, 3)

                def forward(self, x):
                    return self.fc2(torch.relu(self.fc1(x)))

            inputs = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
            """
        )
    )
    ns: dict = {}
    exec(mod.read_text(), ns)
    net = ns["Net"]()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    url = str(tmp_path / "run")
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=4)) as rec:
        for t in range(9):
            rec.record(t, "param", ttorch.to_canonical(net))
            opt.zero_grad()
            loss = net(ns["inputs"]).pow(2).mean()
            loss.backward()
            opt.step()
    r = cli.invoke(app, ["sparse-update", url, "-m", f"{mod}:Net", "-i", f"{mod}:inputs", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["step_new"] == 8 and got["tensors"] == 4
    assert all(0.0 <= x["kept"] <= 1.0 for x in got["results"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "forward", "-i", "x.npy"], "expected MODULE:ATTR"),
        (["-m", "/nonexistent/m.py:forward", "-i", "x.npy"], "no such file /nonexistent/m.py"),
        (["-m", "no_such_module_xyz:forward", "-i", "x.npy"], "cannot import no_such_module_xyz"),
        (["-m", "{fwd}:nope", "-i", "{fwd}:probe"], "has no attribute 'nope'"),
        (["-m", "{fwd}:forward", "-i", "missing.npy"], "--inputs 'missing.npy': no such file"),
        (
            ["-m", "{fwd}:forward", "-i", "{fwd}:probe", "--from", "5"],
            "no param snapshot at step 5",
        ),
        (["-m", "{fwd}:broken", "-i", "{fwd}:probe"], "KeyError"),
    ],
)
def test_sparse_update_errors(stores, fwd_file, args, message):  # noqa: F811
    args = [a.replace("{fwd}", str(fwd_file)) for a in args]
    r = cli.invoke(app, ["sparse-update", stores["healthy"], *args])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split()), r.output


def test_sparse_update_needs_snapshots(stores, fwd_file):  # noqa: F811
    url = stores["sigmoid_deep"]  # recorded without full snapshots
    r = cli.invoke(
        app, ["sparse-update", url, "-m", f"{fwd_file}:forward", "-i", f"{fwd_file}:probe"]
    )
    assert r.exit_code == 2
    out = " ".join(r.output.split())
    assert url in out and "param snapshots at two steps" in out and "full_every" in out
