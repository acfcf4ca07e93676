"""Stores written by schema 1.0.0 are read (and resumed) as the current version."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import traintape as tt
from traintape.schema import SCHEMA_VERSION, Manifest
from traintape.schema.migrate import migrate


def _as_v1_0(run_dir: str) -> dict:
    """Rewrite a store's manifest the way schema 1.0.0 wrote it."""
    path = Path(run_dir) / "zarr.json"
    doc = json.loads(path.read_text())
    m = doc["attributes"]["traintape"]
    order = m.pop("forward_order")
    m["user"] = {**m["user"], "forward_order": order}
    m["schema_version"] = "1.0.0"
    path.write_text(json.dumps(doc))
    return m


def _record(run_dir: str, steps: range) -> None:
    with tt.Recorder(run_dir, user={"forward_order": ["enc", "dec"], "lr": 0.1}) as rec:
        for t in steps:
            rec.record(t, "param", {"enc/kernel": np.full((2, 2), t, np.float32)})


def test_v1_0_manifest_reads_as_current(run_dir: str) -> None:
    _record(run_dir, range(3))
    old = _as_v1_0(run_dir)
    assert old["user"]["forward_order"] == ["enc", "dec"]
    run = tt.open_run(run_dir)
    assert run.manifest.schema_version == SCHEMA_VERSION
    assert run.manifest.forward_order == ["enc", "dec"]
    assert run.manifest.user == {"lr": 0.1}
    assert tt.validate(run_dir).ok


def test_v1_0_store_resumes_and_is_upgraded(run_dir: str) -> None:
    _record(run_dir, range(3))
    _as_v1_0(run_dir)
    with tt.Recorder(run_dir) as rec:
        rec.record(3, "param", {"enc/kernel": np.full((2, 2), 3, np.float32)})
    doc = json.loads((Path(run_dir) / "zarr.json").read_text())["attributes"]["traintape"]
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["forward_order"] == ["enc", "dec"] and "forward_order" not in doc["user"]
    assert tt.open_run(run_dir).steps.tolist() == [0, 1, 2, 3]


def test_migrate_leaves_current_and_malformed_documents_alone() -> None:
    m = Manifest(run_id="r", producer={"traintape_version": "x", "python_version": "3"})
    doc = m.model_dump(mode="json")
    assert migrate(doc) is doc
    assert migrate([1, 2]) == [1, 2]
    assert migrate({"schema_version": 7}) == {"schema_version": 7}


def test_v1_2_free_form_event_types_become_user_types(run_dir: str) -> None:
    """Before 1.3.0 ``Event.type`` was any string; a store that used its own types reads
    with them under ``user/`` (or ``user/event`` + ``original_type`` when the old type is
    not a valid name), traintape's own types untouched."""
    with tt.Recorder(run_dir, system_metrics=False) as rec:
        rec.log(0, loss=float("nan"))  # a first-NaN event of traintape's own
        rec.event(0, "note", "a note")
    path = Path(run_dir) / "zarr.json"
    doc = json.loads(path.read_text())
    m = doc["attributes"]["traintape"]
    m["schema_version"] = "1.2.0"
    m["events"] += [
        {"step": 0, "type": "lr_drop", "message": "lr / 10"},
        {"step": 0, "type": "Weird Type!", "message": "?", "data": {"k": 1}},
    ]
    path.write_text(json.dumps(doc))
    events = tt.open_run(run_dir).events()
    assert [e.type for e in events] == ["nan", "note", "user/lr_drop", "user/event"]
    assert events[3].data == {"k": 1, "original_type": "Weird Type!"}


def test_event_types_are_a_closed_set_or_user_named(run_dir: str) -> None:
    from traintape.core.errors import RecordError

    rec = tt.Recorder(run_dir, system_metrics=False)
    rec.event(0, "user/lr_drop", "lr / 10")
    with pytest.raises(RecordError, match=r"'lr_drop' is not one of traintape's.*user/lr_drop"):
        rec.event(0, "lr_drop", "lr / 10")
    rec.log(0, loss=1.0)
    rec.close()  # the refused call left capture on and nothing behind
    assert [e.type for e in tt.open_run(run_dir).events()] == ["user/lr_drop"]


