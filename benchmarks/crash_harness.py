"""Kill harness: SIGKILL a recording child in every scenario of tests/crash_check.py and
check every store (validates, every committed value bit-exact, reopened and appended to).

    python benchmarks/crash_harness.py --trials 300 [--out DIR]

Prints the table (scenario x trials x valid x bit-exact x appendable) for the README.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from crash_check import SCENARIOS, kill_once, verify

import traintape as tt


def appendable(run_dir: str) -> bool:
    """Reopen and append one step after the last committed one."""
    from _crash_child import POLICY, record

    with tt.Recorder(run_dir, POLICY) as rec:
        last = rec.manifest.commit.last_step
        record(rec, 0 if last is None else last + 1)
    return verify(run_dir) >= 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=300, help="trials in all (round robin)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None, help="directory for the stores (default: temp)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(args.out or tempfile.mkdtemp(prefix="tt-crash-"))
    counts: dict[str, Counter[str]] = {s: Counter() for s in SCENARIOS}
    chains = {s: str(root / s) for s in SCENARIOS}
    for i in range(args.trials):
        s = SCENARIOS[i % len(SCENARIOS)]
        c = counts[s]
        c["trials"] += 1
        run_dir = chains[s] if s in ("train", "close") else str(root / f"{s}-{i}")
        try:
            kill_once(run_dir, rng, s)
        except AssertionError as e:
            print(f"trial {i} {s}: {e}", flush=True)
            continue
        if not Path(run_dir, "zarr.json").exists():
            c["valid"] += 1  # killed before the store existed: nothing to check
            c["bit-exact"] += 1
            c["appendable"] += appendable(run_dir)
            continue
        try:
            verify(run_dir)
            c["valid"] += 1
            c["bit-exact"] += 1
        except AssertionError as e:
            print(f"trial {i} {s}: {e}", flush=True)
            continue
        try:
            c["appendable"] += appendable(run_dir)
        except Exception as e:
            print(f"trial {i} {s}: not appendable: {e}", flush=True)
        if (i + 1) % 20 == 0 and i + 1 < args.trials:
            print(f"after {i + 1} trials:", flush=True)
            _table(counts)
    _table(counts)


def _table(counts: dict[str, Counter[str]]) -> None:
    print("| scenario | trials | valid | bit-exact | appendable |")
    print("|---|---|---|---|---|")
    for s in SCENARIOS:
        c = counts[s]
        print(f"| {s} | {c['trials']} | {c['valid']} | {c['bit-exact']} | {c['appendable']} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
