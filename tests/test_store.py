from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import traintape as tt
from traintape.core import RecordError, StoreError
from traintape.core.writer import StoreWriter
from traintape.schema import STAT_INDEX, InvalidNameError, SchemaVersionError


def _tensors(rng, step):
    return {
        "enc/layers/0/dense/kernel": rng.normal(size=(8, 16)).astype(np.float32),
        "enc/layers/0/dense/bias": np.full(16, step, dtype=np.float32),
        "enc/layers/1/dense/kernel": rng.normal(size=(16, 4)).astype(np.float32),
        "head/embedding": rng.normal(size=(10, 4)).astype(np.float32),
    }


def _record(url, steps, full_every=3, start=0, **kw):
    rng = np.random.default_rng(start)
    written = {}
    with tt.Recorder(url, tt.CapturePolicy(full_every=full_every), **kw) as rec:
        for step in range(start, start + steps):
            t = _tensors(rng, step)
            rec.record(step, "param", t)
            rec.record(step, "grad", {k: v * 0.1 for k, v in t.items()})
            rec.log(step, loss=1.0 / (step + 1), lr=0.1)
            written[step] = t
    return written


def test_round_trip_stats_snapshots_metrics(run_dir):
    written = _record(run_dir, 10, flush_every_steps=4)
    run = tt.open_run(run_dir)
    assert run.steps.tolist() == list(range(10))
    assert run.manifest.status == "closed"
    assert run.tensor_names("param") == sorted(written[0])
    df = run.stats("param")
    assert list(df.columns[:2]) == ["step", "tensor"] and len(df) == 40
    row = df[(df.step == 7) & (df.tensor == "enc/layers/0/dense/bias")].iloc[0]
    assert row["mean"] == 7.0 and row["std"] == 0.0
    got = df[(df.step == 4) & (df.tensor == "head/embedding")].iloc[0]
    want = tt.core.stat_vector(written[4]["head/embedding"])
    # float32 data: the fused kernel agrees with the float64 reference to the data's precision
    np.testing.assert_allclose(got[list(tt.STAT_NAMES)].to_numpy(float), want, rtol=1e-6, atol=1e-7)
    assert run.snapshot_steps("head/embedding", "param").tolist() == [0, 3, 6, 9]
    np.testing.assert_array_equal(
        run.snapshot("enc/layers/1/dense/kernel", "param", 6),
        written[6]["enc/layers/1/dense/kernel"],
    )
    steps, traj = run.trajectory("enc/layers/0/dense/kernel", "grad", (2, 5))
    assert steps.tolist() == [0, 3, 6, 9]
    np.testing.assert_array_equal(
        traj, [written[s]["enc/layers/0/dense/kernel"][2, 5] * np.float32(0.1) for s in steps]
    )
    m = run.metrics()
    assert m.index.name == "step" and m.loss.iloc[4] == pytest.approx(0.2)
    ds = run.dataset()
    assert ds["stats_grad"].dims == ("step", "tensor_grad", "stat")
    assert tt.validate(run_dir).ok


def test_memory_url_and_resume_appends(mem_url):
    _record(mem_url, 5)
    _record(mem_url, 4, start=5)
    run = tt.open_run(mem_url)
    assert run.steps.tolist() == list(range(9))
    assert run.snapshot_steps("head/embedding", "param").tolist() == [0, 3, 6]
    assert tt.validate(mem_url).ok, tt.validate(mem_url).problems
    with (
        pytest.raises(RecordError, match="not after the last recorded step 8"),
        tt.Recorder(mem_url) as rec,
    ):
        rec.log(8, loss=1.0)


def test_resume_refuses_different_policy(mem_url):
    _record(mem_url, 2)
    with pytest.raises(RecordError, match="different policy"):
        tt.Recorder(mem_url, tt.CapturePolicy(every=5))


