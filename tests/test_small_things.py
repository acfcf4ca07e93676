"""Issue 25 item 11: small things.

- a default run carried ERROR events "first NAN in metric 'sys/step_time'" and
  "'sys/cpu_percent'" at step 0: a system metric not measured at a step is missing, and
  system metrics never raise NaN/Inf events (a user metric's NaN still does);
- temporary ``*.__lock`` files left by killed writes are reported by ``validate`` and
  removed by ``validate --repair`` or the next writer;
- a complex metric was accepted with its imaginary part dropped, and ``10**400`` raised a
  bare OverflowError: both are RecordErrors naming the metric.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import traintape as tt
from traintape.cli import app


def _w(t: int) -> dict[str, np.ndarray]:
    return {"fc/kernel": np.full((2, 3), float(t), np.float32)}


def test_a_default_run_has_no_nan_events_of_system_metrics(tmp_path: Path) -> None:
    url = tmp_path / "run"
    with tt.Recorder(url) as rec:  # system metrics on (the default)
        for t in range(3):
            rec.record(t, "param", _w(t))
            rec.log(t, loss=1.0 if t != 2 else math.nan)
    run = tt.open_run(url)
    bad = [(e.type, e.tensor) for e in run.events() if e.type in ("nan", "inf")]
    assert bad == [("nan", "loss")]  # only the user's own NaN
    assert "sys/step_time" in run.manifest.metrics  # measured from step 1 on
    col = tt.open_run(url).array("metrics/sys/step_time")[:3].read().result()
    assert math.isnan(col[0]) and not math.isnan(col[1])  # missing at step 0


def test_lock_files_are_reported_and_removed(tmp_path: Path) -> None:
    url = tmp_path / "run"
    with tt.Recorder(url, system_metrics=False) as rec:
        rec.record(0, "param", _w(0))
    lock = url / "stats" / "param" / "c" / "0" / "0" / "0.7.__lock"
    lock.write_bytes(b"partial")
    rep = tt.validate(url)
    assert rep.ok and rep.lock_files == ["stats/param/c/0/0/0.7.__lock"]
    assert any("__lock" in n for n in rep.notes)
    r = CliRunner().invoke(app, ["validate", str(url), "--repair"])
    assert r.exit_code == 0, r.output
    assert not lock.exists()
    lock.write_bytes(b"partial")  # and the next writer removes them itself
    with tt.Recorder(url, system_metrics=False) as rec:
        rec.record(1, "param", _w(1))
    assert not lock.exists() and tt.validate(url).lock_files == []


@pytest.mark.parametrize("value", [1 + 2j, np.complex128(1 + 2j), 10**400])
def test_complex_and_overflowing_metrics_are_record_errors(tmp_path: Path, value) -> None:
    with tt.Recorder(tmp_path / "run", system_metrics=False) as rec:
        with pytest.raises(tt.RecordError, match="'m'"):
            rec.log(0, m=value)
        rec.log(0, m=1.0)  # capture goes on
    assert tt.open_run(tmp_path / "run").metrics()["m"].tolist() == [1.0]


def test_a_metric_first_logged_after_committed_chunks_validates(tmp_path: Path) -> None:
    """A metric (or a system metric first measured later) whose array is created after
    whole row chunks were committed: its earlier rows are stored as missing (NaN), so
    every chunk exists (``all_chunks_stored``) — before, validate reported them missing."""
    url = tmp_path / "run"
    with tt.Recorder(url, flush_every_steps=1, system_metrics=False) as rec:
        for t in range(10):
            rec.record(t, "param", _w(t))
            rec.flush()
            if t >= 5:
                rec.log(t, late=float(t))
    rep = tt.validate(url)
    assert rep.ok, rep.problems
    late = tt.open_run(url).array("metrics/late")[:10].read().result()
    assert np.isnan(late[:5]).all() and late[5:].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]
