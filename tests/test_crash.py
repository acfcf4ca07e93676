"""A child process records and is SIGKILLed at random moments (20 trials, chained: each
trial resumes the store the previous one left). Every resulting store must validate and
every committed step must read back bit-exactly."""

from __future__ import annotations

import random

from crash_check import kill_once, verify


def test_sigkill_at_random_moments_leaves_valid_store(tmp_path):
    rng = random.Random(1234)
    run_dir = str(tmp_path / "crashrun")
    rows = []
    for _ in range(20):
        kill_once(run_dir, rng)
        rows.append(verify(run_dir))
    assert rows == sorted(rows), "a resumed run never loses committed rows"
    assert rows[-1] > 20, f"the children committed too little to prove anything: {rows}"
