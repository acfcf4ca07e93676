"""``benchmarks/gpu_check.sh --smoke``: the GPU readiness script's CPU smoke run.

It runs ``benchmarks/step_overhead.py`` on the tiny model for the frameworks installed
here and prints one table. Checked: the script exits 0, says it is a smoke run, and
prints one parseable row per framework with positive step times and (JAX) the steps
in flight. No timing is asserted (the numbers depend on the machine's load).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = [f for f in ("torch", "jax") if importlib.util.find_spec(f) is not None]
if "jax" in FRAMEWORKS and importlib.util.find_spec("flax") is None:  # the JAX rows use NNX
    FRAMEWORKS.remove("jax")
ROW = re.compile(
    r"^(?P<fw>torch|jax)\s+tiny\s+9610\s+4\s+(?P<plain>[\d.]+)\s+(?P<capture>[\d.]+)\s+"
    r"(?P<over>-?[\d.]+) \[.*\]\s+(?P<x>[\d.]+)(?P<extra>.*)$",
    re.M,
)


@pytest.mark.skipif(not FRAMEWORKS, reason="neither torch nor jax is installed")
def test_gpu_check_smoke_prints_a_row_per_framework(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_FRAMEWORKS": ",".join(FRAMEWORKS),
        "TMPDIR": str(tmp_path),
    }
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SMOKE mode" in out.stdout
    assert "load average" in out.stdout
    rows = {m["fw"]: m for m in ROW.finditer(out.stdout)}
    assert sorted(rows) == sorted(FRAMEWORKS), out.stdout[-3000:]
    for fw, m in rows.items():
        assert float(m["plain"]) > 0 and float(m["capture"]) > 0, fw
        if fw == "jax":
            assert re.search(r"ahead [\d.]+/[\d.]+ of 5", m["extra"]), m["extra"]
    # every capture Recorder wrote a store of its own under the temporary folder
    stores = [p for p in tmp_path.glob("tt-step-*/*") if p.is_dir()]
    assert {p.name.split("-")[0] for p in stores} == set(FRAMEWORKS)