def test_policy_every_and_globs(mem_url):
    pol = tt.CapturePolicy(every=2, exclude=("*/bias",), kinds=("grad",))
    with tt.Recorder(mem_url, pol) as rec:
        rng = np.random.default_rng(0)
        for s in range(6):
            t = _tensors(rng, s)
            assert rec.record(s, "param", t) is False  # kind not in policy
            assert rec.record(s, "grad", t) is (s % 2 == 0)
    run = tt.open_run(mem_url)
    assert run.steps.tolist() == [0, 2, 4]
    assert "enc/layers/0/dense/bias" not in run.tensor_names("grad")
    assert run.kinds() == [tt.Kind.GRAD]


def test_wrong_shape_dtype_and_tensor_set_name_the_tensor(mem_url):
    rng = np.random.default_rng(0)
    with tt.Recorder(mem_url) as rec:
        rec.record(0, "param", _tensors(rng, 0))
        bad = _tensors(rng, 1)
        bad["head/embedding"] = np.zeros((10, 5), np.float32)
        with pytest.raises(
            RecordError, match=r"'head/embedding'.*step 1: shape \[10, 5\], expected \[10, 4\]"
        ):
            rec.record(1, "param", bad)
        bad = _tensors(rng, 1)
        bad["head/embedding"] = bad["head/embedding"].astype(np.float64)
        with pytest.raises(RecordError, match=r"'head/embedding'.*dtype float64, expected float32"):
            rec.record(1, "param", bad)
        bad = _tensors(rng, 1)
        del bad["head/embedding"]
        with pytest.raises(RecordError, match=r"missing \['head/embedding'\]"):
            rec.record(1, "param", bad)
        with pytest.raises(InvalidNameError, match=r"segment 1 'b\.c'"):
            rec.record(1, "grad", {"a/b.c": np.zeros(2)})
        rec.record(1, "param", _tensors(rng, 1))
        with pytest.raises(RecordError, match="step 0 is before step 1"):
            rec.log(0, loss=1.0)
        with pytest.raises(RecordError, match="kind param already recorded at step 1"):
            rec.record(1, "param", _tensors(rng, 1))
    # what was recorded before the errors is intact
    run = tt.open_run(mem_url)
    assert run.steps.tolist() == [0, 1]
    assert tt.validate(mem_url).ok


def test_nan_inf_recorded_counted_and_evented(mem_url):
    with tt.Recorder(mem_url) as rec:
        x = np.array([1.0, np.nan, np.inf, 2.0], np.float32)
        rec.record(0, "grad", {"l/kernel": x})
        rec.record(1, "grad", {"l/kernel": x})
        rec.log(1, loss=float("nan"))
    run = tt.open_run(mem_url)
    a = run.stats_array("grad")
    assert a[0, 0, STAT_INDEX["nan_count"]] == 1 and a[0, 0, STAT_INDEX["inf_count"]] == 1
    assert a[0, 0, STAT_INDEX["mean"]] == 1.5
    types = [(e.type, e.step, e.tensor) for e in run.events()]
    assert ("nan", 0, "l/kernel") in types and ("inf", 0, "l/kernel") in types
    assert ("nan", 1, "loss") in types
    assert sum(1 for t in types if t[:1] == ("nan",) and t[2] == "l/kernel") == 1  # first seen only


def test_record_stats_with_declared_specs_and_bf16_snapshots(mem_url):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    names = ["b/kernel", "a/bias"]
    specs = [
        tt.TensorSpec(name="a/bias", kind="param", role="bias", layer="a", dtype="bfloat16", shape=[3]),
        tt.TensorSpec(
            name="b/kernel", kind="param", role="kernel", layer="b", dtype="bfloat16", shape=[2, 3],
            source_name="b.weight", source_shape=[3, 2], permutation=[1, 0],
        ),
    ]  # fmt: skip
    with tt.Recorder(mem_url, tt.CapturePolicy(full_every=1)) as rec:
        rec.declare(specs)
        vec = np.arange(2 * tt.schema.N_STATS, dtype=np.float64).reshape(2, tt.schema.N_STATS)
        kern = np.ones((2, 3), dtype=ml_dtypes.bfloat16)
        rec.record_stats(
            0,
            "param",
            vec,
            names=names,
            snapshots={"b/kernel": kern, "a/bias": np.zeros(3, ml_dtypes.bfloat16)},
        )
        with pytest.raises(RecordError, match=rf"stats have shape \(1, {tt.schema.N_STATS}\)"):
            rec.record_stats(1, "param", vec[:1], names=names)
    run = tt.open_run(mem_url)
    a = run.stats_array("param")
    np.testing.assert_array_equal(a[0, 1], vec[0])  # b/kernel sorted after a/bias
    snap = run.snapshot("b/kernel", "param", 0)
    assert snap.dtype == np.float32 and (snap == 1).all()
    assert run.spec("b/kernel", "param").dtype == "bfloat16"
    assert run.spec("b/kernel", "param").source_name == "b.weight"


