"""Bridges: a small real run exported to TensorBoard (read back with TensorBoard's own
event reader) and to an offline W&B run (read back from its transaction log with W&B's
own protos), through the Python API and the CLI."""

from __future__ import annotations

import glob
import ipaddress
import json
import os
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

import traintape
from traintape.analysis import export_tensorboard, export_wandb
from traintape.analysis.bridges import DEFAULT_STATS, histogram
from traintape.cli import app

cli = CliRunner()

STEPS, FULL = 12, 5
NAN_STEP = 10  # a snapshot step: one grad value is NaN there
SHAPES = {"dense/kernel": (4, 3), "dense/bias": (3,), "out/kernel": (3, 2)}


@pytest.fixture(scope="module")
def run_url(tmp_path_factory) -> str:
    """12 steps of a tiny numpy model: param and grad every step, activations on even
    steps only, snapshots every 5 steps, ``loss`` every step and ``lr`` on even steps."""
    url = str(tmp_path_factory.mktemp("bridges") / "run")
    rng = np.random.default_rng(0)
    w = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=FULL)) as rec:
        for t in range(STEPS):
            g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in w.items()}
            if t == NAN_STEP:
                g["dense/bias"][0] = np.nan
            rec.record(t, "param", w)
            rec.record(t, "grad", g)
            if t % 2 == 0:
                rec.record(t, "activation", {"dense/output": rng.standard_normal((8, 3))})
            rec.log(t, loss=1.0 / (t + 1), **({"lr": 0.1 * 0.9**t} if t % 2 == 0 else {}))
            w = {k: v - 0.1 * np.nan_to_num(g[k]) for k, v in w.items()}
    return url


# ------------------------------------------------------------------------- TensorBoard


def _accumulator(logdir: str):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(
        logdir, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0, ea.HISTOGRAMS: 0}
    )
    return acc.Reload()


def test_tensorboard_scalars_and_histograms_equal_the_store(run_url, tmp_path):
    from tensorboard.util import tensor_util

    run = traintape.open_run(run_url)
    path = export_tensorboard(run, tmp_path / "tb")
    assert os.path.dirname(path) == str(tmp_path / "tb") and "tfevents" in path
    acc = _accumulator(str(tmp_path / "tb"))
    scalars = set(acc.Tags()["scalars"])
    for kind in ("param", "grad", "activation"):
        df = run.stats(kind)
        for name in run.tensor_names(kind):
            mine = df[df.tensor == name]
            for stat in DEFAULT_STATS:
                ev = acc.Scalars(f"{kind}/{name}/{stat}")
                assert [e.step for e in ev] == mine.step.tolist(), (kind, name, stat)
                np.testing.assert_allclose(
                    [e.value for e in ev], mine[stat].to_numpy(), rtol=1e-6, atol=1e-30
                )
    assert not any(t.endswith("/zero_frac") for t in scalars)  # not a default stat
    assert [e.step for e in acc.Scalars("activation/dense/output/l2")] == list(range(0, 12, 2))
    # metrics and system metrics at their steps; event wall time = the row's sys/time
    met, sysm = run.metrics(), run.system()
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(STEPS))
    np.testing.assert_allclose([e.value for e in loss], met["loss"], rtol=1e-6)
    assert [e.step for e in acc.Scalars("lr")] == met["lr"].dropna().index.tolist()
    assert [e.step for e in acc.Scalars("sys/rss_bytes")] == sysm.index.tolist()
    np.testing.assert_allclose([e.wall_time for e in loss], sysm["sys/time"], rtol=0, atol=1e-6)
    # histograms of the snapshots (finite values only), in the histogram plugin's format
    snap_steps = run.snapshot_steps("dense/kernel", "param").tolist()
    assert snap_steps == [0, 5, 10]
    tensors = set(acc.Tags()["tensors"])
    assert tensors == {f"{k}/{n}/histogram" for k in ("param", "grad") for n in SHAPES} | {
        "activation/dense/output/histogram"
    }
    for kind in ("param", "grad"):
        for name, shape in SHAPES.items():
            tag = f"{kind}/{name}/histogram"
            assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "histograms"
            evs = acc.Tensors(tag)
            assert [e.step for e in evs] == snap_steps
            for e in evs:
                b = tensor_util.make_ndarray(e.tensor_proto)  # [bins, 3]: left, right, count
                assert b.shape == (30, 3)
                x = run.snapshot(name, kind, e.step)
                nan = kind == "grad" and name == "dense/bias" and e.step == NAN_STEP
                assert b[:, 2].sum() == int(np.prod(shape)) - nan
                fin = x[np.isfinite(x)]
                assert b[0, 0] == pytest.approx(fin.min()) and b[-1, 1] == pytest.approx(fin.max())
                np.testing.assert_array_equal(b[:, 2], histogram(x, 30)[0])
    act = acc.Tensors("activation/dense/output/histogram")
    assert [e.step for e in act] == [0, 10]  # no activation recorded at step 5


