"""Start the processes of a multi-process test on 127.0.0.1 and stop them by PID."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

MOTO = Path(sys.executable).with_name("moto_server")
"""The ``moto_server`` of this interpreter's environment (the ``moto[server]`` package)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(
    cmds: list[list[str]], env: dict[str, str] | None = None, timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """Start every command at once, wait for all (stdout+stderr captured), kill leftovers."""
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in cmds
    ]
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@contextlib.contextmanager
def moto_server(bucket: str) -> Iterator[str]:
    """A local ``moto_server`` on a free 127.0.0.1 port with ``bucket`` created; yields its
    endpoint URL and stops the server by PID on exit."""
    with moto_process(bucket) as (url, _proc):
        yield url


@contextlib.contextmanager
def moto_process(bucket: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`moto_server`, yielding the endpoint URL and the server's process (to
    signal it by PID: SIGSTOP freezes the endpoint)."""
    port = free_port()
    proc = subprocess.Popen(
        [str(MOTO), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        urllib.request.urlopen(urllib.request.Request(f"{url}/{bucket}", method="PUT"))
        yield url, proc
    finally:
        proc.kill()
        proc.wait()
