"""CLI: ls, health, anomalies, report, monitor, export, rm, and errors on bad stores."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pandas as pd
import pytest
from _stores import NAN_STEP, NAN_TENSOR, stores  # noqa: F401
from typer.testing import CliRunner

import traintape
from traintape.cli import app

cli = CliRunner()


def test_health_cli(stores):  # noqa: F811
    r = cli.invoke(app, ["health", stores["sigmoid_deep"]])
    assert r.exit_code == 1, r.output  # critical
    assert "VANISHING" in r.output and "layers/0" in r.output
    j = cli.invoke(app, ["health", stores["healthy"], "--json"])
    assert j.exit_code == 0
    data = json.loads(j.output)
    assert data["status"] != "critical" and len(data["layers"]) == 3


def test_anomalies_cli(stores):  # noqa: F811
    r = cli.invoke(app, ["anomalies", stores["nan"]])
    assert r.exit_code == 0, r.output
    assert f"step {NAN_STEP}" in r.output and NAN_TENSOR in r.output
    j = json.loads(cli.invoke(app, ["anomalies", stores["nan"], "--json"]).output)
    assert j["first_nonfinite"]["tensor"] == NAN_TENSOR
    assert j["first_nonfinite"]["step"] == NAN_STEP


def test_ls(stores, tmp_path):  # noqa: F811
    root = os.path.dirname(stores["healthy"])
    stores["dead"]
    r = cli.invoke(app, ["ls", root, "--json"])
    assert r.exit_code == 0, r.output
    rows = {os.path.basename(x["path"]): x for x in json.loads(r.output)}
    assert rows["healthy"]["rows"] == 40 and rows["healthy"]["last_step"] == 39
    assert rows["healthy"]["framework"] == "jax" and rows["healthy"]["status"] == "closed"
    assert rows["healthy"]["size_bytes"] > 0
    table = cli.invoke(app, ["ls", root])
    assert "healthy" in table.output and "jax" in table.output
    assert cli.invoke(app, ["ls", str(tmp_path / "none")]).exit_code == 2


def test_export_formats(stores, tmp_path):  # noqa: F811
    run = traintape.open_run(stores["healthy"])
    r = cli.invoke(app, ["export", stores["healthy"], "-o", str(tmp_path / "pq"), "-f", "parquet"])
    assert r.exit_code == 0, r.output
    df = pd.read_parquet(tmp_path / "pq" / "stats_grad.parquet")
    pd.testing.assert_frame_equal(df, run.stats("grad"))
    met = pd.read_parquet(tmp_path / "pq" / "metrics.parquet")
    np.testing.assert_allclose(met["loss"], run.metrics()["loss"])
    r = cli.invoke(app, ["export", stores["healthy"], "-o", str(tmp_path / "c"), "-f", "csv"])
    assert r.exit_code == 0
    assert len(pd.read_csv(tmp_path / "c" / "stats_param.csv")) == 40 * 6
    out = str(tmp_path / "x.npz")
    r = cli.invoke(app, ["export", stores["healthy"], "-o", out, "-f", "npz", "--snapshots"])
    assert r.exit_code == 0, r.output
    z = np.load(out)
    np.testing.assert_array_equal(z["stats_update"], run.stats_array("update"))
    np.testing.assert_array_equal(
        z["snapshot/param/layers/0/kernel"][1], run.snapshot("layers/0/kernel", "param", 10)
    )
    assert cli.invoke(app, ["export", stores["healthy"], "-o", out, "-f", "xls"]).exit_code == 2


def test_rm_asks_unless_yes(tmp_path):
    url = str(tmp_path / "r")
    with traintape.Recorder(url) as rec:
        rec.log(0, loss=1.0)
    r = cli.invoke(app, ["rm", url], input="n\n")
    assert r.exit_code == 1 and os.path.isdir(url)
    r = cli.invoke(app, ["rm", url], input="y\n")
    assert r.exit_code == 0 and not os.path.exists(url)
    with traintape.Recorder(url) as rec:
        rec.log(0, loss=1.0)
    assert cli.invoke(app, ["rm", url, "--yes"]).exit_code == 0
    assert not os.path.exists(url)
    # something that is not a store is refused
    (tmp_path / "keep").mkdir()
    assert cli.invoke(app, ["rm", str(tmp_path / "keep"), "--yes"]).exit_code == 2
    assert (tmp_path / "keep").is_dir()


_WRITER = """
import sys, time, numpy as np, traintape
with traintape.Recorder(sys.argv[1], flush_every_steps=1, flush_every_seconds=0.05) as rec:
    for t in range(int(sys.argv[2])):
        rec.record(t, "grad", {"net/0/kernel": np.full((3, 3), t + 1.0, np.float32)})
        rec.log(t, loss=1.0 / (t + 1))
        rec.flush()
        time.sleep(0.1)
"""


def test_monitor_follows_a_run_written_by_another_process(tmp_path):
    url = str(tmp_path / "live")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, url, "30"])
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(url, "zarr.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = []
        for _ in range(2):
            time.sleep(0.6)
            r = cli.invoke(app, ["monitor", url, "--once"])
            assert r.exit_code == 0, r.output
            seen.append(r.output)
        assert "net/0" in seen[-1] and "loss" in seen[-1]
        r = cli.invoke(app, ["monitor", url, "--max-seconds", "0.5", "--interval", "0.1"])
        assert r.exit_code == 0, r.output
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    r = cli.invoke(app, ["monitor", url, "--once"])
    flat = " ".join(r.output.split())
    assert "closed" in flat and "30 rows" in flat and "last step 29" in flat
    # the last row's grad norm of layer net/0: ||full((3, 3), 30)|| = 90
    assert re.search(r"net/0\s*│\s*90\s", r.output), r.output
    # while it was being written, the monitor saw a committed prefix of the run
    rows = [int(re.search(r"(\d+) rows", " ".join(s.split()))[1]) for s in seen]
    assert all(0 <= n <= 30 for n in rows)
    assert "open" in " ".join(seen[0].split())


@pytest.mark.parametrize("name", ["healthy"])
def test_report_cli_writes_file(stores, tmp_path, name):  # noqa: F811
    out = tmp_path / "r.html"
    r = cli.invoke(app, ["report", stores[name], "-o", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert text.count("data:image/png;base64,") >= 5
    assert "http://" not in text and "https://" not in text


def test_monitor_waits_for_a_run_started_after_it(tmp_path):
    """`monitor --wait`: started before training, it follows the run once it appears; a run
    that never appears is an error naming the path."""
    url = str(tmp_path / "later")
    started = threading.Event()

    def train_later() -> None:
        started.wait(10)
        time.sleep(0.5)
        with traintape.Recorder(url) as rec:
            for t in range(5):
                rec.log(t, loss=1.0 / (t + 1))

    th = threading.Thread(target=train_later)
    th.start()
    started.set()
    r = cli.invoke(
        app, ["monitor", url, "--wait", "30", "--interval", "0.1", "--max-seconds", "20"]
    )
    th.join()
    assert r.exit_code == 0, r.output
    assert "loss" in r.output
    missing = str(tmp_path / "never")
    r = cli.invoke(app, ["monitor", missing, "--wait", "0.3", "--once"])
    assert r.exit_code == 2 and "never" in r.output
