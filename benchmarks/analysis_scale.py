"""Analysis at scale: times and peak RSS of health, anomalies, report, compare, export.

Generates a synthetic store of STEPS rows × TENSORS tensors × KINDS (default param, grad,
update; smooth random-walk stat vectors, a loss metric) with the Recorder, a copy with one
tensor perturbed from 3/4 of the run, then runs each analysis in a fresh subprocess and
reads its peak RSS (``ru_maxrss``) — so each figure is that command alone.

    python benchmarks/analysis_scale.py                      # 2,000 × 200
    python benchmarks/analysis_scale.py --steps 20000 --tensors 2000 --kinds grad  # 2.9 GB

Targets (issue "analysis that scales"): anomalies on 2,000 × 200 ≤ 1 s; every command on
20,000 × 2,000 ≤ 60 s and ≤ 1 GiB peak RSS.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

KINDS = ("param", "grad", "update")
kinds: tuple[str, ...] = KINDS

CHILD = r"""
import json, resource, sys, time
import traintape
from traintape.analysis import anomalies, compare, export, health, write_report
what, url, other, out = sys.argv[1:5]
t0 = time.perf_counter()
run = traintape.open_run(url)
if what == "health":
    health(run)
elif what == "anomalies":
    anomalies(run)
elif what == "report":
    write_report(run, out + "/report.html")
elif what == "compare":
    compare(url, other)
elif what == "export":
    export(run, out + "/parquet", "parquet")
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def make_store(url: str, steps: int, tensors: int, perturb: bool) -> None:
    import traintape
    from traintape import TensorSpec
    from traintape.schema import STAT_INDEX, STAT_NAMES

    names = [f"layers/{i // 2}/dense/{'kernel' if i % 2 == 0 else 'bias'}" for i in range(tensors)]
    rng = np.random.default_rng(0)
    pol = traintape.CapturePolicy(kinds=kinds, snapshot_kinds=())
    block = 256
    with traintape.Recorder(url, pol, flush_every_steps=block, max_pending=4 * block) as rec:
        rec.declare([TensorSpec.build(n, k, dtype="float32", shape=[64, 64] if n.endswith("kernel")
                                      else [64]) for k in kinds for n in names])  # fmt: skip
        base = {k: np.abs(rng.normal(1.0, 0.1, size=tensors)) for k in kinds}
        for t in range(steps):
            for k in kinds:
                walk = base[k] * (1 + 0.01 * rng.standard_normal(tensors))
                base[k] = walk
                v = np.zeros((tensors, len(STAT_NAMES)))  # nan/inf counts, zero_frac: 0
                col = {s: v[:, STAT_INDEX[s]] for s in STAT_NAMES}
                col["mean"][:] = walk * 0.01
                col["std"][:] = walk
                col["min"][:], col["max"][:] = -3 * walk, 3 * walk
                col["l2"][:] = walk * 64
                col["abs_mean"][:] = walk * 0.8
                if "sig" in col:  # layout signature: ~N(0, 1) for unstructured data
                    col["sig"][:] = rng.standard_normal(tensors)
                if perturb and t >= 3 * steps // 4 and k == kinds[-1]:
                    v[0, STAT_INDEX["l2"]] *= 1.5
                rec.record_stats(t, k, v, names=names)
            rec.log(t, loss=float(1.0 / (1 + t) + 0.01 * rng.standard_normal()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--only", nargs="*", default=["health", "anomalies", "report", "compare",
                                                  "export"])  # fmt: skip
    args = ap.parse_args()
    global kinds
    kinds = tuple(args.kinds)
    tmp = Path(tempfile.mkdtemp(dir=args.dir, prefix="traintape-scale-"))
    try:
        a, b = str(tmp / "a"), str(tmp / "b")
        t0 = time.perf_counter()
        make_store(a, args.steps, args.tensors, perturb=False)
        make_store(b, args.steps, args.tensors, perturb=True)
        size = sum(f.stat().st_size for f in Path(a).rglob("*") if f.is_file())
        print(f"store: {args.steps} steps x {args.tensors} tensors x {len(kinds)} kinds, "
              f"{size / 2**20:.0f} MiB each (generated both in {time.perf_counter() - t0:.0f} s)")  # fmt: skip
        print("| command | seconds | peak RSS (MiB) |\n|---|---|---|")
        for what in args.only:
            out = tmp / f"out-{what}"
            out.mkdir()
            r = subprocess.run([sys.executable, "-c", CHILD, what, a, b, str(out)],
                               capture_output=True, text=True)  # fmt: skip
            if r.returncode != 0:
                print(f"| {what} | failed: {r.stderr.strip().splitlines()[-1][:120]} | |")
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"| {what} | {res['seconds']:.2f} | {res['rss_mib']:.0f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