def test_tensorboard_options_overwrite_and_errors(run_url, tmp_path):
    run = traintape.open_run(run_url)
    d = tmp_path / "tb"
    export_tensorboard(run, d, kinds=["grad"], stats=["zero_frac"], histograms=False,
                       metrics=False, system=False)  # fmt: skip
    acc = _accumulator(str(d))
    assert set(acc.Tags()["scalars"]) == {f"grad/{n}/zero_frac" for n in SHAPES}
    assert acc.Tags()["tensors"] == []
    with pytest.raises(FileExistsError, match="overwrite"):
        export_tensorboard(run, d)
    export_tensorboard(run, d, overwrite=True, bins=7)
    assert len(glob.glob(str(d / "*tfevents*"))) == 1
    acc = _accumulator(str(d))
    tags = acc.Tags()["scalars"]
    assert (
        "loss" in tags and "grad/dense/bias/l2" in tags and "grad/dense/bias/zero_frac" not in tags
    )
    from tensorboard.util import tensor_util

    assert tensor_util.make_ndarray(
        acc.Tensors("param/out/kernel/histogram")[0].tensor_proto
    ).shape == (7, 3)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "events.out.tfevents.1.host").write_bytes(b"")
    with pytest.raises(FileExistsError, match="did not write"):
        export_tensorboard(run, tmp_path / "foreign", overwrite=True)
    with pytest.raises(ValueError, match="not in this run"):
        export_tensorboard(run, tmp_path / "x", kinds=["update"])
    with pytest.raises(ValueError, match="unknown stat"):
        export_tensorboard(run, tmp_path / "x", stats=["l3"])
    with pytest.raises(ValueError, match="bins"):
        export_tensorboard(run, tmp_path / "x", bins=513)


def test_tensorboard_streamed_in_blocks_of_one_row(run_url, tmp_path, monkeypatch):
    import importlib

    export_mod = importlib.import_module("traintape.analysis.export")
    run = traintape.open_run(run_url)
    export_tensorboard(run, tmp_path / "whole")
    monkeypatch.setattr(export_mod, "BLOCK_VALUES", 1)  # one row per block
    calls: list[tuple[str, int, int]] = []
    export_tensorboard(run, tmp_path / "rows", progress=lambda *a: calls.append(a))
    assert calls[-1][1] == calls[-1][2] == STEPS + 3 * 6 + 2  # rows + snapshot tensors
    a, b = _accumulator(str(tmp_path / "whole")), _accumulator(str(tmp_path / "rows"))
    assert a.Tags()["scalars"] == b.Tags()["scalars"]
    for tag in a.Tags()["scalars"]:
        assert [(e.step, e.value) for e in a.Scalars(tag)] == [
            (e.step, e.value) for e in b.Scalars(tag)
        ]


def test_record_crc_is_tensorboards():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from traintape.analysis.bridges import _masked_crc32c

    crc = _masked_crc32c()
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 100, 4097):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert crc(data) == masked_crc32c(data)


# ------------------------------------------------------------------------------- W&B


