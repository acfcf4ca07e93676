"""System metrics on every row (traintape.core.system): time, step time, throughput,
CPU, memory, bytes written — sampled off the training thread, kept apart from the
training metrics, and a memory_spike anomaly on them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import traintape as tt
from traintape.analysis.anomalies import anomalies
from traintape.core.errors import RecordError

SLEEP = 0.05


def _record(url: Path, steps: int = 8, **kw: object) -> None:
    rec = tt.Recorder(url, **kw)
    for t in range(steps):
        rec.record(t, "param", {"layer/kernel": np.full((4, 4), float(t), np.float32)})
        rec.log(t, loss=1.0 / (t + 1))
        time.sleep(SLEEP)
    rec.close()


def test_rows_carry_time_step_time_throughput_memory(tmp_path: Path) -> None:
    t0 = time.time()
    _record(tmp_path / "r", samples_per_step=64)
    t1 = time.time()
    run = tt.open_run(tmp_path / "r")
    sysm = run.system()
    assert list(sysm.index) == list(range(8))
    ts = sysm["sys/time"].to_numpy()
    assert t0 <= ts[0] and ts[-1] <= t1 and np.all(np.diff(ts) > 0)
    st = sysm["sys/step_time"].to_numpy()
    assert np.isnan(st[0])  # no previous row
    np.testing.assert_allclose(st[1:], np.diff(ts), rtol=1e-9)
    assert np.all(st[1:] >= SLEEP * 0.9)  # the training loop sleeps that long per step
    np.testing.assert_allclose(sysm["sys/samples_per_s"].to_numpy()[1:], 64 / st[1:])
    rss = sysm["sys/rss_bytes"].to_numpy()
    own = psutil.Process().memory_info().rss  # the OS's own figure for this process
    assert np.all((rss > 0.5 * own) & (rss < 2 * own))
    assert np.all(sysm["sys/mem_available_bytes"].to_numpy() > 0)
    written = sysm["sys/bytes_written"].to_numpy()
    # a row is handed to the writer when the next one opens: row t counts rows < t - 1
    assert written[0] == written[1] == 0 and np.all(np.diff(written)[1:] > 0)
    # the training metrics are what was logged, nothing else
    assert list(run.metrics().columns) == ["loss"]


def test_sampling_runs_on_its_own_thread_and_stops_at_close(tmp_path: Path) -> None:
    # only this recorder's threads: other tests' recorders may still be alive in this process
    before = set(threading.enumerate())
    rec = tt.Recorder(tmp_path / "r")
    mine = [t for t in set(threading.enumerate()) - before if t.name == "traintape-system"]
    assert len(mine) == 1 and mine[0] is not threading.current_thread()
    rec.close()
    assert not mine[0].is_alive()


def test_off_and_reserved_names(tmp_path: Path) -> None:
    _record(tmp_path / "off", steps=3, system_metrics=False)
    run = tt.open_run(tmp_path / "off")
    assert run.system().empty and not any(n.startswith("sys/") for n in run.manifest.metrics)
    rec = tt.Recorder(tmp_path / "r")
    with pytest.raises(RecordError, match="sys/mine"):
        rec.log(0, {"sys/mine": 1.0})
    rec.log(0, loss=1.0)  # capture stays on
    assert rec.enabled
    rec.close()
    with pytest.raises(ValueError, match="samples_per_step"):
        tt.Recorder(tmp_path / "bad", samples_per_step=0)


def test_compare_ignores_system_metrics(tmp_path: Path) -> None:
    from traintape.analysis.compare import compare

    _record(tmp_path / "a", steps=4)
    _record(tmp_path / "b", steps=4)
    a, b = tt.open_run(tmp_path / "a"), tt.open_run(tmp_path / "b")
    assert not np.array_equal(a.system()["sys/time"], b.system()["sys/time"])
    assert compare(tmp_path / "a", tmp_path / "b", strict=True).identical


def test_rewind_keeps_the_abandoned_rows_system_metrics(tmp_path: Path) -> None:
    url = tmp_path / "r"
    _record(url, steps=6)
    before = tt.open_run(url).system()
    tt.Recorder(url, resume_step=3).close()
    copy = tt.open_run(url / "abandoned" / "0")
    after = copy.system()
    assert list(after.index) == [3, 4, 5]
    np.testing.assert_array_equal(after["sys/time"].to_numpy(), before["sys/time"].to_numpy()[3:])


def test_memory_spike_is_found_at_its_step(tmp_path: Path) -> None:
    """A real allocation held for a few steps mid-run (the process's RSS, sampled by
    traintape) is reported as one memory_spike at the step it started."""
    url = tmp_path / "r"
    # well above memory_spike_frac (20%) of this process's RSS, which in a full test session
    # (torch, TF and JAX loaded) is several GiB: 400 MiB alone would be a small change there
    size = max(400 << 20, int(0.6 * psutil.Process().memory_info().rss))
    rec = tt.Recorder(url, system_metrics=0.01)  # sample often: every row sees the current RSS
    held = None
    for t in range(60):
        if t == 40:
            held = np.ones(size >> 3)  # touched
        if t == 44:
            held = None
        rec.log(t, loss=1.0)
        time.sleep(0.03)
    del held
    rec.close()
    rss = tt.open_run(url).system()["sys/rss_bytes"]
    assert rss.loc[41] > rss.loc[39] + 0.75 * size  # the allocation is in the data
    found = anomalies(tt.open_run(url)).of_type("memory_spike")
    assert [a.step for a in found] in ([40], [41])  # sampled within one row of it
    assert found[0].evidence["metric"] == "sys/rss_bytes"
    assert found[0].evidence["rows"] >= 3


def test_report_plots_system_metrics(tmp_path: Path) -> None:
    from traintape.analysis import write_report

    _record(tmp_path / "r", steps=6, samples_per_step=8)
    out = tmp_path / "r.html"
    write_report(tt.open_run(tmp_path / "r"), str(out))
    text = out.read_text()
    section = text[text.index("<h2>System</h2>") :]
    assert section.index("<img") < section.index("<h2>", 5)  # a figure in the section
    _record(tmp_path / "off", steps=3, system_metrics=False)
    write_report(tt.open_run(tmp_path / "off"), str(out))
    assert "No system metrics recorded" in out.read_text()
