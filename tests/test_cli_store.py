from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

import traintape as tt
from traintape.cli import app

runner = CliRunner()


def _run(path: str) -> None:
    with tt.Recorder(path, tt.CapturePolicy(full_every=2)) as rec:
        for s in range(4):
            rec.record(s, "grad", {"fc/kernel": np.full((2, 3), s, np.float32)})
            rec.log(s, loss=1.0 / (s + 1))


def test_validate_ok_and_problem_lines(tmp_path):
    run = str(tmp_path / "r")
    _run(run)
    res = runner.invoke(app, ["validate", run])
    assert res.exit_code == 0 and "valid" in res.stdout
    doc = json.loads(runner.invoke(app, ["validate", run, "--json"]).stdout)
    assert doc["ok"] and doc["chunks_checked"] > 0
    chunk = Path(run) / "stats" / "grad" / "c" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0x55
    chunk.write_bytes(bytes(data))
    res = runner.invoke(app, ["validate", run])
    assert res.exit_code == 1
    assert res.stdout.strip().splitlines()[0].startswith("array stats/grad: chunk at [0, 0, 0]")


def test_validate_missing_store(tmp_path):
    res = runner.invoke(app, ["validate", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "no such file or directory" in res.stdout
    assert str(tmp_path / "nope") in res.stdout


def test_show_summarises(tmp_path):
    run = str(tmp_path / "r")
    _run(run)
    res = runner.invoke(app, ["show", run], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.stdout
    assert (
        "4 rows (steps 0..3)" in res.stdout and "fc/kernel" in res.stdout and "loss" in res.stdout
    )
