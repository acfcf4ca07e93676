"""Store throughput, interleaved in one process (issue 2, issue 15). Prints medians and ratios.

(a) full-snapshot write throughput of large tensors through the Recorder vs raw
    ``numpy.tofile`` + fsync of the same bytes (target >= 0.8x raw); rounds alternate
    which goes first, the ratio is the median of the per-round ratios;
(b) training-thread time per step of recording stat vectors of 500 tensors
    (``record_stats``, the path adapters use; target <= 1 ms/step), and for reference
    ``record`` with host numpy arrays (stats computed by the Recorder);
(c) reading one tensor's 1000-step stats history, and one element's trajectory over
    many snapshots vs reading the snapshots whole;
(d) peak extra RSS of a fresh process while ``traintape.torch.watch`` takes a full
    snapshot of ~2 GiB of float32 parameters (default Recorder settings; target <= 256 MiB
    + one chunk), and that snapshot's throughput vs raw ``tofile`` + fsync of the same
    parameters in the same process (needs torch);
(e) for reference: the same snapshot writes as (a) to S3 (a local ``moto_server``, started
    on a free port and stopped by PID; skipped without moto[server]).

Usage: python benchmarks/store_throughput.py [--dir DIR] [--rounds 5] [--quick]
    [--only a,b,c,d,e]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

import traintape as tt
from traintape.schema import N_STATS, TensorSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _procs import MOTO, moto_server


def spec(name: str, shape: tuple[int, ...], kind: str = "param") -> TensorSpec:
    layer, _, role = name.rpartition("/")
    return TensorSpec(
        name=name, kind=kind, role=role, layer=layer, dtype="float32", shape=list(shape)
    )


def raw_write(d: str, arrays: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    for i, a in enumerate(arrays):
        path = os.path.join(d, f"raw_{i}.bin")
        with open(path, "wb") as f:
            a.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    for i in range(len(arrays)):
        os.remove(os.path.join(d, f"raw_{i}.bin"))
    return dt


def traintape_snapshots(url: str, arrays: list[np.ndarray], steps: int) -> float:
    """Seconds to record ``steps`` full snapshots of ``arrays`` until they are durable and
    committed (``flush``; closing, which trims the arrays once per run, is not timed)."""
    local = "://" not in url
    if local:
        shutil.rmtree(url, ignore_errors=True)
    names = [f"layers/{i}/dense/kernel" for i in range(len(arrays))]
    pol = tt.CapturePolicy(full_every=1, kinds=("param",), snapshot_kinds=("param",))
    rec = tt.Recorder(url, pol, system_metrics=False)
    rec.declare([spec(n, a.shape) for n, a in zip(names, arrays, strict=True)])
    vec = np.zeros((len(arrays), N_STATS))
    # step 0 creates the arrays (one-time setup, not throughput); time steps 1..steps
    rec.record_stats(0, "param", vec, names=names, snapshots=dict(zip(names, arrays, strict=True)))
    rec.log(1, warmup=1.0)
    rec.flush()
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        rec.record_stats(
            s, "param", vec, names=names, snapshots=dict(zip(names, arrays, strict=True))
        )
    rec.flush()
    dt = time.perf_counter() - t0
    rec.close()
    if local:
        shutil.rmtree(url, ignore_errors=True)
    return dt


def snapshot_arrays(mib: int, n_tensors: int = 4) -> list[np.ndarray]:
    side = int((mib * (1 << 20) // 4 // n_tensors) ** 0.5)
    return [
        np.random.default_rng(i).normal(size=(side, side)).astype(np.float32)
        for i in range(n_tensors)
    ]


def bench_snapshots(d: str, rounds: int, mib: int) -> None:
    steps = 4
    arrays = snapshot_arrays(mib)
    side = arrays[0].shape[0]
    nbytes = sum(a.nbytes for a in arrays) * steps
    raw, ours, ratios = [], [], []
    for r in range(rounds):  # interleaved; which goes first alternates
        order = ("raw", "tt") if r % 2 == 0 else ("tt", "raw")
        got = {}
        for what in order:
            if what == "raw":
                got[what] = nbytes / raw_write(d, arrays * steps)
            else:
                got[what] = nbytes / traintape_snapshots(os.path.join(d, "snap"), arrays, steps)
        raw.append(got["raw"])
        ours.append(got["tt"])
        ratios.append(got["tt"] / got["raw"])
    r, o = statistics.median(raw), statistics.median(ours)
    print(
        f"(a) snapshots {nbytes / 2**20:.0f} MiB/round ({len(arrays)} tensors {side}x{side} f32"
        f" x {steps} steps, {rounds} rounds): raw tofile+fsync {r / 2**30:.2f} GiB/s, traintape"
        f" {o / 2**30:.2f} GiB/s; ratio {statistics.median(ratios):.2f}x raw (median of"
        f" per-round ratios {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.8x)"
    )


def bench_stats(d: str, rounds: int, steps: int) -> None:
    n = 500
    names = [f"blocks/{i // 5}/l{i % 5}/kernel" for i in range(n)]
    shapes = [(16, 16)] * n
    pol = tt.CapturePolicy(kinds=("grad",))
    stats = np.abs(np.random.default_rng(0).normal(size=(n, N_STATS)))
    stats[:, 7:] = 0  # no NaN/Inf: the common case
    small = [
        np.random.default_rng(i).normal(size=s).astype(np.float32) for i, s in enumerate(shapes)
    ]
    res_stats, res_numpy = [], []
    for r in range(rounds):
        for mode in ("stats", "numpy"):
            url = os.path.join(d, f"stats_run_{mode}_{r}")
            rec = tt.Recorder(url, pol)
            rec.declare([spec(nm, s, "grad") for nm, s in zip(names, shapes, strict=True)])
            k = steps if mode == "stats" else max(steps // 10, 50)
            t0 = time.perf_counter()
            for s in range(k):
                if mode == "stats":
                    rec.record_stats(s, "grad", stats, names=names)
                else:
                    rec.record(s, "grad", dict(zip(names, small, strict=True)))
            rec.close()
            dt = time.perf_counter() - t0
            w = tt.open_run(url).manifest.writer
            (res_stats if mode == "stats" else res_numpy).append((dt / k * 1e3, w.stalls))
            shutil.rmtree(url, ignore_errors=True)
    ms = statistics.median(x for x, _ in res_stats)
    mn = statistics.median(x for x, _ in res_numpy)
    print(
        f"(b) stats of {n} tensors: record_stats {ms:.3f} ms/step amortised incl. close "
        f"(target <= 1 ms; stalls {[s for _, s in res_stats]}); "
        f"record(numpy, stats on host) {mn:.2f} ms/step"
    )


def bench_reads(d: str, rounds: int, rows: int, snaps: int) -> None:
    url = os.path.join(d, "read_run")
    shutil.rmtree(url, ignore_errors=True)
    n = 500
    names = [f"blocks/{i // 5}/l{i % 5}/kernel" for i in range(n)]
    big = "big/dense/kernel"
    pol = tt.CapturePolicy(
        full_every=max(rows // snaps, 1), kinds=("grad", "param"), snapshot_kinds=("param",)
    )
    rng = np.random.default_rng(0)
    with tt.Recorder(url, pol, flush_every_steps=100) as rec:
        rec.declare([spec(nm, (16, 16), "grad") for nm in names] + [spec(big, (512, 512))])
        base = rng.normal(size=(512, 512)).astype(np.float32)
        for s in range(rows):
            rec.record_stats(s, "grad", np.abs(rng.normal(size=(n, N_STATS))), names=names)
            if pol.is_full(s):
                rec.record_stats(
                    s, "param", np.zeros((1, N_STATS)), names=[big], snapshots={big: base + s}
                )
    run = tt.open_run(url)
    hist, traj, whole = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        h = run.stats("grad", tensors=[names[123]])
        hist.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _, v = run.trajectory(big, "param", (300, 7))
        traj.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        arr = np.asarray(run.snapshots(big, "param").read().result())
        whole.append(time.perf_counter() - t0)
        assert len(h) == rows and np.array_equal(v, arr[:, 300, 7])
    n_s = len(run.snapshot_steps(big, "param"))
    print(
        f"(c) one tensor's {rows}-step stats history: {statistics.median(hist) * 1e3:.1f} ms; "
        f"one element over {n_s} snapshots of 512x512: {statistics.median(traj) * 1e3:.1f} ms vs "
        f"reading them whole {statistics.median(whole) * 1e3:.1f} ms "
        f"({statistics.median(whole) / statistics.median(traj):.1f}x faster)"
    )
    shutil.rmtree(url, ignore_errors=True)


RSS_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import traintape as tt
    import traintape.torch as ttt

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    d, layers, side = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with torch.no_grad():
        model = torch.nn.Sequential(
            *[torch.nn.Linear(side, side, bias=False) for _ in range(layers)]
        )

    def raw():  # the same parameter bytes, tofile + fsync per tensor
        t0 = time.perf_counter()
        for i, p in enumerate(model.parameters()):
            with open(os.path.join(d, f"raw_{i}.bin"), "wb") as f:
                p.detach().numpy().tofile(f)
                f.flush()
                os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        for i, _ in enumerate(model.parameters()):
            os.remove(os.path.join(d, f"raw_{i}.bin"))
        return dt

    def capture(name, snapshots):  # one captured step: stats (+ a full snapshot)
        pol = tt.CapturePolicy(
            full_every=1, kinds=("param",), snapshot_kinds=("param",) if snapshots else ()
        )
        rec = tt.Recorder(os.path.join(d, name), pol, system_metrics=False)
        t0 = time.perf_counter()
        handle = ttt.watch(model, rec)  # no optimizer: θ_0 is read here
        handle.step()  # ... and recorded here
        rec.flush()  # durable
        dt = time.perf_counter() - t0
        handle.remove()
        rec.close()
        return dt

    capture("warm", False)
    t_raw, t_stats = [raw()], [capture("stats0", False)]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = status("VmRSS")
    t_snap = capture("run", True)
    peak = status("VmHWM")
    t_raw.append(raw())
    t_stats.append(capture("stats1", False))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    print(json.dumps({"extra": peak - before, "bytes": nbytes, "snap": t_snap,
                      "raw": t_raw, "stats": t_stats}))
    """
)


