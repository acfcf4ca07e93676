"""Every command that reads a run fails helpfully on a missing path or a non-store: exit
code 2 (``validate``: 1, one problem line), a message naming the path, no traceback."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import traintape
from traintape.cli import app

cli = CliRunner()


def _store(url: str) -> str:
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=2)) as rec:
        for t in range(4):
            rec.record(t, "param", {"fc/kernel": np.full((2, 3), t + 1.0, np.float32)})
            rec.record(t, "grad", {"fc/kernel": np.full((2, 3), 0.1, np.float32)})
            rec.log(t, loss=1.0 / (t + 1))
    return url


# each command with RUN placeholders; the good run fills the other slots
COMMANDS = {
    "show": ["show", "{run}"],
    "health": ["health", "{run}"],
    "anomalies": ["anomalies", "{run}"],
    "report": ["report", "{run}", "-o", "{tmp}/r.html"],
    "monitor": ["monitor", "{run}", "--once"],
    "export": ["export", "{run}", "-o", "{tmp}/out", "-f", "csv"],
    "rm": ["rm", "{run}", "--yes"],
    "compare-a": ["compare", "{run}", "{good}"],
    "compare-b": ["compare", "{good}", "{run}"],
    "sparse-update": ["sparse-update", "{run}", "-m", "x:f", "-i", "x.npy"],
    "validate": ["validate", "{run}"],
}


def _bad_paths(tmp_path):
    """name → (path, words the message must contain besides the path)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("hello")
    plain = tmp_path / "plain_zarr"
    plain.mkdir()
    (plain / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "zarr.json").write_text("{not json")
    parent = tmp_path / "parent"
    _store(str(parent / "inner_run"))
    return {
        "missing": (tmp_path / "missing", ["no such file or directory"]),
        "file": (tmp_path / "afile", ["is a file"]),
        "empty": (tmp_path / "empty", ["not a traintape run", "no zarr.json"]),
        "plain_zarr": (plain, ["not a traintape store"]),
        "corrupt": (corrupt, ["zarr.json"]),
        "parent": (parent, ["contains runs", "inner_run"]),
    }


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return _store(str(tmp_path_factory.mktemp("good") / "run"))


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_missing_or_non_store_paths(cmd, tmp_path, good):
    for case, (path, words) in _bad_paths(tmp_path).items():
        args = [
            a.format(run=path, good=good, tmp=tmp_path) for a in COMMANDS[cmd]
        ]  # fmt: skip
        r = cli.invoke(app, args)
        out = " ".join(r.output.split())
        expect = 1 if cmd == "validate" else 2
        assert r.exit_code == expect, (cmd, case, r.output)
        assert isinstance(r.exception, SystemExit), (cmd, case, r.exception)
        assert str(path) in out, (cmd, case, r.output)
        for w in words:
            assert w in out, (cmd, case, w, r.output)
        if cmd != "validate":
            assert out.startswith("error:"), (cmd, case, r.output)
    # rm never deleted anything that is not a store
    assert (tmp_path / "afile").is_file() and (tmp_path / "parent" / "inner_run").is_dir()


def test_validate_json_names_the_problem(tmp_path):
    r = cli.invoke(app, ["validate", str(tmp_path / "missing"), "--json"])
    assert r.exit_code == 1
    doc = json.loads(r.output)
    assert not doc["ok"] and str(tmp_path / "missing") in doc["problems"][0]


def test_ls_errors(tmp_path):
    r = cli.invoke(app, ["ls", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no such directory" in r.output
    assert str(tmp_path / "missing") in " ".join(r.output.split())
    (tmp_path / "f").write_text("x")
    r = cli.invoke(app, ["ls", str(tmp_path / "f")])
    assert r.exit_code == 2 and "is a file" in r.output


def test_damaged_store_is_reported_not_a_traceback(tmp_path, monkeypatch):
    url = _store(str(tmp_path / "run"))
    shutil.rmtree(tmp_path / "run" / "stats" / "grad")
    for args in (["health", url], ["anomalies", url], ["report", url, "-o", str(tmp_path / "r.html")],
                 ["export", url, "-o", str(tmp_path / "e"), "-f", "npz"], ["compare", url, url]):  # fmt: skip
        r = cli.invoke(app, args)
        out = " ".join(r.output.split())
        assert r.exit_code == 2, (args, r.output)
        assert isinstance(r.exception, SystemExit)
        assert f"cannot read {url}" in out and f"traintape validate {url}" in out
    monkeypatch.setenv("TRAINTAPE_DEBUG", "1")
    r = cli.invoke(app, ["health", url])
    assert r.exit_code != 0 and not isinstance(r.exception, SystemExit)
    assert cli.invoke(app, ["validate", url]).exit_code == 1


def test_output_directory_must_exist(tmp_path, good):
    r = cli.invoke(app, ["report", good, "-o", str(tmp_path / "nodir" / "r.html")])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = cli.invoke(app, ["export", good, "-o", str(tmp_path / "nodir" / "x.npz"), "-f", "npz"])
    assert r.exit_code == 2 and "does not exist" in r.output
