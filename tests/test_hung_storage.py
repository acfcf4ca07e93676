"""Issue 25 item 3: storage that stops answering never stalls training.

A writer that makes no progress for ``write_timeout`` seconds is declared hung: capture
is disabled with a loud error, the training thread never waits for it again, ``close()``
raises :class:`~traintape.CaptureDisabledError` without waiting, and everything committed
before stays valid. Two hangs: any kvstore (the writer's snapshot write blocks, as on a
hung NFS mount) and a real object store frozen with SIGSTOP (a ``moto_server``).

Outcomes never depend on machine load: the loops run until capture is disabled (the
training thread keeps calling the recorder), with a safety net of minutes that only a
regression — training blocked for good — can reach. The step times are printed (the
figures in benchmarks/README.md), not asserted.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import threading
import time

import numpy as np
import pytest
from _procs import MOTO, moto_process

import traintape as tt
from traintape.core.writer import StoreWriter

POLICY = tt.CapturePolicy(full_every=1, kinds=("param",), snapshot_kinds=("param",))
SAFETY = 300.0  # seconds: reached only if training is blocked for good (the bug)


def _tensors(t: int) -> dict[str, np.ndarray]:
    return {"w": np.full((8, 8), float(t), np.float32), "b": np.full(8, float(t), np.float32)}


def _train(rec: tt.Recorder, first: int, until_disabled: bool, n: int) -> tuple[int, list[float]]:
    """Record steps from ``first`` (1 ms of "compute" each) in a thread: until capture is
    disabled (then ``n`` more) or ``n`` steps; returns the next step and the step times.
    Fails if the training thread is still blocked after SAFETY seconds."""
    times: list[float] = []
    state = {"step": first}

    def loop() -> None:
        t, more = first, n
        while more > 0:
            t0 = time.perf_counter()
            time.sleep(0.001)
            rec.record(t, "param", _tensors(t))
            rec.log(t, loss=float(t))
            times.append(time.perf_counter() - t0)
            t += 1
            if not until_disabled or not rec.enabled:
                more -= 1
            state["step"] = t

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    th.join(SAFETY)
    assert not th.is_alive(), f"training blocked on storage (at step {state['step']})"
    return state["step"], times


def _check_committed_part(url: str, rows_before: int) -> None:
    rep = tt.validate(url)
    assert rep.ok, rep.problems
    run = tt.open_run(url)
    assert run.rows >= rows_before
    assert run.steps.tolist() == list(range(run.rows))
    for s in (0, run.rows - 1):
        np.testing.assert_array_equal(run.snapshot("w", "param", s), _tensors(s)["w"])
    assert run.manifest.status == "failed" and run.manifest.writer.disabled
    assert "no progress" in (run.manifest.writer.error or "")


def test_a_hung_kvstore_disables_capture_and_training_goes_on(tmp_path, monkeypatch) -> None:
    gate = threading.Event()
    original = StoreWriter._write_snapshot
    calls = {"n": 0}

    def hangs_after_20(self: StoreWriter, snap: object) -> None:
        calls["n"] += 1
        if calls["n"] > 20:
            gate.wait()  # storage stopped answering
        original(self, snap)  # type: ignore[arg-type]

    monkeypatch.setattr(StoreWriter, "_write_snapshot", hangs_after_20)
    url = str(tmp_path / "run")
    rec = tt.Recorder(url, POLICY, flush_every_steps=4, max_pending=4, write_timeout=0.5,
                      system_metrics=False)  # fmt: skip
    step, _ = _train(rec, 0, until_disabled=False, n=12)
    rec.flush()
    rows_before = tt.open_run(url).rows
    with pytest.warns(RuntimeWarning, match="no progress"):
        step, _ = _train(rec, step, until_disabled=True, n=50)
    assert not rec.enabled and "no progress" in str(rec.error)
    assert rec.record(step, "param", _tensors(step)) is False  # dropped, at once
    with pytest.raises(tt.CaptureDisabledError, match="no progress"):
        rec.close()  # does not wait for the hung writer
    gate.set()  # storage answers again: the writer marks the store failed and ends
    rec._writer._thread.join(SAFETY)
    assert not rec._writer._thread.is_alive()
    _check_committed_part(url, rows_before)
    assert not os.path.exists(os.path.join(url, ".traintape", "writer.json"))  # released


@pytest.mark.skipif(shutil.which(str(MOTO)) is None, reason="moto[server] is not installed")
def test_a_frozen_object_store_never_stalls_training(monkeypatch) -> None:
    bucket = "traintape-frozen"
    with moto_process(bucket) as (endpoint, server):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        url = f"s3://{bucket}/runs/frozen"
        rec = tt.Recorder(url, POLICY, flush_every_steps=4, flush_every_seconds=0.2,
                          write_timeout=3.0, system_metrics=False)  # fmt: skip
        step, normal = _train(rec, 0, until_disabled=False, n=40)
        rec.flush()
        rows_before = tt.open_run(url).rows
        assert rows_before >= 39
        os.kill(server.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            with pytest.warns(RuntimeWarning, match="no progress"):
                step, during = _train(rec, step, until_disabled=True, n=40)
            disabled_after = time.monotonic() - frozen_at
            assert not rec.enabled
            with pytest.raises(tt.CaptureDisabledError, match="no progress"):
                rec.close()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        rec._writer._thread.join(SAFETY)
        assert not rec._writer._thread.is_alive()
        _check_committed_part(url, rows_before)
        print(
            f"\nfrozen moto: step time median {statistics.median(normal) * 1e3:.2f} ms "
            f"normal, {statistics.median(during) * 1e3:.2f} ms while frozen (max "
            f"{max(during) * 1e3:.1f} ms), capture disabled {disabled_after:.1f} s after "
            f"the freeze (write_timeout 3 s), {len(during)} steps while frozen"
        )
