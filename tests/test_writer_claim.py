"""One writer per store (the writer claim), stale claims, a store removed mid-run,
leftovers of an interrupted creation, and resuming under a read-only parent."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import traintape as tt
from traintape.core.claim import CLAIM_KEY


def _w(t: int) -> dict[str, np.ndarray]:
    return {"fc/kernel": np.full((2, 3), float(t), np.float32)}


def test_second_recorder_in_the_same_process_is_refused(run_dir: str) -> None:
    first = tt.Recorder(run_dir, flush_every_steps=2)
    first.record(0, "param", _w(0))
    with pytest.raises(tt.StoreError) as info:
        tt.Recorder(run_dir)
    msg = str(info.value)
    assert run_dir in msg and f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    assert "since" in msg
    for t in range(1, 5):  # the first writer is untouched
        first.record(t, "param", _w(t))
    first.close()
    run = tt.open_run(run_dir)
    assert run.steps.tolist() == [0, 1, 2, 3, 4]
    assert tt.validate(run_dir).ok
    assert not (Path(run_dir) / ".traintape").exists()  # released at close
    with tt.Recorder(run_dir) as again:  # and the store can be resumed afterwards
        again.record(5, "param", _w(5))
    assert tt.open_run(run_dir).steps.tolist() == list(range(6))


CHILD = textwrap.dedent(
    """
    import sys, numpy as np, traintape as tt
    rec = tt.Recorder(sys.argv[1], flush_every_steps=1)
    for t in range(3):
        rec.record(t, "param", {"fc/kernel": np.full((2, 3), float(t), np.float32)})
    rec.flush()
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def test_live_writer_in_another_process_is_refused_and_a_killed_one_taken_over(
    run_dir: str,
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, run_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(tt.StoreError, match=f"pid {child.pid}"):
            tt.Recorder(run_dir)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # the writer died: its claim is stale at once (same host, pid gone); resume after it
    with tt.Recorder(run_dir) as rec:
        last = rec.manifest.commit.last_step
        rec.record(last + 1, "param", _w(last + 1))
    run = tt.open_run(run_dir)
    assert run.steps.tolist()[-1] == last + 1 and tt.validate(run_dir).ok
    notes = [e for e in run.events() if e.type == "note" and "took over" in e.message]
    assert notes and str(child.pid) in notes[0].message


def _plant_claim(run_dir: str, heartbeat: float, **fields: object) -> None:
    p = Path(run_dir) / CLAIM_KEY
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = {"session": "x", "host": "elsewhere", "pid": 1,
           "started_at": "2026-01-01T00:00:00+00:00", "heartbeat": heartbeat}  # fmt: skip
    p.write_text(json.dumps({**doc, **fields}))


class _Heartbeats:
    """A live writer on another host, simulated: rewrites the claim every 50 ms with a
    heartbeat from a clock ``skew`` seconds off."""

    def __init__(self, run_dir: str, skew: float) -> None:
        self.run_dir, self.skew = run_dir, skew
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self.stop.is_set():
            _plant_claim(self.run_dir, time.time() + self.skew)
            self.stop.wait(0.05)

    def __enter__(self) -> _Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def test_claim_of_another_host_is_refused_while_it_heartbeats_and_taken_over_when_stopped(
    run_dir: str,
) -> None:
    with tt.Recorder(run_dir) as rec:
        rec.record(0, "param", _w(0))
    with (
        _Heartbeats(run_dir, skew=0.0),
        pytest.raises(tt.StoreError, match="host elsewhere, pid 1"),
    ):
        tt.Recorder(run_dir, claim_stale_after=1)
    _plant_claim(run_dir, time.time())  # fresh-looking, but nobody renews it
    t0 = time.monotonic()
    with tt.Recorder(run_dir, claim_stale_after=1) as rec:
        rec.record(1, "param", _w(1))
    assert time.monotonic() - t0 >= 1.0  # watched for a full stale interval first
    assert tt.open_run(run_dir).steps.tolist() == [0, 1]


def test_clock_skew_never_lets_a_live_writer_be_taken_over(run_dir: str) -> None:
    """Issue 25 item 10: the live writer's clock is 40 s behind (its heartbeats look 40 s
    old here): it is still refused, because its claim is seen to change."""
    with tt.Recorder(run_dir) as rec:
        rec.record(0, "param", _w(0))
    with _Heartbeats(run_dir, skew=-40.0), pytest.raises(tt.StoreError, match="renewed"):
        tt.Recorder(run_dir, claim_stale_after=1)
    assert json.loads((Path(run_dir) / CLAIM_KEY).read_text())["host"] == "elsewhere"


def test_a_restarted_container_takes_over_its_own_claim(run_dir: str) -> None:
    """Issue 25 item 2: the dead writer had this host's name and this very PID (PID 1 of
    a container, restarted in the same image) but another PID namespace: it is not this
    process. Its claim is taken over once it was seen not to change for the stale
    interval (before: refused forever as "this process holds it")."""
    from traintape.core.claim import boot_id

    with tt.Recorder(run_dir) as rec:
        rec.record(0, "param", _w(0))
    _plant_claim(run_dir, time.time(), host=socket.gethostname(), pid=os.getpid(),
                 boot_id=boot_id(), pid_ns="pid:[1]", start_ticks=1)  # fmt: skip
    with tt.Recorder(run_dir, claim_stale_after=1) as rec:
        rec.record(1, "param", _w(1))
    run = tt.open_run(run_dir)
    assert run.steps.tolist() == [0, 1]
    assert any("took over" in e.message for e in run.events())


def test_a_reused_pid_is_not_the_dead_writer(run_dir: str) -> None:
    """The dead writer ran on this machine, in this PID namespace, under a PID that now
    names another process (here: this one, started at another time): provably gone, its
    claim is taken over at once even though its heartbeat is fresh."""
    from traintape.core.claim import boot_id, pid_namespace, start_ticks

    with tt.Recorder(run_dir) as rec:
        rec.record(0, "param", _w(0))
    _plant_claim(run_dir, time.time(), host=socket.gethostname(), pid=os.getpid(),
                 boot_id=boot_id(), pid_ns=pid_namespace(),
                 start_ticks=start_ticks(os.getpid()) - 1)  # fmt: skip
    with tt.Recorder(run_dir, claim_stale_after=3600) as rec:  # no wait at all
        rec.record(1, "param", _w(1))
    assert tt.open_run(run_dir).steps.tolist() == [0, 1]


def test_a_claim_this_process_no_longer_holds_is_taken_over(run_dir: str) -> None:
    """A Recorder of this process whose claim was never released (its release failed:
    a read-only remount, a lost reference) does not lock the store for the rest of the
    process: nobody renews the claim, so it is taken over after the stale interval."""
    rec = tt.Recorder(run_dir, claim_stale_after=1, system_metrics=False)
    rec.record(0, "param", _w(0))
    rec.flush()
    held = (Path(run_dir) / CLAIM_KEY).read_text()
    rec.close()
    (Path(run_dir) / CLAIM_KEY).parent.mkdir(exist_ok=True)
    (Path(run_dir) / CLAIM_KEY).write_text(held)  # as if the release had failed
    with tt.Recorder(run_dir, claim_stale_after=1) as again:
        again.record(1, "param", _w(1))
    assert tt.open_run(run_dir).steps.tolist() == [0, 1]


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare and root for a PID namespace")  # fmt: skip
def test_restart_in_a_new_pid_namespace_resumes(run_dir: str) -> None:
    """The real thing: a writer that is PID 1 of its own PID namespace is SIGKILLed and
    a new one, again PID 1 of a new namespace on the same host, resumes the store (after
    the stale interval), where before it was refused forever."""
    child = textwrap.dedent(
        """
        import os, sys, numpy as np, traintape as tt
        assert os.getpid() == 1
        rec = tt.Recorder(sys.argv[1], flush_every_steps=1, claim_stale_after=1)
        last = rec.manifest.commit.last_step
        s = 0 if last is None else last + 1
        for t in range(s, s + 3):
            rec.record(t, "param", {"fc/kernel": np.full((2, 3), float(t), np.float32)})
        rec.flush()
        print("ready", s, flush=True)
        sys.stdin.readline()
        """
    )
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
           sys.executable, "-c", child, run_dir]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for first in (0, 2):  # (the last step recorded stays open: flush commits 2 of 3)
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert p.stdout is not None
            assert p.stdout.readline().split() == ["ready", str(first)]
        finally:
            p.send_signal(signal.SIGKILL)  # unshare; --kill-child kills its PID 1
            p.wait(timeout=30)
    run = tt.open_run(run_dir)
    assert run.steps.tolist() == list(range(4))
    assert any("took over" in e.message for e in run.events())