def _wandb_records(path: str):
    """The records of a W&B transaction log (``run-<id>.wandb``): a ``:W&B`` header, then
    LevelDB-log framing (32 KiB blocks; full / first / middle / last fragments) around
    serialized ``wandb_internal.Record`` protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:16]
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and n == 0:  # zero padding up to the block end
            pos += left - 7
            continue
        chunk = data[pos : pos + n]
        pos += n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts + chunk if kind == 4 else chunk)
            parts = b""
            yield rec
        else:
            parts = (parts if kind == 3 else b"") + chunk


def _history(run_dir: str) -> tuple[dict[int, dict], list]:
    """``{step: {key: value}}`` of the logged history, and the run records."""
    (log,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    rows: dict[int, dict] = {}
    runs = []
    for rec in _wandb_records(log):
        which = rec.WhichOneof("record_type")
        if which == "run":
            runs.append(rec.run)
        elif which == "history":
            row: dict = {}
            for item in rec.history.item:
                path = [item.key] if item.key else list(item.nested_key)
                value = json.loads(item.value_json)
                if len(path) == 1:
                    row[path[0]] = value
                else:  # a media value: {"_type": "histogram", "values": [...], ...}
                    row.setdefault(path[0], {})[path[1]] = value
            rows[rec.history.step.num] = row
    return rows, runs


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline and silent, its config/cache/data in tmp; any connection leaving the
    machine from this process fails the test."""
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):  # fmt: skip
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    reached: list = []
    real_connect = socket.socket.connect

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            try:
                local = ipaddress.ip_address(host).is_loopback
            except ValueError:
                local = host == "localhost"
            if not local:
                reached.append(address)
                raise OSError(f"test: no network ({address})")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    yield
    assert not reached, reached
    import psutil

    left = [p for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]
    assert not left, f"W&B service processes still running: {left}"
    # the service was started without its own telemetry / error reporting
    for log in glob.glob(str(tmp_path / "wandb-home" / "cache" / "**" / "core-debug*.log"),
                         recursive=True):  # fmt: skip
        with open(log) as f:
            assert '"disable-analytics":false' not in f.read(), log


def test_wandb_offline_run_holds_the_same_content(run_url, tmp_path, offline_wandb):
    run = traintape.open_run(run_url)
    t0 = time.monotonic()
    run_dir = export_wandb(run, tmp_path / "wb", project="tt-test")
    took = time.monotonic() - t0
    print(f"export_wandb took {took:.2f} s")
    assert run_dir.startswith(str(tmp_path / "wb" / "wandb" / "offline-run-"))
    rows, runs = _history(run_dir)
    assert runs and runs[0].display_name == run.manifest.run_id
    assert runs[0].project == "tt-test"
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["traintape"]["run_id"] == run.manifest.run_id
    assert config["export"]["stats"] == list(DEFAULT_STATS)
    assert sorted(rows) == list(range(STEPS))  # one history row per optimizer step
    for kind in ("param", "grad", "activation"):
        df = run.stats(kind)
        for r in df.itertuples():
            for stat in DEFAULT_STATS:
                got = rows[r.step][f"{kind}/{r.tensor}/{stat}"]
                want = getattr(r, stat)
                assert got == want or (np.isnan(want) and got != got), (kind, r, stat)
    assert "activation/dense/output/l2" not in rows[1]  # not recorded at odd steps
    met, sysm = run.metrics(), run.system()
    for step in range(STEPS):
        assert rows[step]["loss"] == met.loc[step, "loss"]
        assert ("lr" in rows[step]) == (step % 2 == 0)
        assert rows[step]["sys/time"] == sysm.loc[step, "sys/time"]
        assert rows[step]["_step"] == step
    for step in (0, 5, 10):
        for name, shape in SHAPES.items():
            h = rows[step][f"param/{name}/histogram"]
            assert h["_type"] == "histogram" and len(h["bins"]) == 31
            assert sum(h["values"]) == int(np.prod(shape))
        assert sum(rows[step]["grad/dense/bias/histogram"]["values"]) == 3 - (step == NAN_STEP)
    assert not any(k.endswith("/histogram") for k in rows[1])
    assert took < 60


def test_wandb_rejects_mode_and_dir(run_url, tmp_path):
    run = traintape.open_run(run_url)
    with pytest.raises(ValueError, match="mode"):
        export_wandb(run, tmp_path / "wb", init={"mode": "online"})


# ------------------------------------------------------------------------------- CLI


