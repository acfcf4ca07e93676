"""The demo trains, learns and leaves a valid store."""

from __future__ import annotations

import traintape
from traintape import Kind
from traintape.demo import run_demo, summary


def test_demo_records_a_valid_learning_run(tmp_path) -> None:
    out = str(tmp_path / "demo")
    res = run_demo(out, steps=40, full_every=20, progress=False)
    assert res.steps == 40
    assert res.final_loss < 0.8 * res.first_loss
    run = traintape.open_run(out)
    assert traintape.validate(out).ok
    assert "layers/0/kernel" in run.tensor_names(Kind.GRAD)
    assert "norm/output" in run.tensor_names(Kind.ACTIVATION)
    assert list(run.snapshot_steps("head/kernel", Kind.UPDATE)) == [0, 20]
    assert len(run.metrics()["loss"]) == 40
    assert f"traintape validate {out}" in summary(res)


def test_demo_summary_and_anomalies_command_agree(tmp_path) -> None:
    import os
    import subprocess
    import sys

    out = str(tmp_path / "demo")
    res = run_demo(out, steps=120, full_every=60, progress=False)
    line = f"anomalies: {res.anomalies}"
    assert line in summary(res)
    env = {**os.environ, "COLUMNS": "400"}
    cli = subprocess.run(
        [sys.executable, "-c", "from traintape.cli import main; main()", "anomalies", out],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.splitlines()[0] == line
