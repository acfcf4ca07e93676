"""traintape on S3, against a local ``moto_server`` (started on a free 127.0.0.1 port and
stopped by PID here): endpoint and credentials from the standard AWS environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from _procs import MOTO, free_port, moto_server

import traintape
from traintape.analysis import compare

pytestmark = pytest.mark.skipif(
    shutil.which(str(MOTO)) is None, reason="moto[server] is not installed"
)
BUCKET = "traintape-test"


@pytest.fixture(scope="module")
def endpoint():
    with moto_server(BUCKET) as url:
        yield url


@pytest.fixture
def s3(endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return endpoint


def _record(url: str, steps: int = 6) -> None:
    rng = np.random.default_rng(0)
    pol = traintape.CapturePolicy(full_every=3)
    with traintape.Recorder(url, pol, flush_every_steps=2) as rec:
        for t in range(steps):
            rec.record(t, "param", {"layer/kernel": rng.normal(size=(8, 4)).astype("float32"),
                                    "layer/bias": rng.normal(size=4).astype("float32")})  # fmt: skip
            rec.log(t, loss=float(1.0 / (t + 1)))


def test_record_read_validate_compare_ls_on_s3(s3, tmp_path):
    url = f"s3://{BUCKET}/runs/a"
    _record(url)
    local = str(tmp_path / "a")
    _record(local)
    a, b = traintape.open_run(url), traintape.open_run(local)
    assert list(a.steps) == list(range(6))
    np.testing.assert_array_equal(a.stats_array("param"), b.stats_array("param"))
    for step in (0, 3):  # snapshots read back bit-exact
        np.testing.assert_array_equal(
            a.snapshot("layer/kernel", "param", step), b.snapshot("layer/kernel", "param", step)
        )
    np.testing.assert_array_equal(a.metrics()["loss"].to_numpy(), b.metrics()["loss"].to_numpy())
    assert traintape.validate(url).ok
    assert compare(url, local, strict=True).identical
    cli = [sys.executable, "-c", "from traintape.cli import main; main()"]
    env = dict(os.environ)
    out = subprocess.run([*cli, "ls", f"s3://{BUCKET}/runs"], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "a" in out.stdout and "6" in out.stdout
    out = subprocess.run([*cli, "compare", url, local], capture_output=True, text=True, env=env,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:]


def test_resume_on_s3_appends(s3):
    url = f"s3://{BUCKET}/runs/resumed"
    _record(url, steps=3)
    with traintape.Recorder(url) as rec:
        rec.record(3, "param", {"layer/kernel": np.ones((8, 4), "float32"),
                                "layer/bias": np.ones(4, "float32")})  # fmt: skip
    run = traintape.open_run(url)
    assert list(run.steps) == [0, 1, 2, 3]
    assert traintape.validate(url).ok


def test_deleted_object_inside_committed_range_fails_validate(s3):
    url = f"s3://{BUCKET}/runs/damaged"
    _record(url)
    from traintape.core.kvstore import KvStore

    kv = KvStore(url)
    chunk = next(k for k in kv.list("stats/param/c/") if k.startswith("stats/param/c/"))
    kv.delete(chunk)
    rep = traintape.validate(url)
    assert not rep.ok
    assert any("stats/param" in p for p in rep.problems), rep.problems


def test_unreachable_endpoint_fails_fast_naming_the_url(tmp_path):
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1",
           "TRAINTAPE_REMOTE_RETRIES": "1"}  # fmt: skip
    code = (
        "import traintape as tt\n"
        "try:\n    tt.Recorder('s3://nowhere-bucket/run')\n"
        "except Exception as e:\n    print('error:', e)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)  # fmt: skip
    assert time.monotonic() - t0 < 60
    assert out.stdout.startswith("error:") and "nowhere-bucket" in out.stdout, out.stdout


def test_second_writer_on_a_live_s3_store_is_refused(s3):
    """The claim on S3: a writer that starts while another lives is refused (it reads
    the live claim). moto does not honour conditional creates (If-None-Match), so two
    writers starting in the same instant are not separated there — see the README."""
    url = f"s3://{BUCKET}/runs/claimed"
    first = traintape.Recorder(url)
    try:
        with pytest.raises(traintape.StoreError, match="writer"):
            traintape.Recorder(url)
        first.log(0, loss=1.0)
    finally:
        first.close()
    assert list(traintape.open_run(url).steps) == [0]


def test_rewind_on_s3(s3):
    url = f"s3://{BUCKET}/runs/rewound"
    _record(url, steps=6)
    with traintape.Recorder(url, resume_step=4) as rec:
        for t in (4, 5, 6):
            rec.log(t, loss=10.0 + t)
    run = traintape.open_run(url)
    assert list(run.steps) == [0, 1, 2, 3, 4, 5, 6]
    assert list(run.metrics()["loss"].to_numpy()[4:]) == [14.0, 15.0, 16.0]
    ev = [e for e in run.events() if e.type == "rewind"]
    ab = traintape.open_run(ev[0].data["abandoned"])
    assert list(ab.steps) == [4, 5]
    assert list(ab.metrics()["loss"].to_numpy()) == [1 / 5, 1 / 6]
    assert traintape.validate(url).ok


def test_a_kvstore_spec_goes_wherever_a_url_goes(endpoint, monkeypatch, tmp_path):
    """A TensorStore kvstore spec (dict, or its JSON text on the command line) with its own
    endpoint — nothing in the AWS environment but credentials — records, reads, validates,
    lists, rewinds and compares like a URL."""
    import json

    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    spec = {"driver": "s3", "bucket": BUCKET, "path": "specs/a", "endpoint": endpoint,
            "aws_region": "us-east-1"}  # fmt: skip
    _record(spec)
    local = str(tmp_path / "a")
    _record(local)
    run = traintape.open_run(spec)
    assert list(run.steps) == list(range(6))
    np.testing.assert_array_equal(
        run.snapshot("layer/kernel", "param", 3),
        traintape.open_run(local).snapshot("layer/kernel", "param", 3),
    )
    assert traintape.validate(spec).ok
    assert compare(spec, local).identical
    cli = [sys.executable, "-c", "from traintape.cli import main; main()"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT")}
    text = json.dumps(spec)
    for args in (["validate", text], ["show", text]):
        r = subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    prefix = json.dumps({**spec, "path": "specs"})
    r = subprocess.run([*cli, "ls", prefix, "--json"], capture_output=True, text=True,
                       env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 1 and rows[0]["path"].endswith("/a/") and rows[0]["rows"] == 6, rows
    traintape.Recorder(spec, traintape.CapturePolicy(full_every=3), resume_step=4).close()
    assert list(traintape.open_run(spec).steps) == [0, 1, 2, 3]
    assert list(traintape.open_run({**spec, "path": "specs/a/abandoned/0"}).steps) == [4, 5]


def test_a_malformed_spec_is_refused_naming_it():
    with pytest.raises(ValueError, match="not a registered KvStore driver"):
        traintape.open_run({"driver": "nope"})
    with pytest.raises(ValueError, match="JSON object with a 'driver'"):
        traintape.open_run({"bucket": "x"})


def test_every_cli_command_on_an_s3_run(s3, tmp_path):
    """show, validate, health, anomalies, report, export, monitor, compare, ls and rm take an
    s3:// URL like a path (issue: every CLI command on object storage)."""
    from typer.testing import CliRunner

    from traintape.cli import app

    url = f"s3://{BUCKET}/runs/cli"
    rng = np.random.default_rng(1)
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=4)) as rec:
        for t in range(12):
            arrays = {f"l{i}/kernel": rng.normal(size=(6, 6)).astype("float32") for i in range(3)}
            rec.record(t, "param", arrays)
            rec.record(t, "grad", {k: 0.1 * v for k, v in arrays.items()})
            rec.log(t, loss=float(1.0 / (t + 1)))
    runner = CliRunner()

    def ok(*args: str) -> str:
        r = runner.invoke(app, list(args), env={"COLUMNS": "200"})
        assert r.exit_code == 0, (args, r.output[-2000:], r.exception)
        return r.output

    assert "12" in ok("show", url)
    assert "valid" in ok("validate", url).lower()
    assert "l1" in ok("health", url)
    ok("anomalies", url, "--json")
    html = tmp_path / "r.html"
    ok("report", url, "-o", str(html))
    assert html.stat().st_size > 10_000 and "l2" in html.read_text()
    ok("export", url, str(tmp_path / "pq"), "--to", "parquet")
    import pandas as pd

    frames = [pd.read_parquet(p) for p in (tmp_path / "pq").glob("*.parquet")]
    assert frames and sum(len(f) for f in frames) > 0
    assert "loss" in ok("monitor", url, "--once")
    assert ok("compare", url, url).strip()
    assert "cli" in ok("ls", f"s3://{BUCKET}/runs")
    ok("rm", url, "--yes")
    r = runner.invoke(app, ["show", url])
    assert r.exit_code != 0  # gone
    assert "cli" not in ok("ls", f"s3://{BUCKET}/runs")
