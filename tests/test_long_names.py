"""Issue 25 item 6: a name too long for the storage never loses the rows before it.

A metric name that passes the grammar but whose array path exceeds the file system's
limits (25 segments of 200 characters) used to disable capture at the next commit with
0 rows committed, including the steps recorded before it. Now it is refused at the call
(RecordError, capture stays enabled), and should an array still fail to be created at a
commit, the rows of the arrays that exist are committed first.
"""

from __future__ import annotations

import numpy as np
import pytest

import traintape as tt
from traintape.core import recorder as recorder_mod

LONG = "/".join(["m" + "x" * 199] * 25)  # grammatical, 5024 characters


def _w(t: int) -> dict[str, np.ndarray]:
    return {"fc/kernel": np.full((2, 3), float(t), np.float32)}


def test_a_name_too_long_for_the_file_system_is_refused_at_the_call(tmp_path) -> None:
    url = str(tmp_path / "run")
    rec = tt.Recorder(url, flush_every_steps=2, system_metrics=False)
    for t in range(5):
        rec.record(t, "param", _w(t))
        rec.log(t, loss=float(t))
    with pytest.raises(tt.RecordError, match="too long"):
        rec.log(5, {LONG: 1.0})
    with pytest.raises(tt.RecordError, match="too long"):
        rec.record(5, "grad", {LONG: np.ones(3, np.float32)})
    assert rec.enabled
    rec.record(5, "param", _w(5))
    rec.close()
    assert tt.open_run(url).steps.tolist() == list(range(6))
    assert tt.validate(url).ok


def test_an_array_that_cannot_be_created_keeps_the_rows_before_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(recorder_mod, "check_key_length", lambda *a, **k: None)  # as before
    url = str(tmp_path / "run")
    rec = tt.Recorder(url, flush_every_steps=64, system_metrics=False)
    for t in range(5):
        rec.record(t, "param", _w(t))
        rec.log(t, loss=float(t))
    rec.log(5, {LONG: 1.0})  # its array cannot be created (ENAMETOOLONG)
    rec.record(6, "param", _w(6))
    with pytest.warns(RuntimeWarning, match="storage failure"):
        rec.flush()
    assert not rec.enabled
    with pytest.raises(tt.CaptureDisabledError, match="metric"):
        rec.close()
    run = tt.open_run(url)
    assert run.steps.tolist()[:5] == list(range(5))  # nothing recorded before it is lost
    assert run.metrics()["loss"].tolist()[:5] == [float(t) for t in range(5)]
    assert LONG not in run.manifest.metrics
    assert tt.validate(url).ok