def bench_rss(d: str, gib: float) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("(d) skipped: torch is not installed")
        return
    if not Path("/proc/self/clear_refs").exists():
        print("(d) skipped: needs Linux /proc (peak RSS reset)")
        return
    side = 4096
    layers = max(1, round(gib * 2**30 / (side * side * 4)))
    work = tempfile.mkdtemp(dir=d)
    out = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, work, str(layers), str(side)],
        capture_output=True,
        text=True,
        cwd=work,  # import traintape as installed (or from PYTHONPATH), not from the cwd
    )
    if out.returncode != 0:
        print(f"(d) failed: {out.stderr[-2000:]}")
        return
    res = json.loads(out.stdout.strip().splitlines()[-1])
    raw, stats = statistics.median(res["raw"]), statistics.median(res["stats"])
    write = res["snap"] - stats
    print(
        f"(d) torch full snapshot of {res['bytes'] / 2**30:.2f} GiB of parameters ({layers} x "
        f"{side}x{side} f32, default Recorder): peak extra RSS {res['extra'] / 2**20:.0f} MiB "
        f"(target <= 256 MiB + one 128 KiB chunk). Captured step {res['snap']:.2f} s, the "
        f"same step without the snapshot {stats:.2f} s, so the snapshot adds {write:.2f} s = "
        f"{res['bytes'] / max(write, 1e-9) / 2**30:.2f} GiB/s, {raw / max(write, 1e-9):.2f}x "
        f"raw tofile+fsync of the same tensors ({res['raw'][0]:.2f}/{res['raw'][1]:.2f} s "
        f"before/after; the snapshot transposes Linear weights to canonical layout)"
    )