def test_cli_export_to_tensorboard(run_url, tmp_path):
    d = tmp_path / "tb"
    r = cli.invoke(app, ["export", run_url, "--to", "tensorboard", str(d)])
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and "tensorboard --logdir" in r.output
    acc = _accumulator(str(d))
    assert "grad/dense/kernel/l2" in acc.Tags()["scalars"] and "loss" in acc.Tags()["scalars"]
    r = cli.invoke(app, ["export", run_url, "--to", "tensorboard", str(d)])
    assert r.exit_code == 2 and "--overwrite" in r.output
    r = cli.invoke(app, ["export", run_url, "--to", "tensorboard", str(d), "--overwrite",
                         "-k", "grad,param", "--stats", "l2", "--no-histograms"])  # fmt: skip
    assert r.exit_code == 0, r.output
    tags = _accumulator(str(d)).Tags()
    assert {t for t in tags["scalars"] if t.endswith("/l2")} == {
        f"{k}/{n}/l2" for k in ("grad", "param") for n in SHAPES
    }
    assert tags["tensors"] == []


def test_cli_export_to_wandb(run_url, tmp_path, offline_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # the export is offline whatever this says
    r = cli.invoke(app, ["export", run_url, "--to", "wandb", str(tmp_path / "wb"),
                         "--project", "cli-test", "--bins", "8"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "wandb sync" in r.output
    (run_dir,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    rows, runs = _history(run_dir)
    assert runs[0].project == "cli-test" and sorted(rows) == list(range(STEPS))
    assert len(rows[5]["param/dense/kernel/histogram"]["values"]) == 8


def test_cli_export_errors(run_url, tmp_path, monkeypatch):
    r = cli.invoke(app, ["export", run_url, "--to", "excel", str(tmp_path / "x")])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "'excel'" in out
    for choice in ("parquet", "csv", "npz", "tensorboard", "wandb"):
        assert choice in out
    r = cli.invoke(app, ["export", run_url, "--to", "tensorboard"])
    assert r.exit_code == 2 and "no destination" in r.output
    r = cli.invoke(app, ["export", run_url, "--to", "tensorboard", str(tmp_path / "a"), "-k",
                         "update"])  # fmt: skip
    assert r.exit_code == 2 and "'update'" in r.output and "grad" in r.output
    r = cli.invoke(app, ["export", run_url, "--to", "wandb", str(tmp_path / "a"), "--stats",
                         "l2,median"])  # fmt: skip
    assert r.exit_code == 2 and "'median'" in r.output
    r = cli.invoke(app, ["export", run_url, "--to", "csv", "-f", "npz", str(tmp_path / "a")])
    assert r.exit_code == 2 and "disagree" in r.output
    # the old spelling still works; DIR and --out are the same thing
    r = cli.invoke(app, ["export", run_url, "-o", str(tmp_path / "c"), "-f", "csv"])
    assert r.exit_code == 0 and (tmp_path / "c" / "metrics.csv").is_file()
    r = cli.invoke(app, ["export", run_url, str(tmp_path / "p")])
    assert r.exit_code == 0 and (tmp_path / "p" / "stats_grad.parquet").is_file()
    # a bridge's package missing: which one to install, exit 2, no traceback
    for target, module in (
        ("wandb", "wandb"),
        ("tensorboard", "tensorboard.compat.proto.event_pb2"),
    ):
        monkeypatch.setitem(sys.modules, module, None)
        r = cli.invoke(app, ["export", run_url, "--to", target, str(tmp_path / target)])
        out = " ".join(r.output.split())
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
        assert f"pip install {target}" in out and "traintape[bridges]" in out
        assert not (tmp_path / target).exists()


def test_bridges_import_neither_tensorflow_nor_torch(run_url, tmp_path):
    code = (
        "import sys, traintape\n"
        "from traintape.analysis import export_tensorboard, export_wandb\n"
        f"run = traintape.open_run({run_url!r})\n"
        f"export_tensorboard(run, {str(tmp_path / 'tb')!r})\n"
        f"export_wandb(run, {str(tmp_path / 'wb')!r})\n"
        "bad = sorted(m for m in ('tensorflow', 'torch', 'jax') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "WANDB_SILENT": "true"}
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[var] = str(tmp_path / "wandb-home" / var)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert glob.glob(str(tmp_path / "tb" / "*tfevents*"))
    assert glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
