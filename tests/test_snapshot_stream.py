"""Snapshot writes: shards written straight to their files (local uncompressed stores)
are the bytes TensorStore writes, and streamed snapshots (``Recorder.stream_snapshot``:
a tensor handed over piece by piece within the writer's byte budget) read back exactly,
count only once complete, and never cost a stats row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import zarr

import traintape as tt
from traintape.core import layout as L
from traintape.core import writer as wr
from traintape.core.errors import RecordError
from traintape.core.writer import direct_geometry, stream_rows
from traintape.schema import N_RAW, N_STATS, EventType, Kind, TensorSpec

SHAPES = {
    "a/k1": ((300, 200), "float32"),  # last inner chunk padded with the fill value
    "a/k2": ((3, 50000, 7), "float32"),  # split on axis 1
    "a/k3": ((5,), "int32"),
    "a/k4": ((70000,), "float64"),
    "a/k5": ((), "float32"),
    "a/k6": ((33, 1, 5000), "uint8"),
    "a/k7": ((4, 9), "bool"),
    "a/k8": ((2, 3, 40000), "float32"),
    "a/k9": ((0, 3), "float32"),  # zero-size: TensorStore writes it
}


def _spec(name: str, shape: tuple[int, ...], dtype: str = "float32") -> TensorSpec:
    layer, _, role = name.rpartition("/")
    return TensorSpec(
        name=name, kind="param", role=role, layer=layer, dtype=dtype, shape=list(shape)
    )


def _data(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {n: (rng.normal(size=s) * 100).astype(d) for n, (s, d) in SHAPES.items()}


def test_direct_shards_are_the_bytes_tensorstore_writes(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    names = sorted(SHAPES)
    with tt.Recorder(url, tt.CapturePolicy(full_every=1, kinds=("param",))) as rec:
        rec.declare([_spec(n, s, d) for n, (s, d) in SHAPES.items()])
        for step in range(3):
            rec.record_stats(
                step, "param", np.zeros((len(names), N_STATS)), names=names, snapshots=_data(step)
            )
    report = tt.validate(url)
    assert report.ok, report.problems
    run = tt.open_run(url)
    group = zarr.open_group(url, mode="r")
    for step in range(3):
        for n, want in _data(step).items():
            np.testing.assert_array_equal(run.snapshot(n, "param", step), want)
            np.testing.assert_array_equal(group[L.snapshot_path("param", n)][step], want)
    layout = run.manifest.layout
    for n, (shape, dtype) in SHAPES.items():
        other = tmp_path / ("ts_" + n.replace("/", "_"))
        arr = ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": str(other)},
                "metadata": L.snapshot_metadata(layout, n, 16, shape, dtype),
                "store_data_equal_to_fill_value": True,
            },
            create=True,
        ).result()
        arr[1].write(_data(1)[n]).result()
        key = "/".join(["c", "1", *("0" * len(shape))])
        ours, theirs = tmp_path / "run" / L.snapshot_path("param", n) / key, other / key
        assert ours.exists() == theirs.exists(), n  # (no shard at all for a zero-size one)
        assert not ours.exists() or ours.read_bytes() == theirs.read_bytes(), n
    assert not list((tmp_path / "run").rglob("*.__lock"))


def test_pieces_align_with_inner_chunks() -> None:
    f32 = np.dtype("float32")
    assert direct_geometry((300, 200), f32, 128 << 10) == (0, 163)
    assert direct_geometry((3, 50000, 7), f32, 128 << 10) == (1, 4681)
    assert direct_geometry((0, 3), f32, 128 << 10) is None
    assert direct_geometry((4,), np.dtype(">f4"), 128 << 10) is None
    assert stream_rows((1000, 200), f32, 128 << 10, 400 << 10) == 489  # 3 chunks of 163
    assert stream_rows((3, 50000, 7), f32, 128 << 10, 1) == 1
    assert stream_rows((10, 10), f32, 128 << 10, 1 << 30) == 10


# tensor -> (shape, dtype, block): blocks split on one or two axes; the inner chunk of
# the first is a divisor of the block smaller than layout.inner_chunk's (50 of 64 rows);
# the last block of "b/c" is partial (not one whole shard: TensorStore writes it)
BLOCKS = {
    "b/a": ((3000, 512), "float32", (1000, 512)),
    "b/b": ((64, 96), "float64", (32, 48)),
    "b/c": ((10,), "int32", (4,)),
    "b/d": ((7, 50000), "float32", (7, 25000)),
}


def _blocks(shape: tuple[int, ...], block: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Offsets of the blocks of a tensor, in C order (rank r writes the r-th)."""
    grid = [range(0, s, b) for s, b in zip(shape, block, strict=True)]
    return [
        tuple(o) for o in np.stack(np.meshgrid(*grid, indexing="ij"), -1).reshape(-1, len(shape))
    ]