def test_racing_creators_exactly_one_wins(tmp_path: Path) -> None:
    for trial in range(5):
        url = str(tmp_path / f"race{trial}")
        won: list[tt.Recorder] = []
        lost: list[BaseException] = []
        barrier = threading.Barrier(3)

        def go(barrier=barrier, won=won, lost=lost, url=url) -> None:
            barrier.wait()
            try:
                won.append(tt.Recorder(url))
            except tt.StoreError as e:
                lost.append(e)

        threads = [threading.Thread(target=go) for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len(won) == 1 and len(lost) == 2, (won, lost)
        won[0].record(0, "param", _w(0))
        won[0].close()
        assert tt.open_run(url).rows == 1


def test_store_removed_mid_run_is_reported_truthfully(run_dir: str) -> None:
    rec = tt.Recorder(run_dir, flush_every_steps=1)
    rec.record(0, "param", _w(0))
    rec.flush()
    shutil.rmtree(run_dir)
    with pytest.warns(RuntimeWarning, match="removed or moved") as warned:
        rec.record(1, "param", _w(1))
        rec.record(2, "param", _w(2))
        rec.flush()
    assert not any("stay readable" in str(w.message) for w in warned)
    assert not rec.enabled
    with pytest.raises(tt.CaptureDisabledError, match="removed or moved"):
        rec.close()
    assert not os.path.exists(os.path.join(run_dir, "zarr.json"))  # nothing recreated


def test_leftover_lock_of_an_interrupted_creation_is_cleaned(run_dir: str) -> None:
    os.makedirs(run_dir)
    Path(run_dir, "zarr.json.__lock").write_bytes(b"")
    with tt.Recorder(run_dir) as rec:
        rec.record(0, "param", _w(0))
    assert not Path(run_dir, "zarr.json.__lock").exists()
    assert tt.validate(run_dir).ok


def test_foreign_directory_is_refused_and_left_untouched(run_dir: str) -> None:
    os.makedirs(run_dir)
    Path(run_dir, "thesis.tex").write_text("chapter 1")
    with pytest.raises(tt.StoreError, match="not empty and is not a traintape store"):
        tt.Recorder(run_dir)
    assert os.listdir(run_dir) == ["thesis.tex"]


def test_resume_under_a_read_only_parent(tmp_path: Path, monkeypatch) -> None:
    """Resuming writes inside the store only: a read-only parent directory is fine (the
    parent is only checked when the store must be created). Simulated with os.access,
    since root (CI) ignores directory permissions."""
    parent = tmp_path / "ro"
    parent.mkdir()
    run_dir = str(parent / "run")
    with tt.Recorder(run_dir) as rec:
        rec.record(0, "param", _w(0))
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p).rstrip("/") == str(parent) else real(p, mode)
    )
    with tt.Recorder(run_dir) as rec:
        rec.record(1, "param", _w(1))
    assert tt.open_run(run_dir).steps.tolist() == [0, 1]
    with pytest.raises(tt.StoreError, match="not writable"):
        tt.Recorder(str(parent / "new"))


