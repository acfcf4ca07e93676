"""Kill harness: SIGKILL a recording child in every scenario of tests/crash_check.py and
check every store (validates, every committed value bit-exact, reopened and appended to),
and the rows each kill lost against the documented bound.

    python benchmarks/crash_harness.py --trials 300 [--scenarios train,sustained] [--out DIR]

Scenarios: train, close, create, race (tests/test_crash.py runs two of each) and
sustained (a full capture every step), slow (the same, storage slower than capture),
pidns (each child PID 1 of a new PID namespace: a restarted container; needs root and
``unshare``). Prints the table (scenario x trials x valid x bit-exact x appendable x worst
rows lost vs bound) for the README.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from crash_check import EXTRA_SCENARIOS, LAST, SCENARIOS, kill_once, loss_bound, verify

import traintape as tt

CHAINED = ("train", "close", "sustained", "slow", "pidns")
"""Scenarios whose trials chain on one store (each resumes what the previous left)."""


def appendable(run_dir: str, scenario: str = "train") -> bool:
    """Reopen (with the store's own policy) and append one step after the last
    committed one. A store last written in another PID namespace is taken over after
    its claim was watched for the stale interval (1 s there)."""
    from _crash_child import record

    stale = 1.0 if scenario == "pidns" else 30.0
    with tt.Recorder(run_dir, claim_stale_after=stale, system_metrics=False) as rec:
        last = rec.manifest.commit.last_step
        record(rec, 0 if last is None else last + 1)
    return verify(run_dir) >= 1


def available() -> tuple[str, ...]:
    extra = [s for s in EXTRA_SCENARIOS if s != "pidns"]
    if shutil.which("unshare") and os.geteuid() == 0:
        extra.append("pidns")
    return (*SCENARIOS, *extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=300, help="trials in all (round robin)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scenarios", default=",".join(available()))
    ap.add_argument("--out", default=None, help="directory for the stores (default: temp)")
    args = ap.parse_args()
    scenarios = tuple(args.scenarios.split(","))
    rng = random.Random(args.seed)
    root = Path(args.out or tempfile.mkdtemp(prefix="tt-crash-"))
    counts: dict[str, Counter[str]] = {s: Counter() for s in scenarios}
    chains = {s: str(root / s) for s in scenarios}
    for i in range(args.trials):
        s = scenarios[i % len(scenarios)]
        c = counts[s]
        c["trials"] += 1
        run_dir = chains[s] if s in CHAINED else str(root / f"{s}-{i}")
        try:
            kill_once(run_dir, rng, s)
        except AssertionError as e:
            print(f"trial {i} {s}: {e}", flush=True)
            continue
        if not Path(run_dir, "zarr.json").exists():
            c["valid"] += 1  # killed before the store existed: nothing to check
            c["bit-exact"] += 1
            c["appendable"] += appendable(run_dir, s)
            continue
        try:
            rows = verify(run_dir)
            c["valid"] += 1
            c["bit-exact"] += 1
        except AssertionError as e:
            print(f"trial {i} {s}: {e}", flush=True)
            continue
        if "recorded" in LAST:
            lost = LAST["recorded"] - rows
            c["lost"] = max(c["lost"], lost)
            c["bound"] = max(c["bound"], loss_bound(s, LAST["flush"]))
            if lost > loss_bound(s, LAST["flush"]):
                c["over"] += 1
                print(f"trial {i} {s}: lost {lost} rows, bound {loss_bound(s, LAST['flush'])}")
        try:
            c["appendable"] += appendable(run_dir, s)
        except Exception as e:
            print(f"trial {i} {s}: not appendable: {e}", flush=True)
        if (i + 1) % 20 == 0 and i + 1 < args.trials:
            print(f"after {i + 1} trials:", flush=True)
            _table(counts)
    _table(counts)


def _table(counts: dict[str, Counter[str]]) -> None:
    print("| scenario | trials | valid | bit-exact | appendable | worst rows lost | bound | over |")
    print("|---|---|---|---|---|---|---|---|")
    for s, c in counts.items():
        lost = str(c["lost"]) if "bound" in c else "-"
        bound = str(c["bound"]) if "bound" in c else "-"
        print(f"| {s} | {c['trials']} | {c['valid']} | {c['bit-exact']} | {c['appendable']} "
              f"| {lost} | {bound} | {c['over']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