def _as_v1_3(run_dir: str) -> None:
    """Rewrite a store the way schema 1.3.0 wrote it: no ``sig`` in the stat vector (the
    manifest's ``stat_names`` and the stats arrays' last axis)."""
    from traintape.core import layout as L
    from traintape.core.store import open_array

    run = tt.open_run(run_dir)
    for kind in run.kinds():
        path = L.stats_path(kind)
        data = np.asarray(run.array(path).read().result())
        meta = L.row_array_metadata(
            run.manifest.layout,
            data.shape[0],
            (data.shape[1], 9),
            "float64",
            ["row", f"tensor_{kind.value}", "stat"],
        )
        open_array(run.url, path, metadata=meta)[...].write(data[..., :9]).result()
    mpath = Path(run_dir) / "zarr.json"
    doc = json.loads(mpath.read_text())
    m = doc["attributes"]["traintape"]
    m["schema_version"] = "1.3.0"
    m["stat_names"] = m["stat_names"][:9]
    mpath.write_text(json.dumps(doc))


def test_v1_3_store_without_sig_reads_validates_and_compares(tmp_path) -> None:
    """A store of the stat vector before ``sig`` reads with its own statistics (``sig``
    not recorded), validates, and compares with a current store on the statistics both
    have — compare says which it skipped."""
    from traintape.schema.stats import STAT_NAMES

    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    _record(old, range(3))
    _record(new, range(3))
    _as_v1_3(old)
    run = tt.open_run(old)
    assert run.manifest.schema_version == SCHEMA_VERSION
    assert run.manifest.stat_names == list(STAT_NAMES[:9])
    df = run.stats("param")
    assert "sig" not in df.columns and "l2" in df.columns
    assert tt.validate(old).ok
    for a, b in ((old, new), (new, old)):
        rep = tt.compare(a, b)
        assert rep.identical, rep
        assert any("['sig'] not compared" in n for n in rep.notes), rep.notes


def test_v1_3_store_resumes_with_its_own_stat_vector(tmp_path) -> None:
    """Appending to a store of an older stat vector keeps that vector: the new rows carry
    its columns (selected by name from this build's), the store validates, and the whole
    history equals a store recorded in one go, on the statistics it has."""
    from traintape.schema.stats import STAT_NAMES

    old, ref = str(tmp_path / "old"), str(tmp_path / "ref")
    _record(old, range(3))
    _as_v1_3(old)
    _record(old, range(3, 6))  # resume: 3 more steps
    _record(ref, range(6))
    run, want = tt.open_run(old), tt.open_run(ref)
    assert run.manifest.stat_names == list(STAT_NAMES[:9])
    assert list(run.steps) == list(range(6))
    assert tt.validate(old).ok
    cols = list(STAT_NAMES[:9])
    np.testing.assert_array_equal(
        run.stats("param")[cols].to_numpy(), want.stats("param")[cols].to_numpy()
    )
    assert tt.compare(old, ref).identical


def test_migrate_gives_a_pre_1_4_document_without_stat_names_the_old_vector() -> None:
    from traintape.schema.stats import LEGACY_STAT_NAMES

    m = Manifest(run_id="r", producer={"traintape_version": "x", "python_version": "3"})
    doc = m.model_dump(mode="json")
    doc["schema_version"] = "1.3.0"
    del doc["stat_names"]
    assert migrate(doc)["stat_names"] == list(LEGACY_STAT_NAMES[0])
    assert Manifest.model_validate(migrate(doc)).stat_names == list(LEGACY_STAT_NAMES[0])
    doc["stat_names"] = ["mean", "bogus"]
    with pytest.raises(ValueError, match="stat_names"):
        Manifest.model_validate(doc)