def test_foreign_and_unwritable_paths_refused(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"not empty and is not a traintape store.*notes.txt"):
        tt.Recorder(foreign)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        tt.Recorder(afile / "run")
    with pytest.raises(StoreError, match="exists and is not a directory"):
        tt.Recorder(afile)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_opening_non_store_is_clear(tmp_path):
    with pytest.raises(tt.NotAStoreError, match="does not exist"):
        tt.open_run(tmp_path / "missing")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "zarr.json").write_text(
        json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}})
    )
    with pytest.raises(tt.NotAStoreError, match="not a traintape store"):
        tt.open_run(tmp_path / "x")
    rep = tt.validate(tmp_path / "x")
    assert not rep.ok and "not a traintape store" in rep.problems[0]


def test_newer_major_schema_refused(run_dir):
    _record(run_dir, 2)
    p = Path(run_dir) / "zarr.json"
    doc = json.loads(p.read_text())
    doc["attributes"]["traintape"]["schema_version"] = "2.0.0"
    p.write_text(json.dumps(doc))
    with pytest.raises(SchemaVersionError, match=r"2\.0\.0.*reads schema 1\.x"):
        tt.open_run(run_dir)
    rep = tt.validate(run_dir)
    assert not rep.ok and "reads schema 1.x" in rep.problems[0]


def test_validate_detects_corruption_orphans_and_bad_steps(run_dir):
    _record(run_dir, 6, flush_every_steps=2)
    assert tt.validate(run_dir).ok
    chunk = Path(run_dir) / "stats" / "grad" / "c" / "1" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    orphan = Path(run_dir) / "stray"
    orphan.mkdir()
    (orphan / "zarr.json").write_text(
        json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}})
    )
    rep = tt.validate(run_dir)
    text = "\n".join(rep.problems)
    assert "array stats/grad: chunk at [2, 0, 0] failed to decode" in text
    assert "orphan node stray" in text


def test_validate_detects_commit_mark_past_data(run_dir):
    _record(run_dir, 4)
    p = Path(run_dir) / "zarr.json"
    doc = json.loads(p.read_text())
    doc["attributes"]["traintape"]["commit"]["rows"] = 9
    p.write_text(json.dumps(doc))
    rep = tt.validate(run_dir)
    assert any("commit mark says 9" in q for q in rep.problems), rep.problems


def test_interop_zarr_python_and_xarray(run_dir):
    import xarray as xr
    import zarr

    written = _record(run_dir, 7)
    root = zarr.open_group(run_dir, mode="r")
    assert root.attrs["traintape"]["commit"]["rows"] == 7
    assert root["steps"][:].tolist() == list(range(7))
    assert root["stats/param"].shape == (7, 4, len(tt.STAT_NAMES))
    np.testing.assert_array_equal(
        root["snapshots/param/head/embedding"][1], written[3]["head/embedding"]
    )
    ds = xr.open_zarr(run_dir, group="stats", consolidated=False, zarr_format=3)
    assert ds["param"].dims == ("row", "tensor_param", "stat")
    tree = xr.open_datatree(run_dir, engine="zarr", consolidated=False, zarr_format=3)
    assert "metrics" in tree.children and "snapshots" in tree.children