def test_direct_part_shards_are_the_bytes_tensorstore_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of a multi-process job (process 0's through the store writer, the others'
    through PartWriter s, here in one process) that are one whole shard each are written
    straight to their files: the same bytes as TensorStore's shards of the whole tensor."""
    direct: list[str] = []
    finish = wr._DirectShard.finish
    monkeypatch.setattr(wr._DirectShard, "finish", lambda s: (direct.append(s.path), finish(s))[1])
    url = str(tmp_path / "run")
    rng = np.random.default_rng(0)
    full = {n: (rng.normal(size=s) * 100).astype(d) for n, (s, d, _) in BLOCKS.items()}
    offsets = {n: _blocks(s, b) for n, (s, _, b) in BLOCKS.items()}

    def part(n: str, rank: int) -> wr.Part:
        shape, dtype, block = BLOCKS[n]
        if rank >= len(offsets[n]):
            return wr.Part(None, (0,) * len(shape), shape, block, dtype)
        o = offsets[n][rank]
        sel = tuple(slice(i, i + b) for i, b in zip(o, block, strict=True))
        return wr.Part(full[n][sel].copy(), o, shape, block, dtype)

    names = sorted(BLOCKS)
    rec = tt.Recorder(url, tt.CapturePolicy(full_every=1, kinds=("param",)), system_metrics=False)
    rec.declare([_spec(n, s, d) for n, (s, d, _) in BLOCKS.items()])
    rec.record_stats(0, "param", np.zeros((len(names), N_STATS)), names=names,
                     snapshots={n: part(n, 0) for n in names})  # fmt: skip
    rec.flush()  # process 0 has created the arrays (step 0 stays open: not committed)
    manifest = tt.open_run(url).manifest  # so the other "processes" write snapshot 0
    assert manifest.commit.snapshots.get(Kind.PARAM, 0) == 0
    for rank in (1, 2, 3):
        pw = wr.PartWriter(url, rank, manifest, timeout=10)
        pw.put(wr.Snapshot(0, Kind.PARAM, {n: part(n, rank) for n in names}))
        pw.close()
        assert pw.error is None, pw.error
    rec.close()
    assert tt.validate(url).ok
    run = tt.open_run(url)
    for n in names:
        np.testing.assert_array_equal(run.snapshot(n, "param", 0), full[n])
    layout = run.manifest.layout
    for n, (shape, dtype, block) in BLOCKS.items():
        other = tmp_path / ("ts_" + n.replace("/", "_"))
        ts.open({
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(other)},
            "metadata": L.snapshot_metadata(layout, n, 4, shape, dtype, block),
            "store_data_equal_to_fill_value": True,
        }, create=True).result()[0].write(full[n]).result()  # fmt: skip
        ours = tmp_path / "run" / L.snapshot_path("param", n)
        theirs = sorted(p.relative_to(other) for p in (other / "c").rglob("*") if p.is_file())
        assert theirs == sorted(p.relative_to(ours) for p in (ours / "c").rglob("*") if p.is_file())
        for key in theirs:
            assert (ours / key).read_bytes() == (other / key).read_bytes(), (n, key)
    whole = sum(len(offsets[n]) for n in names) - 1  # all but the partial block of b/c
    assert len(direct) == whole
    assert not list((tmp_path / "run").rglob("*.__lock"))


def _stream(rec: tt.Recorder, step: int, tensors: dict[str, np.ndarray]) -> object:
    stream = rec.stream_snapshot(step, "param")
    assert stream is not None
    for n, a in tensors.items():
        stream.put(n, a.shape, a.dtype.name, lambda i, j, a=a: a[i:j].copy())
    return stream


