"""Start the processes of a multi-process test on 127.0.0.1 and stop them by PID."""

from __future__ import annotations

import socket
import subprocess


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
