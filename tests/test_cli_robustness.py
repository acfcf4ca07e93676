"""The CLI never shows a traceback for a bad store, and prints store text literally
(rich markup and terminal escape sequences from a store are not interpreted)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import traintape as tt
from traintape.cli import app


def _store(path: str, **kw: object) -> str:
    with tt.Recorder(path, **kw) as rec:  # type: ignore[arg-type]
        rec.record(0, "param", {"fc/kernel": np.ones((2, 2), np.float32)})
    return path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.__setitem__("schema_version", 7), "schema_version 7 is not a string"),
        (lambda m: m.__setitem__("schema_version", "x.y"), "is not MAJOR.MINOR.PATCH"),
        (None, "is a list, not an object"),
    ],
    ids=["int-version", "bad-version", "not-an-object"],
)
def test_validate_reports_a_broken_manifest(tmp_path: Path, mutate, message: str) -> None:
    run = _store(str(tmp_path / "run"))
    doc = json.loads(Path(run, "zarr.json").read_text())
    if mutate is None:
        doc["attributes"]["traintape"] = [1, 2]
    else:
        mutate(doc["attributes"]["traintape"])
    Path(run, "zarr.json").write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["validate", run])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output


def test_validate_an_unsupported_url() -> None:
    r = CliRunner().invoke(app, ["validate", "bogus://x"])
    assert r.exit_code == 1 and "unsupported URL scheme" in r.output


def test_store_text_is_printed_literally(tmp_path: Path) -> None:
    run = _store(str(tmp_path / "run"), run_id="[/bold][link=http://x]\x1b[31mred")
    r = CliRunner().invoke(app, ["show", run])
    assert r.exit_code == 0, r.output
    assert "[/bold][link=http://x]\\x1b[31mred" in r.output and "\x1b" not in r.output
    r = CliRunner().invoke(app, ["ls", str(tmp_path)])
    assert r.exit_code == 0, r.output


def test_monitor_once_on_a_corrupted_steps_chunk(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    with tt.Recorder(run, flush_every_steps=2) as rec:
        for t in range(4):
            rec.record(t, "param", {"fc/kernel": np.ones((2, 2), np.float32)})
    Path(run, "steps", "c", "0").write_bytes(b"garbage")
    r = CliRunner().invoke(app, ["monitor", run, "--once"])
    assert r.exit_code == 1 and "unreadable" in r.output and "Traceback" not in r.output
