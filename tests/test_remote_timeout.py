"""An unreachable object store is a clear error naming the URL after a few retries, never
a 15-minute hang (no network here: the host names do not resolve). The commands run in
subprocesses whose generous timeout turns a hang into a failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "url", ["gs://traintape-no-such-bucket/run", "s3://traintape-no-such-bucket/run"]
)
def test_unreachable_bucket_is_an_error_not_a_hang(url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from traintape.cli import main; main()", "validate", url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode in (1, 2), out.stdout + out.stderr[-500:]
    assert "traintape-no-such-bucket" in out.stdout and "retry" in out.stdout


def test_retry_count_is_configurable() -> None:
    code = (
        "import traintape as tt\n"
        "try:\n    tt.open_run('gs://traintape-no-such-bucket/run')\n"
        "except tt.TraintapeError as e:\n    print('error:', e)\n"
    )
    env = {**os.environ, "TRAINTAPE_REMOTE_RETRIES": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.stdout.startswith("error:") and "All 1 retry attempts failed" in out.stdout
