"""Store throughput, interleaved in one process (issue 2). Prints medians and ratios.

(a) full-snapshot write throughput of large tensors through the Recorder vs raw
    ``numpy.tofile`` + fsync of the same bytes (target >= 0.8x raw);
(b) training-thread time per step of recording stat vectors of 500 tensors
    (``record_stats``, the path adapters use; target <= 1 ms/step), and for reference
    ``record`` with host numpy arrays (stats computed by the Recorder);
(c) reading one tensor's 1000-step stats history, and one element's trajectory over
    many snapshots vs reading the snapshots whole.

Usage: python benchmarks/store_throughput.py [--dir DIR] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import traintape as tt
from traintape.schema import N_STATS, TensorSpec


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


def traintape_snapshots(d: str, arrays: list[np.ndarray], steps: int) -> float:
    url = os.path.join(d, "snap_run")
    shutil.rmtree(url, ignore_errors=True)
    names = [f"layers/{i}/dense/kernel" for i in range(len(arrays))]
    pol = tt.CapturePolicy(full_every=1, kinds=("param",), snapshot_kinds=("param",))
    rec = tt.Recorder(url, pol)
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
    rec.close()
    dt = time.perf_counter() - t0
    shutil.rmtree(url, ignore_errors=True)
    return dt


def bench_snapshots(d: str, rounds: int, mib: int) -> None:
    n_tensors, steps = 4, 4
    per = mib * (1 << 20) // 4 // n_tensors
    side = int(per**0.5)
    arrays = [
        np.random.default_rng(i).normal(size=(side, side)).astype(np.float32)
        for i in range(n_tensors)
    ]
    nbytes = sum(a.nbytes for a in arrays) * steps
    raw, ours = [], []
    for _ in range(rounds):  # interleaved
        raw.append(nbytes / raw_write(d, arrays * steps))
        ours.append(nbytes / traintape_snapshots(d, arrays, steps))
    r, o = statistics.median(raw), statistics.median(ours)
    print(
        f"(a) snapshots {nbytes / 2**20:.0f} MiB/round ({n_tensors} tensors {side}x{side} f32 x {steps} steps):"
        f" raw tofile+fsync {r / 2**30:.2f} GiB/s, traintape {o / 2**30:.2f} GiB/s,"
        f" ratio {o / r:.2f}x raw (target >= 0.8x)"
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--dir", default=None, help="where to write (default: a temp dir on local disk)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = ap.parse_args()
    d = a.dir or tempfile.mkdtemp(prefix="tt-bench-", dir=os.getcwd())
    os.makedirs(d, exist_ok=True)
    try:
        bench_snapshots(d, a.rounds, 32 if a.quick else 256)
        bench_stats(d, a.rounds, 200 if a.quick else 2000)
        bench_reads(d, a.rounds, 200 if a.quick else 1000, 50 if a.quick else 200)
    finally:
        if a.dir is None:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