def test_storage_failure_disables_capture_keeps_committed(run_dir, monkeypatch, capsys):
    rec = tt.Recorder(run_dir, flush_every_steps=2)
    rng = np.random.default_rng(0)
    for s in range(4):
        rec.record(s, "param", _tensors(rng, s))
    rec.flush()
    committed = tt.open_run(run_dir).rows
    assert committed >= 2

    def boom(self, final=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StoreWriter, "_commit", boom)
    with pytest.warns(RuntimeWarning, match="Capture is DISABLED") as warned:
        for s in range(4, 10):  # training goes on; capture disables itself
            rec.record(s, "param", _tensors(rng, s))
        rec.flush()
    assert len([w for w in warned if "Capture is DISABLED" in str(w.message)]) == 1  # once
    assert not rec.enabled and isinstance(rec.error, OSError)
    assert rec.record(11, "param", _tensors(rng, 11)) is False
    with pytest.raises(tt.CaptureDisabledError, match="No space left") as info:
        rec.close()  # the user learns it at close at the latest
    assert isinstance(info.value.__cause__, OSError)
    run = tt.open_run(run_dir)
    assert run.rows == committed and run.manifest.writer.disabled
    monkeypatch.undo()
    assert tt.validate(run_dir).ok


def test_storage_failure_strict_reraises(mem_url, monkeypatch):
    rec = tt.Recorder(mem_url, strict=True, flush_every_steps=1)
    monkeypatch.setattr(
        StoreWriter,
        "_commit",
        lambda self, final=False: (_ for _ in ()).throw(OSError("disk gone")),
    )
    rec.log(0, loss=1.0)
    rec.log(1, loss=1.0)
    with pytest.raises(tt.CaptureDisabledError, match="disk gone"):
        rec.flush()


def test_reader_sees_only_committed_rows_while_writing(run_dir):
    rec = tt.Recorder(run_dir, flush_every_steps=1000, flush_every_seconds=1000)
    for s in range(5):
        rec.log(s, loss=float(s))
    run = tt.open_run(run_dir)
    assert run.rows == 0 and run.metrics().empty
    rec.flush()
    assert run.refresh().steps.tolist() == [0, 1, 2, 3]  # step 4 is still open
    rec.close()
    assert run.refresh().steps.tolist() == [0, 1, 2, 3, 4]


def test_time_based_flush(run_dir):
    import time

    rec = tt.Recorder(run_dir, flush_every_steps=1000, flush_every_seconds=0.2)
    for s in range(3):
        rec.log(s, loss=float(s))
    deadline = time.time() + 10
    while tt.open_run(run_dir).rows < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert tt.open_run(run_dir).rows == 2
    rec.close()


def test_queue_stalls_are_counted(mem_url, monkeypatch):
    import time

    orig = StoreWriter._commit

    def slow(self, final=False):
        time.sleep(0.05)
        orig(self, final)

    monkeypatch.setattr(StoreWriter, "_commit", slow)
    with tt.Recorder(mem_url, flush_every_steps=1, max_pending=1) as rec:
        for s in range(8):
            rec.log(s, loss=1.0)
    w = tt.open_run(mem_url).manifest.writer
    assert w.stalls > 0 and w.stall_seconds > 0


def test_import_traintape_imports_no_framework():
    import subprocess
    import sys

    code = "import sys, traintape; print(sorted(m for m in ('jax','torch','tensorflow','flax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_closed_recorder_refuses(mem_url):
    rec = tt.Recorder(mem_url)
    rec.close()
    with pytest.raises(RecordError, match="closed"):
        rec.log(0, loss=1.0)
    assert os.environ is not None


def test_snapshot_byte_budget_bounds_memory_without_deadlock(mem_url):
    pol = tt.CapturePolicy(full_every=1, kinds=("param",))
    big = np.ones((256, 256), np.float32)  # 256 KiB per snapshot
    with tt.Recorder(
        mem_url, pol, flush_every_steps=1000, flush_every_seconds=1000, max_pending_bytes=600_000
    ) as rec:
        for s in range(12):
            rec.record(s, "param", {"l/kernel": big * s})
    run = tt.open_run(mem_url)
    assert run.snapshot_steps("l/kernel", "param").tolist() == list(range(12))
    np.testing.assert_array_equal(run.snapshot("l/kernel", "param", 7), big * 7)