def bench_s3(rounds: int, mib: int) -> None:
    if shutil.which(str(MOTO)) is None:
        print("(e) skipped: moto[server] is not installed")
        return
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        with moto_server("bench") as endpoint:
            os.environ.update(
                AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
            )  # fmt: skip
            arrays = snapshot_arrays(mib)
            steps = 2
            nbytes = sum(a.nbytes for a in arrays) * steps
            rates = [
                nbytes / traintape_snapshots(f"s3://bench/run{r}", arrays, steps)
                for r in range(rounds)
            ]
            print(
                f"(e) reference: snapshots to S3 (local moto_server) {nbytes / 2**20:.0f} "
                f"MiB/round: {statistics.median(rates) / 2**20:.0f} MiB/s (median of {rounds})"
            )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--dir", default=None, help="where to write (default: a temp dir on local disk)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--only", default="a,b,c,d,e", help="which parts, e.g. a,d")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    d = a.dir or tempfile.mkdtemp(prefix="tt-bench-", dir=os.getcwd())
    os.makedirs(d, exist_ok=True)
    try:
        if "a" in parts:
            bench_snapshots(d, a.rounds, 32 if a.quick else 256)
        if "b" in parts:
            bench_stats(d, a.rounds, 200 if a.quick else 2000)
        if "c" in parts:
            bench_reads(d, a.rounds, 200 if a.quick else 1000, 50 if a.quick else 200)
        if "d" in parts:
            bench_rss(d, 0.25 if a.quick else 2.0)
        if "e" in parts:
            bench_s3(min(a.rounds, 3), 8 if a.quick else 32)
    finally:
        if a.dir is None:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
