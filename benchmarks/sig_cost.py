"""Cost of the layout signature ``sig`` in the host C stat kernel (issue 17 item 7).

The stat kernel before ``sig`` existed (``core/_fused_stats.c`` at commit
``fd5fc52^``, extracted with ``git show``) and the working tree's kernel are compiled
with the same flags as :mod:`traintape.core.native` (``FLAGS_OMP``) into separate shared
objects and called through ctypes on the same buffers (33.5M elements by default:
a 4096 x 8192 float32 or float64 array), interleaved round-robin in one process
(:func:`_common.time_kernels`; each round keeps the median of ``--reps`` calls, the
ratio is the median over rounds of the per-round ratios). Cases: float32 / float64,
identity index map / a transposed layout's map (a torch ``Linear`` weight held
``(out, in)``, canonical ``(in, out)``), 1 and 2 threads. The pre-``sig`` kernel takes
no index map: its cost does not depend on the layout. The target: every ratio <= 1.1.

The working tree's kernel caches the sign bits (``tt_sig_cache_limit``): after the
warm-up round every call reads them from the cache, as in training, where the same
tensors are reduced every step; ``--no-cache`` sets the cache limit to 0 (every call
hashes every canonical index).

Also checked on every case: the working tree's raw rows equal those of every ``--also``
commit bit for bit, and ``sig`` equals the numpy reference
(:func:`traintape.schema.stats.sig_of`) to 1e-6 (float32: float32 lane sums) or 1e-12
(float64) of ``sum |x|``.

Usage: python benchmarks/sig_cost.py [--rounds 9] [--reps 3] [--numel 33554432]
[--threads 1,2] [--cold] [--no-cache] [--also REV ...] (``--also`` times the kernel of another
commit as well, e.g. ``--also HEAD`` before committing a kernel change; ``--cold``
flushes the CPU caches before every call). "first call": the working tree's first call
on a layout (signs hashed and cached) over one pre-``sig`` call, a single noisy sample.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import time_kernels

from traintape.core import native
from traintape.core.stats import map_words
from traintape.schema.stats import RAW_INDEX, index_map, sig_of

REPO = Path(__file__).resolve().parent.parent
PRE_SIG = "fd5fc52^"
SRC = "traintape/core/_fused_stats.c"


def build(rev: str | None, tmp: Path) -> ctypes.CDLL:
    """The kernel at commit ``rev`` (None: the working tree), built as native.py does."""
    if rev is None:
        src = native.SOURCE
    else:
        text = subprocess.run(
            ["git", "show", f"{rev}:{SRC}"], cwd=REPO, capture_output=True, check=True
        ).stdout
        src = tmp / f"fused_{len(list(tmp.iterdir()))}.c"
        src.write_bytes(text)
    return ctypes.CDLL(str(native.build_shared_object("sigcost", [src], native.FLAGS_OMP)))


class Kernel:
    """ctypes call of one kernel on one buffer (index map only if the kernel has them)."""

    def __init__(self, lib: ctypes.CDLL, a: np.ndarray, words: list[int] | None, threads: int):
        lib.tt_raw_names.restype = ctypes.c_char_p
        self.nraw = len(lib.tt_raw_names().split(b","))
        self.mapped = hasattr(lib, "tt_raw_stats_mapped")
        self.fn = lib.tt_raw_stats_mapped if self.mapped else lib.tt_raw_stats
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = (
            [ctypes.c_int64] + [ctypes.c_void_p] * (5 if self.mapped else 4) + [ctypes.c_int]
        )
        self.a = a
        self.ptrs = np.array([a.ctypes.data], dtype=np.uintp)
        self.lens = np.array([a.size], dtype=np.int64)
        self.codes = np.array([1 if a.dtype == np.float64 else 0], dtype=np.int32)
        self.table = np.array([words or [0] * 18], dtype=np.int64)
        self.out = np.empty((1, self.nraw))
        self.threads = threads

    def __call__(self) -> np.ndarray:
        head = (1, self.ptrs.ctypes.data, self.lens.ctypes.data, self.codes.ctypes.data)
        if self.mapped:
            rc = self.fn(*head, self.table.ctypes.data, self.out.ctypes.data, self.threads)
        else:
            rc = self.fn(*head, self.out.ctypes.data, self.threads)
        assert rc == 0
        return self.out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--numel", type=int, default=4096 * 8192)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--maps", default="identity,transposed")
    ap.add_argument("--cold", action="store_true", help="flush the caches before every call")
    ap.add_argument("--no-cache", action="store_true", help="no sign-bit cache (hash only)")
    ap.add_argument("--also", action="append", default=[], metavar="REV")
    args = ap.parse_args()
    out_dim = 4096
    shape = (out_dim, args.numel // out_dim)
    with tempfile.TemporaryDirectory() as d:
        libs = {"pre-sig": build(PRE_SIG, Path(d))}
        libs.update({rev: build(rev, Path(d)) for rev in args.also})
        libs["now"] = build(None, Path(d))
    if args.no_cache:
        libs["now"].tt_sig_cache_limit.argtypes = [ctypes.c_longlong]
        libs["now"].tt_sig_cache_limit(0)
    rng = np.random.default_rng(0)
    base = rng.standard_normal(shape)
    print(f"{shape[0]} x {shape[1]} = {base.size / 1e6:.1f}M elements, rounds {args.rounds} x "
          f"{args.reps} calls, {'cold' if args.cold else 'warm'} CPU caches"
          f"{', no sign cache' if args.no_cache else ''}; "
          f"ratio = median over rounds of (ms / pre-sig ms)")  # fmt: skip
    names = list(libs)
    print(f"{'dtype':8s} {'map':11s} {'thr':>3s} {'pre-sig ms':>10s} "
          + " ".join(f"{n + ' x':>10s}" for n in names[1:]) + "  check")  # fmt: skip
    worst = 0.0
    seen: set[str] = set()
    for dt in args.dtypes.split(","):
        a = base.astype(dt)
        for mp in args.maps.split(","):
            imap = index_map(shape, (1, 0)) if mp == "transposed" else None
            words = map_words(imap, shape)
            ref = sig_of(a, imap) if a.size <= 1 << 26 else None
            for th in (int(t) for t in args.threads.split(",")):
                ks = {n: Kernel(lib, a, words, th) for n, lib in libs.items()}
                first = ""
                if mp not in seen:  # the signs of this map are not cached yet
                    seen.add(mp)
                    ks["pre-sig"]()
                    t0 = time.perf_counter()
                    ks["now"]()
                    t1 = time.perf_counter()
                    ks["pre-sig"]()
                    first = f"; first call {(t1 - t0) / (time.perf_counter() - t1):.2f}x"
                t = time_kernels(ks, args.rounds, args.reps, cold=args.cold)
                now = ks["now"]().copy()
                differ = [n for n in names[1:-1] if not np.array_equal(
                    ks[n]().view(np.int64), now.view(np.int64))]  # fmt: skip
                tol = (1e-6 if dt == "float32" else 1e-12) * now[RAW_INDEX["abs_sum"]]
                ok = ref is None or abs(now[RAW_INDEX["sig"]] - ref) <= tol
                ratios = [t.ratio(n, "pre-sig") for n in names[1:]]
                worst = max(worst, ratios[-1])
                same = "; ".join([f"DIFFERS from {n}" for n in differ]
                                 or [f"= {n} bit for bit" for n in names[1:-1]])  # fmt: skip
                print(f"{dt:8s} {mp:11s} {th:3d} {t.median('pre-sig'):10.2f} "
                      + " ".join(f"{r:10.3f}" for r in ratios)
                      + f"  sig {'= reference' if ok else 'DIFFERS from reference'}"
                      + (f"; {same}" if same else "") + first)  # fmt: skip
    print(f"worst ratio now / pre-sig: {worst:.3f} (target <= 1.1)")


if __name__ == "__main__":
    main()