def test_resume_after_a_kill_between_trimming_arrays(run_dir: str) -> None:
    """A kill during close() of a resumed run can leave some row arrays trimmed to the
    committed rows and others padded: every array is grown from its own shape."""
    import tensorstore as ts

    with tt.Recorder(run_dir, flush_every_steps=4) as rec:
        for t in range(21):
            rec.record(t, "param", _w(t))
            rec.log(t, loss=float(t))
    # as if close() had been killed after trimming stats/param but before trimming steps:
    steps = ts.open({"driver": "zarr3", "kvstore": f"file://{run_dir}/steps"}).result()
    steps.resize(exclusive_max=[1024], expand_only=True).result()
    with tt.Recorder(run_dir) as rec:
        for t in range(21, 30):
            rec.record(t, "param", _w(t))
            rec.log(t, loss=float(t))
        assert rec.enabled
    run = tt.open_run(run_dir)
    assert run.steps.tolist() == list(range(30))
    assert run.metrics()["loss"].tolist() == [float(t) for t in range(30)]
    assert tt.validate(run_dir).ok


def test_rm_deletes_only_the_store(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from traintape.cli import app

    run_dir = str(tmp_path / "run")
    with tt.Recorder(run_dir, tt.CapturePolicy(full_every=1)) as rec:
        for t in range(3):
            rec.record(t, "param", _w(t))
            rec.log(t, loss=1.0)
    Path(run_dir, "thesis.tex").write_text("chapter 1")
    Path(run_dir, "notes").mkdir()
    Path(run_dir, "notes", "a.txt").write_text("x")
    r = CliRunner().invoke(app, ["rm", run_dir, "--yes"])
    assert r.exit_code == 0, r.output
    assert "left 2 entries" in r.output and "thesis.tex" in r.output
    assert sorted(os.listdir(run_dir)) == ["notes", "thesis.tex"]
    assert Path(run_dir, "notes", "a.txt").read_text() == "x"
    # a store alone: the directory goes too
    other = str(tmp_path / "other")
    with tt.Recorder(other) as rec:
        rec.record(0, "param", _w(0))
    assert CliRunner().invoke(app, ["rm", other, "-y"]).exit_code == 0
    assert not os.path.exists(other)


def test_rm_on_a_symlink_names_the_target(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from traintape.cli import app

    run_dir = str(tmp_path / "run")
    with tt.Recorder(run_dir) as rec:
        rec.record(0, "param", _w(0))
    link = tmp_path / "link"
    link.symlink_to(run_dir)
    r = CliRunner().invoke(app, ["rm", str(link), "--yes"])
    assert r.exit_code == 2 and "symbolic link" in r.output and run_dir in r.output
    assert tt.open_run(run_dir).rows == 1  # nothing deleted


def test_rm_deletes_exactly_what_the_manifests_vouch_for(tmp_path: Path) -> None:
    """Issue 25 item 8: user files inside the store's own directories stay (and are
    listed), rewind copies go, and the path is one a new Recorder can use."""
    from typer.testing import CliRunner

    from traintape.cli import app

    run_dir = str(tmp_path / "run")
    with tt.Recorder(run_dir, tt.CapturePolicy(full_every=1)) as rec:
        for t in range(6):
            rec.record(t, "param", _w(t))
            rec.log(t, loss=1.0)
    with tt.Recorder(run_dir, resume_step=3) as rec:  # a rewind copy: abandoned/0
        rec.record(3, "param", _w(3))
    assert Path(run_dir, "abandoned", "0", "zarr.json").exists()
    Path(run_dir, "stats", "MY_NOTES.txt").write_text("keep me")
    Path(run_dir, ".traintape").mkdir(exist_ok=True)
    Path(run_dir, ".traintape", "my.cfg").write_text("keep me too")
    r = CliRunner().invoke(app, ["rm", run_dir, "--yes"])
    assert r.exit_code == 0, r.output
    assert "left 2 entries" in r.output and "MY_NOTES.txt" in r.output
    left = sorted(str(p.relative_to(run_dir)) for p in Path(run_dir).rglob("*") if p.is_file())
    assert left == [".traintape/my.cfg", "stats/MY_NOTES.txt"]
    # without the user's files, the path is empty: a new Recorder starts a new run there
    Path(run_dir, "stats", "MY_NOTES.txt").unlink()
    Path(run_dir, ".traintape", "my.cfg").unlink()
    for d in (Path(run_dir, "stats"), Path(run_dir, ".traintape")):
        d.rmdir()
    with tt.Recorder(run_dir) as rec:
        rec.record(0, "param", _w(0))
    assert tt.open_run(run_dir).rows == 1
    out = CliRunner().invoke(app, ["ls", str(tmp_path)])
    assert "abandoned" not in out.output
