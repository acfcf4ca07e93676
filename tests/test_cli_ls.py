"""``traintape ls`` (issue 26 items 5-7): live / stale / closed from the writer claim, the
last loss and the last step's time, the size of a run or "–" (never a wrong "0 B" for
an S3 run), no AWS SDK noise on stderr, and full-width output when not a terminal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from _procs import MOTO, moto_server

import traintape

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from traintape.cli import main; main()"]

# a writer that records 3 steps, says so, then keeps the store open until killed
_HOLDER = """
import sys, time, numpy as np, traintape
rec = traintape.Recorder(sys.argv[1], flush_every_steps=1)
for t in range(3):
    rec.record(t, "grad", {"net/0/kernel": np.full((3, 3), t + 1.0, np.float32)})
    rec.log(t, loss=1.0 / (t + 1))
rec.flush()
print("ready", flush=True)
time.sleep(600)
"""


def _ls(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*CLI, "ls", *args], capture_output=True, text=True, timeout=300,
                       env=env or {**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _closed_run(path: str, steps: int = 4) -> None:
    with traintape.Recorder(path) as rec:
        for t in range(steps):
            rec.record(t, "grad", {"net/0/kernel": np.full((3, 3), t + 1.0, np.float32)})
            rec.log(t, loss=1.0 / (t + 1), lr=0.1)


def test_ls_tells_live_stale_and_closed_runs_apart(tmp_path):
    root = tmp_path / "runs"
    _closed_run(str(root / "done"))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root / "running")],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        rows = {Path(x["path"]).name: x for x in json.loads(_ls(str(root), "--json").stdout)}
        assert rows["done"]["status"] == "closed" and rows["done"]["writer"] is None
        assert rows["running"]["status"] == "live"
        assert rows["running"]["writer"]["pid"] == holder.pid
        table = _ls(str(root)).stdout
        assert "live" in table and "closed" in table
    finally:
        holder.send_signal(signal.SIGKILL)  # killed: its claim stays, its process is gone
        holder.wait(timeout=60)
    rows = {Path(x["path"]).name: x for x in json.loads(_ls(str(root), "--json").stdout)}
    assert rows["running"]["status"] == "stale"  # open, but nobody writes it any more
    assert rows["running"]["writer"]["pid"] == holder.pid
    assert "stale" in _ls(str(root)).stdout
    # the next Recorder takes the stale claim over and resumes the run
    with traintape.Recorder(str(root / "running")) as rec:
        rec.record(3, "grad", {"net/0/kernel": np.ones((3, 3), np.float32)})
    rows = {Path(x["path"]).name: x for x in json.loads(_ls(str(root), "--json").stdout)}
    assert rows["running"]["status"] == "closed"


def test_ls_shows_the_last_loss_and_the_last_steps_time(tmp_path):
    root = tmp_path / "runs"
    _closed_run(str(root / "a"), steps=4)
    with traintape.Recorder(str(root / "b"), system_metrics=False) as rec:  # no loss, no sys/
        for t in range(3):
            rec.record(t, "grad", {"w": np.ones(2, np.float32)})
            rec.log(t, accuracy=0.5 + t / 10)
    with traintape.Recorder(str(root / "c")) as rec:  # loss logged on some steps only
        for t in range(5):
            rec.record(t, "grad", {"w": np.ones(2, np.float32)})
            if t % 2 == 0:
                rec.log(t, {"train/loss": 10.0 - t})
    rows = {Path(x["path"]).name: x for x in json.loads(_ls(str(root), "--json").stdout)}
    assert rows["a"]["metric"] == {"name": "loss", "value": 0.25, "step": 3}
    assert rows["b"]["metric"] == {"name": "accuracy", "value": pytest.approx(0.7), "step": 2}
    assert rows["c"]["metric"] == {"name": "train/loss", "value": 6.0, "step": 4}
    # the last step's time is its row's sys/time; without system metrics, the last update
    sys_time = traintape.open_run(str(root / "a")).system()["sys/time"].iloc[-1]
    want = datetime.fromtimestamp(sys_time, UTC).isoformat(timespec="seconds")
    assert rows["a"]["last_step_time"] == want
    b = traintape.open_run(str(root / "b")).manifest.updated_at
    assert rows["b"]["last_step_time"] == b.isoformat(timespec="seconds")
    table = _ls(str(root)).stdout
    assert "loss 0.25 @ 3" in table and "train/loss 6 @ 4" in table
    assert want[:19].replace("T", " ") in table


def test_ls_output_is_not_cut_when_not_a_terminal(tmp_path):
    """Piped (no terminal), a table keeps every column and every long name whole."""
    name = "a-run-with-a-rather-long-descriptive-name-that-a-pipe-must-not-cut"
    _closed_run(str(tmp_path / name))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = _ls(str(tmp_path), env={**env, "PYTHONPATH": str(REPO)}).stdout
    assert name in out  # not folded over several lines
    header = next(line for line in out.splitlines() if "framework" in line)
    for col in ("run", "steps", "framework", "size", "status", "last metric", "last step at"):
        assert col in header
    assert max(len(line) for line in out.splitlines()) > 80


@pytest.mark.skipif(shutil.which(str(MOTO)) is None, reason="moto[server] is not installed")
def test_ls_on_s3_shows_no_wrong_size_and_no_aws_config_noise(tmp_path):
    bucket = "traintape-ls"
    with moto_server(bucket) as endpoint:
        home = tmp_path / "home"  # no ~/.aws: the usual case with environment credentials
        home.mkdir()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "PYTHONPATH": str(REPO),
               "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}  # fmt: skip
        rec = subprocess.run(
            [sys.executable, "-c",
             "import sys, numpy as np, traintape\n"
             "with traintape.Recorder(sys.argv[1]) as rec:\n"
             "    for t in range(3):\n"
             "        rec.record(t, 'grad', {'w': np.ones(4, np.float32)}); rec.log(t, loss=t)\n",
             f"s3://{bucket}/runs/a"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert rec.returncode == 0, rec.stderr[-3000:]
        assert rec.stderr == ""  # recording says nothing either
        js = _ls(f"s3://{bucket}/runs", "--json", env=env)
        (row,) = json.loads(js.stdout)
        assert row["size_bytes"] is None and row["rows"] == 3 and row["status"] == "closed"
        assert row["metric"] == {"name": "loss", "value": 2.0, "step": 2}
        table = _ls(f"s3://{bucket}/runs", env=env)
        assert "0 B" not in table.stdout and "–" in table.stdout
        for r in (js, table):
            assert "AWS_ERROR" not in r.stderr and "Failed to open file" not in r.stderr
            assert r.stderr == ""
        # a real error still says so, naming the location: a bucket that does not exist
        bad = subprocess.run([*CLI, "ls", "s3://no-such-bucket-here/runs"], capture_output=True,
                             text=True, env=env, timeout=300)  # fmt: skip
        assert bad.returncode == 2 and "no-such-bucket-here" in bad.stderr


def test_health_and_monitor_columns_say_which_statistic_they_show(tmp_path):
    """``health`` shows medians over steps, ``monitor`` the last step's norms and each
    metric's last logged value, each in a column that says so (metric values are not
    under a "grad norm" heading)."""
    from typer.testing import CliRunner

    from traintape.cli import app

    run = str(tmp_path / "run")
    rng = np.random.default_rng(0)
    with traintape.Recorder(run) as rec:
        for t in range(6):
            w = rng.normal(size=(4, 3)).astype(np.float32)
            rec.record(t, "param", {"net/0/kernel": w})
            rec.record(t, "grad", {"net/0/kernel": np.full((4, 3), 0.5, np.float32)})
            rec.record(t, "update", {"net/0/kernel": np.full((4, 3), 0.01, np.float32)})
            rec.log(t, loss=3.0 - t)
    health = CliRunner().invoke(app, ["health", run])
    assert health.exit_code in (0, 1), health.output
    head = next(line for line in health.output.splitlines() if "┃ layer" in line)
    assert "median grad norm" in head and "median update/param" in head
    mon = CliRunner().invoke(app, ["monitor", run, "--once"])
    assert mon.exit_code == 0, mon.output
    head = next(line for line in mon.output.splitlines() if "layer / metric" in line)
    assert "grad norm: last step" in head and "metric: last logged" in head
    cells = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]]
             for ln in mon.output.splitlines() if ln.startswith("│")}  # fmt: skip
    assert cells["loss"] == ["", "", "-2"]  # under "metric: last logged" only
    assert cells["net/0"][0] == f"{np.linalg.norm(np.full((4, 3), 0.5)):.3g}"  # last step
