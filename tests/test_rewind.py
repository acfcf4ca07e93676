"""Rewind: a job preempted at step 30 restarts from its step-20 checkpoint and records
20.. again. Readers see one history; the abandoned steps stay readable."""

from __future__ import annotations

import numpy as np
import pytest

import traintape
from traintape.core import rewind as rewind_mod


def _vec(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"l/kernel": rng.normal(size=(4, 3)).astype("float32"),
            "l/bias": rng.normal(size=3).astype("float32")}  # fmt: skip


def _train(url, steps, *, offset: float = 0.0, **kw):
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=10), flush_every_steps=4,
                            **kw) as rec:  # fmt: skip
        for t in steps:
            rec.record(t, "param", {k: v + offset for k, v in _vec(t).items()})
            rec.log(t, loss=1.0 / (t + 1) + offset)


def test_resume_at_20_after_preemption_at_30(tmp_path):
    url = str(tmp_path / "run")
    _train(url, range(31))  # preempted after step 30
    old = traintape.open_run(url)
    old_stats = old.stats_array("param")
    old_snap20 = old.snapshot("l/kernel", "param", 20)
    old_loss = old.metrics()["loss"].to_numpy()
    _train(url, range(20, 36), offset=1.0, resume_step=20)  # restarted from step 20
    run = traintape.open_run(url)
    assert list(run.steps) == list(range(36))
    assert traintape.validate(url).ok
    stats = run.stats_array("param")
    np.testing.assert_array_equal(stats[:20], old_stats[:20])  # kept history untouched
    assert not np.allclose(stats[20:31], old_stats[20:31])  # replaced by the new one
    np.testing.assert_array_equal(run.snapshot("l/kernel", "param", 20), old_snap20 + 1.0)
    assert list(run.snapshot_steps("l/kernel", "param")) == [0, 10, 20, 30]
    ev = [e for e in run.events() if e.type == "rewind"]
    assert len(ev) == 1 and ev[0].step == 20 and ev[0].data["rows"] == 11
    # the abandoned steps, as they were
    ab = traintape.open_run(ev[0].data["abandoned"])
    assert list(ab.steps) == list(range(20, 31))
    np.testing.assert_array_equal(ab.stats_array("param"), old_stats[20:31])
    np.testing.assert_array_equal(ab.snapshot("l/kernel", "param", 20), old_snap20)
    np.testing.assert_array_equal(ab.metrics()["loss"].to_numpy(), old_loss[20:31])
    assert traintape.validate(ev[0].data["abandoned"]).ok


def test_two_rewinds_keep_both_abandoned_histories(tmp_path):
    url = str(tmp_path / "run")
    _train(url, range(12))
    _train(url, range(8, 15), offset=1.0, resume_step=8)
    _train(url, range(5, 9), offset=2.0, resume_step=5)
    run = traintape.open_run(url)
    assert list(run.steps) == list(range(9))
    ev = [e for e in run.events() if e.type == "rewind"]
    assert [e.step for e in ev] == [5]  # the first rewind's event was at step 8 >= 5: it
    # belongs to the abandoned history and travels with it
    second = traintape.open_run(ev[0].data["abandoned"])
    assert list(second.steps) == list(range(5, 15))
    assert [e.step for e in second.events() if e.type == "rewind"] == [8]
    assert list(traintape.open_run(f"{url}/abandoned/0").steps) == list(range(8, 12))


def test_resume_step_after_the_last_step_is_a_plain_resume(tmp_path):
    url = str(tmp_path / "run")
    _train(url, range(5))
    _train(url, range(5, 7), resume_step=5)
    run = traintape.open_run(url)
    assert list(run.steps) == list(range(7))
    assert not [e for e in run.events() if e.type == "rewind"]


def test_killed_during_the_copy_leaves_the_old_history(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    _train(url, range(31))
    before = traintape.open_run(url).stats_array("param")

    def dies(*a, **k):
        raise KeyboardInterrupt("killed during the copy")

    monkeypatch.setattr(rewind_mod, "_copy_rows", dies)
    with pytest.raises(KeyboardInterrupt):
        traintape.Recorder(url, resume_step=20)
    monkeypatch.undo()
    run = traintape.open_run(url)  # the old history, whole
    assert list(run.steps) == list(range(31))
    np.testing.assert_array_equal(run.stats_array("param"), before)
    assert traintape.validate(url).ok
    _train(url, range(20, 25), offset=1.0, resume_step=20)  # the retried rewind works
    assert list(traintape.open_run(url).steps) == list(range(25))


def test_every_abandoned_history_survives_later_rewinds(tmp_path):
    """A deeper rewind abandons the event that named an earlier copy; the earlier copy
    must not be taken for a leftover and overwritten."""
    url = str(tmp_path / "run")
    _train(url, range(12))
    _train(url, range(8, 15), offset=1.0, resume_step=8)  # abandons 8..11
    _train(url, range(5, 9), offset=2.0, resume_step=5)  # abandons 5..14
    _train(url, range(3, 6), offset=3.0, resume_step=3)  # abandons 3..8
    assert list(traintape.open_run(url).steps) == list(range(6))
    copies = {k: list(traintape.open_run(f"{url}/abandoned/{k}").steps) for k in range(3)}
    assert copies == {0: list(range(8, 12)), 1: list(range(5, 15)), 2: list(range(3, 9))}
    rep = traintape.validate(url)
    assert rep.ok, rep.problems
    assert not [n for n in rep.notes if "abandoned" in n]  # every copy is a finished one


def test_a_refused_resume_has_not_rewound_the_store(tmp_path) -> None:
    """Issue 25 item 5: a resume refused for its policy changes nothing — no copy under
    abandoned/, no rewind event, every committed row still there."""
    import os

    import numpy as np

    import traintape as tt

    url = str(tmp_path / "run")
    with tt.Recorder(url, tt.CapturePolicy(every=1), system_metrics=False) as rec:
        for t in range(100):
            rec.record(t, "param", {"w": np.full(3, float(t), np.float32)})
    before = (tmp_path / "run" / "zarr.json").read_bytes()
    with pytest.raises(tt.RecordError, match="different policy"):
        tt.Recorder(url, tt.CapturePolicy(every=2), resume_step=50)
    assert (tmp_path / "run" / "zarr.json").read_bytes() == before
    assert not os.path.exists(os.path.join(url, "abandoned"))
    run = tt.open_run(url)
    assert run.steps.tolist() == list(range(100))
    assert not [e for e in run.events() if e.type == "rewind"]
