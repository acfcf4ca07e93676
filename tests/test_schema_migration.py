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
