"""Durability ordering at the system-call level (the ALICE approach to crash consistency).

A process kill keeps the page cache, so a kill test cannot see a missing ``fsync``: only
a machine crash can. Instead a small recording runs under ``strace`` and the trace is
checked for the ordering a crash needs, for every file the writer publishes under the
store (snapshot shards, stats/steps chunks, array and group metadata, the writer claim,
the manifest ``zarr.json``):

1. the file's data is fsynced (``fsync``/``fdatasync`` of a descriptor opened on it)
   after it was opened and before the ``rename`` that publishes it;
2. the directory holding it is fsynced after that rename;
3. a data chunk (a ``c/...`` key) is renamed and its directory fsynced before a later
   manifest write (the rename of the store's root ``zarr.json``) commits it;
4. nothing under the store is opened for writing except a temporary that is then renamed
   into place (no in-place writes).

Skipped with a reason where ``strace`` is not installed (Debian: ``apt-get install strace``)
or cannot trace (ptrace forbidden in the container).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RECORDING = textwrap.dedent(
    """
    import sys
    import numpy as np
    import traintape

    w = np.arange(3 * 40000, dtype=np.float32).reshape(3, 40000)
    with traintape.Recorder(
        sys.argv[1], traintape.CapturePolicy(full_every=2), flush_every_steps=2
    ) as rec:
        for t in range(4):
            rec.record(t, "param", {"x/kernel": w + t, "y/bias": np.zeros(2, np.float32)})
            rec.record(t, "grad", {"x/kernel": w - t, "y/bias": np.ones(2, np.float32)})
    """
)


@dataclass
class Call:
    name: str
    args: str
    ret: str = ""
    start: int = 0  # index of the event that began the call
    end: int = 0  # index of the event that completed it
    path: str | None = None  # the path of the descriptor / first path argument
    dst: str | None = None  # rename's target


@dataclass
class Trace:
    calls: list[Call] = field(default_factory=list)


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)$")
_STR = re.compile(r'"((?:[^"\\]|\\.)*)"')


def parse(text: str) -> Trace:
    """Calls of an ``strace -f`` log in completion order, each with the path it acts on
    (descriptors resolved through the ``openat`` that returned them, at the call's start)."""
    fds: dict[int, str] = {}
    pending: dict[str, Call] = {}
    tr = Trace()
    for i, raw in enumerate(text.splitlines()):
        m = _LINE.match(raw)
        if not m:
            continue
        pid, rest = m.groups()
        r = _RESUMED.match(rest)
        if r:
            c = pending.pop(pid, None)
            if c is None or c.name != r.group(1):
                continue
            body = r.group(2)
            c.args += body
        else:
            cm = _CALL.match(rest)
            if not cm:
                continue
            c = Call(cm.group(1), cm.group(2), start=i)
            if c.name in ("fsync", "fdatasync"):
                fd = int(re.match(r"\s*(\d+)", c.args).group(1))
                c.path = fds.get(fd)
            if rest.endswith("<unfinished ...>"):
                pending[pid] = c
                continue
        c.end = i
        c.ret = c.args.rsplit("=", 1)[-1].strip() if "=" in c.args else ""
        strs = _STR.findall(c.args)
        if c.name == "openat" and strs:
            c.path = strs[0]
            ret = c.ret.split()[0] if c.ret else ""
            if ret.isdigit():
                fds[int(ret)] = c.path
        elif c.name.startswith("unlink") and strs:
            c.path = strs[0]
        elif c.name.startswith("rename") and len(strs) >= 2:
            c.path, c.dst = strs[0], strs[1]
        tr.calls.append(c)
    return tr


def ordering_problems(tr: Trace, root: str) -> list[str]:
    """What breaks the durability ordering of files published under ``root``."""
    root = os.path.realpath(root)
    manifest = os.path.join(root, "zarr.json")
    calls = tr.calls
    renames = [c for c in calls if c.name.startswith("rename") and c.ret.startswith("0")]
    renames = [c for c in renames if c.dst and c.dst.startswith(root + os.sep)]
    commits = [c for c in renames if c.dst == manifest]
    syncs = [c for c in calls if c.name in ("fsync", "fdatasync") and c.ret.startswith("0")]
    problems: list[str] = []
    if not commits:
        problems.append("no manifest write (rename to zarr.json) seen")
    for rn in renames:
        opens = [c for c in calls if c.name == "openat" and c.path == rn.path and c.end < rn.start]
        if not opens:
            problems.append(f"{rn.dst}: renamed from {rn.path}, never opened")
            continue
        opened = opens[-1].end
        if not any(opened < s.start and s.end < rn.start and s.path == rn.path for s in syncs):
            problems.append(f"{rn.dst}: {rn.path} not fsynced before its rename")
        d = os.path.dirname(rn.dst)
        dsync = [s for s in syncs if s.path == d and s.start > rn.end]
        if not dsync:
            problems.append(f"{rn.dst}: directory {d} not fsynced after the rename")
            continue
        chunk = "/c/" in rn.dst[len(root) :]
        if chunk and not any(m.start > dsync[0].end for m in commits):
            problems.append(f"{rn.dst}: no manifest write after its rename and directory fsync")
    # a temporary opened for writing and then removed (a delete: TensorStore locks the
    # key with one) publishes nothing
    done = {c.path for c in renames} | {c.path for c in calls if c.name.startswith("unlink")}
    for c in calls:
        if c.name != "openat" or not c.path or not c.path.startswith(root + os.sep):
            continue
        if ("O_WRONLY" in c.args or "O_RDWR" in c.args) and c.path not in done:
            problems.append(f"{c.path}: opened for writing, never renamed into place")
    return problems


def _strace() -> str:
    exe = shutil.which("strace")
    if exe is None:
        pytest.skip("strace is not installed (Debian: apt-get install strace)")
    probe = subprocess.run([exe, "-f", "-o", os.devnull, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here: {probe.stderr.decode().strip()[:200]}")
    return exe


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    exe = _strace()
    tmp = tmp_path_factory.mktemp("durable")
    run, log, script = tmp / "run", tmp / "strace.log", tmp / "rec.py"
    script.write_text(RECORDING)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    trace = "trace=fsync,fdatasync,rename,renameat,renameat2,openat,unlink,unlinkat"
    cmd = [exe, "-f", "-qq", "-s", "4096", "-o", str(log), "-e", trace]
    p = subprocess.run(
        [*cmd, sys.executable, str(script), str(run)],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    return os.path.realpath(run), parse(log.read_text())


def test_every_published_file_is_fsynced_renamed_and_committed(traced):
    run, tr = traced
    renames = [c for c in tr.calls if c.name.startswith("rename") and c.dst]
    dsts = [c.dst[len(run) :] for c in renames if c.dst.startswith(run)]
    # the trace covers every class of file the issue names
    assert "/zarr.json" in dsts
    assert "/.traintape/writer.json" in dsts
    assert any(d.startswith("/snapshots/param/x/kernel/c/") for d in dsts), dsts
    assert any(d.startswith("/stats/grad/c/") for d in dsts), dsts
    assert ordering_problems(tr, run) == []


def test_checker_sees_a_missing_fsync_and_directory_fsync():
    """The checker itself: a publish without the data fsync, or without the directory
    fsync, is named."""
    good = textwrap.dedent(
        """\
        1 openat(AT_FDCWD, "/r", O_RDONLY|O_DIRECTORY) = 3
        1 openat(AT_FDCWD, "/r/c/0.__lock", O_WRONLY|O_CREAT, 0666) = 4
        2 fsync(4 <unfinished ...>
        2 <... fsync resumed>) = 0
        1 rename("/r/c/0.__lock", "/r/c/0") = 0
        1 openat(AT_FDCWD, "/r/c", O_RDONLY|O_DIRECTORY) = 5
        1 fsync(5) = 0
        1 openat(AT_FDCWD, "/r/zarr.json.__lock", O_WRONLY|O_CREAT, 0666) = 4
        1 fsync(4) = 0
        1 rename("/r/zarr.json.__lock", "/r/zarr.json") = 0
        1 fsync(3) = 0
        """
    )
    assert ordering_problems(parse(good), "/r") == []
    no_data_sync = good.replace("2 fsync(4 <unfinished ...>\n2 <... fsync resumed>) = 0\n", "")
    assert any("not fsynced before" in p for p in ordering_problems(parse(no_data_sync), "/r"))
    no_dir_sync = good.replace("1 fsync(5) = 0\n", "")
    assert any("not fsynced after" in p for p in ordering_problems(parse(no_dir_sync), "/r"))