@pytest.mark.parametrize("where", ["local", "memory"])
def test_streamed_snapshot_in_pieces_reads_back_exactly(tmp_path: Path, where: str) -> None:
    url = str(tmp_path / "run") if where == "local" else f"memory://stream-{tmp_path.name}"
    big = np.random.default_rng(0).normal(size=(2000, 300)).astype(np.float32)  # 2.3 MiB
    small = np.arange(7, dtype=np.int64)
    budget = 1 << 20  # pieces of 256 KiB, at most 1 MiB held
    rec = tt.Recorder(url, tt.CapturePolicy(full_every=2, kinds=("param",)),
                      max_pending_bytes=budget, system_metrics=False)  # fmt: skip
    rec.declare([_spec("l/big", big.shape), _spec("l/small", small.shape, "int64")])
    names = ["l/big", "l/small"]
    raw = np.zeros((2, N_RAW))
    for step in range(4):
        tensors = {"l/big": big + step, "l/small": small * step}
        snaps = _stream(rec, step, tensors) if step % 2 == 0 else None
        if step % 2 == 1:
            assert rec.stream_snapshot(step, "param") is None  # not a full-capture step
        rec.record_raw(step, "param", raw, names=names, snapshots=snaps)
    rec.close()
    run = tt.open_run(url)
    assert run.steps.tolist() == [0, 1, 2, 3]
    assert run.snapshot_steps("l/big", "param").tolist() == [0, 2]
    for step in (0, 2):
        np.testing.assert_array_equal(run.snapshot("l/big", "param", step), big + step)
        np.testing.assert_array_equal(run.snapshot("l/small", "param", step), small * step)
    assert tt.validate(url).ok


def test_an_unfinished_stream_is_dropped_and_its_slot_reused(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    a = np.random.default_rng(1).normal(size=(600, 100)).astype(np.float32)
    rec = tt.Recorder(url, tt.CapturePolicy(full_every=1, kinds=("param",)),
                      max_pending_bytes=1 << 18, system_metrics=False)  # fmt: skip
    rec.declare([_spec("l/a", a.shape), _spec("l/b", a.shape)])
    raw = np.zeros((2, N_RAW))
    # step 0: only one of the two tensors is put: refused, nothing of it recorded
    stream = _stream(rec, 0, {"l/a": a})
    with pytest.raises(RecordError, match="l/b"):
        rec.record_raw(0, "param", raw, names=["l/a", "l/b"], snapshots=stream)
    assert rec.enabled
    # the corrected retry, and a later step, both whole
    for step in (0, 1):
        stream = _stream(rec, step, {"l/a": a + step, "l/b": a - step})
        rec.record_raw(step, "param", raw, names=["l/a", "l/b"], snapshots=stream)
    # step 2: a stream that never reaches record_raw, then step 3's
    _stream(rec, 2, {"l/a": a * 5})
    rec.record_raw(2, "param", raw, names=["l/a", "l/b"])
    stream = _stream(rec, 3, {"l/a": a + 3, "l/b": a - 3})
    rec.record_raw(3, "param", raw, names=["l/a", "l/b"], snapshots=stream)
    rec.close()
    run = tt.open_run(url)
    assert run.steps.tolist() == [0, 1, 2, 3]
    assert run.snapshot_steps("l/a", "param").tolist() == [0, 1, 3]
    for step in (0, 1, 3):
        np.testing.assert_array_equal(run.snapshot("l/a", "param", step), a + step)
        np.testing.assert_array_equal(run.snapshot("l/b", "param", step), a - step)
    report = tt.validate(url)
    assert report.ok, report.problems
    assert not list((tmp_path / "run").rglob("*.__lock"))


def test_stream_checks_names_shapes_and_the_budget(tmp_path: Path) -> None:
    a = np.zeros((64, 64), np.float32)  # 16 KiB
    pol = tt.CapturePolicy(full_every=1, kinds=("param",), snapshot_budget_bytes=1024)
    rec = tt.Recorder(tmp_path / "run", pol, system_metrics=False)
    rec.declare([_spec("l/a", a.shape)])
    assert rec.stream_snapshot(0, "param") is None  # over the policy's budget: skipped
    rec.record_raw(0, "param", np.zeros((1, N_RAW)), names=["l/a"])
    rec.close()
    run = tt.open_run(tmp_path / "run")
    assert run.steps.tolist() == [0]  # the stats row is there
    assert [e.step for e in run.events() if e.type == EventType.SNAPSHOT_SKIPPED] == [0]

    rec = tt.Recorder(tmp_path / "run2", tt.CapturePolicy(full_every=1, kinds=("param",)))
    rec.declare([_spec("l/a", a.shape)])
    stream = rec.stream_snapshot(0, "param")
    assert stream is not None
    with pytest.raises(RecordError, match="not declared"):
        stream.put("l/zz", a.shape, "float32", lambda i, j: a[i:j])
    with pytest.raises(RecordError, match="shape"):
        stream.put("l/a", (64, 65), "float32", lambda i, j: a[i:j])
    with pytest.raises(RecordError, match="dtype"):
        stream.put("l/a", a.shape, "float64", lambda i, j: a[i:j])
    rec.close()
