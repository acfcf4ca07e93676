"""``inspect_location``: one typed diagnosis of a store location, local and remote."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_s3 import BUCKET, MOTO, endpoint, s3  # noqa: F401  (the moto server fixtures)

import traintape as tt
from traintape.core.kvstore import KvStore, normalize_url
from traintape.core.store import (
    FOREIGN_SHOWN,
    Location,
    LocationKind,
    inspect_location,
    remove_leftovers,
)


def _record(url: str) -> None:
    with tt.Recorder(url) as rec:
        rec.record(0, "param", {"w": np.ones(3, "float32")})


# ---------------------------------------------------------------------- local


def test_missing_path(tmp_path: Path) -> None:
    loc = inspect_location(tmp_path / "run")
    assert loc == Location(
        normalize_url(tmp_path / "run"),
        LocationKind.MISSING,
        path=str(tmp_path / "run"),
        writable=True,
        parent=str(tmp_path),
        parent_is_dir=True,
    )
    assert not loc.exists


def test_missing_path_names_the_nearest_existing_ancestor(tmp_path: Path) -> None:
    loc = inspect_location(tmp_path / "a" / "b" / "run")
    assert loc.kind is LocationKind.MISSING
    assert loc.parent == str(tmp_path) and loc.parent_is_dir and loc.writable


def test_missing_path_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    loc = inspect_location(tmp_path / "afile" / "run")
    assert loc.kind is LocationKind.MISSING
    assert loc.parent == str(tmp_path / "afile") and not loc.parent_is_dir
    assert loc.writable is False


def test_missing_path_under_a_read_only_parent(tmp_path: Path, monkeypatch) -> None:
    real = os.access  # root ignores directory permissions: simulated, as in test_writer_claim
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode)
    )
    loc = inspect_location(tmp_path / "run")
    assert loc.kind is LocationKind.MISSING and loc.parent_is_dir and loc.writable is False


def test_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    loc = inspect_location(str(tmp_path / "afile"))
    assert loc.kind is LocationKind.NOT_A_DIRECTORY
    assert loc.path == str(tmp_path / "afile") and loc.writable is False and not loc.exists


def test_an_empty_directory(tmp_path: Path) -> None:
    loc = inspect_location(f"file://{tmp_path}")
    assert loc == Location(
        normalize_url(tmp_path), LocationKind.EMPTY, path=str(tmp_path), writable=True
    )
    assert loc.exists and loc.leftovers == () and loc.foreign == ()


def test_leftovers_of_an_interrupted_creation(tmp_path: Path) -> None:
    (tmp_path / "zarr.json.__lock").write_bytes(b"")
    (tmp_path / ".traintape").mkdir()  # the writer claim's: neither data nor a leftover
    (tmp_path / ".traintape" / "writer.json").write_text("{}")
    loc = inspect_location(tmp_path)
    assert loc.kind is LocationKind.EMPTY
    assert loc.leftovers == ("zarr.json.__lock",) and loc.foreign == ()
    remove_leftovers(loc)
    assert sorted(os.listdir(tmp_path)) == [".traintape"]
    assert inspect_location(tmp_path).leftovers == ()


def test_a_foreign_directory(tmp_path: Path) -> None:
    names = [f"notes{i}.txt" for i in range(FOREIGN_SHOWN + 2)]
    for n in reversed(names):
        (tmp_path / n).write_text("mine")
    (tmp_path / "zarr.json.__lock").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    loc = inspect_location(tmp_path)
    assert loc.kind is LocationKind.FOREIGN and loc.writable
    assert loc.foreign == tuple(sorted([*names, "sub"])[:FOREIGN_SHOWN])
    assert loc.leftovers == ()


def test_a_store_written_by_a_recorder(tmp_path: Path) -> None:
    _record(str(tmp_path / "run"))
    loc = inspect_location(tmp_path / "run")
    assert loc == Location(
        normalize_url(tmp_path / "run"),
        LocationKind.STORE,
        path=str(tmp_path / "run"),
        writable=True,
    )


def test_a_plain_zarr_group_is_a_store_location(tmp_path: Path) -> None:
    """Whether zarr.json holds a traintape manifest is read_manifest's to say."""
    (tmp_path / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    assert inspect_location(tmp_path).kind is LocationKind.STORE
    with pytest.raises(tt.NotAStoreError, match="not a traintape store"):
        tt.open_run(tmp_path)


# ---------------------------------------------------------------------- remote


def test_memory_url(mem_url: str) -> None:
    loc = inspect_location(mem_url)  # no keys: EMPTY (object stores have no directories)
    assert loc == Location(normalize_url(mem_url), LocationKind.EMPTY)
    assert loc.exists and loc.path is None and loc.writable is None
    kv = KvStore(mem_url)
    kv.write_bytes("zarr.json.__lock", b"")
    kv.write_bytes(".traintape/writer.json", b"{}")
    loc = inspect_location(mem_url)
    assert loc.kind is LocationKind.EMPTY and loc.leftovers == ("zarr.json.__lock",)
    remove_leftovers(loc)
    assert kv.list() == [".traintape/writer.json"]
    kv.delete(".traintape/writer.json")
    _record(mem_url)
    assert inspect_location(mem_url).kind is LocationKind.STORE


def test_memory_url_with_foreign_keys(mem_url: str) -> None:
    kv = KvStore(mem_url)
    kv.write_bytes("data/b.bin", b"x")
    kv.write_bytes("a.txt", b"x")
    kv.write_bytes("stats/zarr.json.__lock", b"")
    loc = inspect_location(mem_url)
    assert loc.kind is LocationKind.FOREIGN and loc.foreign == ("a.txt", "data/b.bin")
    with pytest.raises(tt.StoreError, match=r"not empty and is not a traintape store.*a\.txt"):
        tt.Recorder(mem_url)


@pytest.mark.skipif(shutil.which(str(MOTO)) is None, reason="moto[server] is not installed")
def test_s3(s3) -> None:  # noqa: F811  (the fixture)
    url = f"s3://{BUCKET}/locations/run"
    assert inspect_location(url) == Location(normalize_url(url), LocationKind.EMPTY)
    _record(url)
    assert inspect_location(url) == Location(normalize_url(url), LocationKind.STORE)
    other = f"s3://{BUCKET}/locations/other"
    KvStore(other).write_bytes("thesis.tex", b"chapter 1")
    loc = inspect_location(other)
    assert loc.kind is LocationKind.FOREIGN and loc.foreign == ("thesis.tex",)
    assert loc.path is None and loc.writable is None
