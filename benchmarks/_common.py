"""Shared harness of the overhead benchmarks (``torch_overhead.py``, ``tf_overhead.py``).

Timing on a shared, noisy CPU: every variant runs a few steps per *round*, rounds are
interleaved round-robin (the starting variant rotates each round, so none always runs
right after the same neighbour), and each round keeps the median of its steps. Reported:

- ``median``: the median over rounds of the per-round medians (ms);
- ``delta``: a *paired* overhead — per round, variant median − baseline median, then
  the median (and inter-quartile range) of those differences over rounds. Load that
  drifts slowly (other processes) cancels within a round, which a difference of two
  global medians does not do.

Kernels timed in isolation (the stat computation vs the floor, one plain sum pass over
the same tensors) use the same machinery: an isolated ratio is far less noisy than the
difference of two whole training steps. Before each isolated call the CPU caches are
flushed (untimed, :func:`flush_caches`): a 12.6M-parameter model's params + grads are
~100 MB, which a large L3 (105 MiB here) would otherwise hold between back-to-back
calls, while inside a training step they arrive cold.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The >= 10M-parameter MLP of the overhead benchmarks (12.6M params) and a tiny one.
MLP_SIZES: list[int] = [1024, 2048, 2048, 2048, 1024, 10]
QUICK_SIZES: list[int] = [64, 128, 10]


def add_common_args(ap: argparse.ArgumentParser, *, rounds: int = 12, steps: int = 3) -> None:
    """``--batch --rounds --steps --threads --quick`` (the same in every script)."""
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=steps, help="steps per variant per round")
    ap.add_argument("--threads", type=int, default=2, help="framework + fused-kernel threads")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")


def apply_quick(args: argparse.Namespace) -> list[int]:
    """Layer sizes for ``args`` (shrinks batch/rounds/steps too under ``--quick``)."""
    if args.quick:
        args.batch, args.rounds, args.steps = 32, 2, 2
        return list(QUICK_SIZES)
    return list(MLP_SIZES)


def mlp_param_count(sizes: list[int]) -> int:
    """Parameters of a dense MLP with biases and these layer widths."""
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


@dataclass
class Timings:
    """Wall times (seconds) per variant per round; see the module docstring."""

    rounds: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    round: int = 0

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        """Call ``fn()``, add its wall time to ``name`` in the current round, return it."""
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        self.rounds.setdefault(name, {}).setdefault(self.round, []).append(dt)
        return out

    def round_medians(self, name: str) -> dict[int, float]:
        """Round → median seconds of ``name`` in that round."""
        return {r: statistics.median(v) for r, v in self.rounds[name].items()}

    def median(self, name: str) -> float:
        """Median over rounds of the per-round medians, in ms."""
        return statistics.median(self.round_medians(name).values()) * 1e3

    def medians(self) -> dict[str, float]:
        """:meth:`median` of every variant (ms), in first-timed order."""
        return {k: self.median(k) for k in self.rounds}

    def delta(self, name: str, base: str) -> tuple[float, float, float]:
        """Paired overhead of ``name`` over ``base`` in ms: (median, q25, q75) over the
        rounds where both ran of (median of ``name`` − median of ``base``)."""
        a, b = self.round_medians(name), self.round_medians(base)
        d = sorted((a[r] - b[r]) * 1e3 for r in a if r in b)
        if len(d) == 1:
            return d[0], d[0], d[0]
        q = statistics.quantiles(d, n=4, method="inclusive")
        return statistics.median(d), q[0], q[2]

    def ratio(self, name: str, base: str) -> float:
        """Median over rounds of the per-round ratio ``name`` / ``base``."""
        a, b = self.round_medians(name), self.round_medians(base)
        return statistics.median(a[r] / b[r] for r in a if r in b)


Variant = Callable[[Timings], None]


_FLUSH: np.ndarray | None = None


def flush_caches(mib: int = 256) -> None:
    """Evict the CPU caches: read and write a ``mib`` MiB buffer (allocated once)."""
    global _FLUSH
    if _FLUSH is None or _FLUSH.nbytes != mib << 20:
        _FLUSH = np.zeros((mib << 20) // 8)
    _FLUSH += 1.0


def repeat(
    name: str, fn: Callable[[], Any], steps: int, before: Callable[[], Any] | None = None
) -> Variant:
    """A variant that times ``fn()`` ``steps`` times under ``name`` (``before()`` runs
    untimed ahead of each call)."""

    def run(t: Timings) -> None:
        for _ in range(steps):
            if before is not None:
                before()
            t.timed(name, fn)

    return run


def interleave(
    variants: Mapping[str, Variant],
    rounds: int,
    timings: Timings | None = None,
    *,
    warmup: int = 1,
) -> Timings:
    """Run every variant once per round, round-robin, rotating the starting variant.

    The first ``warmup`` rounds are run the same way and discarded (first-call costs:
    tracing, hook installation, allocator growth).
    """
    if warmup > 0:
        interleave(variants, warmup, Timings(), warmup=0)
    t = timings if timings is not None else Timings()
    names = list(variants)
    for r in range(rounds):
        t.round = r
        k = r % len(names)
        for n in names[k:] + names[:k]:
            variants[n](t)
    return t


def time_kernels(
    kernels: Mapping[str, Callable[[], Any]], rounds: int, reps: int, *, cold: bool = True
) -> Timings:
    """Time zero-argument ``kernels`` in isolation (a warm-up round, then interleaved;
    with ``cold``, caches flushed before every call)."""
    before = flush_caches if cold else None
    return interleave({k: repeat(k, f, reps, before) for k, f in kernels.items()}, rounds)


def print_table(t: Timings, base: str, names: Iterable[str] | None = None) -> None:
    """Median ms/step, ratio to ``base`` and the paired overhead with its IQR."""
    names = list(names) if names is not None else list(t.rounds)
    print(f"\n{'variant':18s} {'median ms':>10s} {'x base':>8s} {'paired delta ms [IQR]':>26s}")
    for k in names:
        d, lo, hi = t.delta(k, base)
        print(f"{k:18s} {t.median(k):10.2f} {t.ratio(k, base):8.3f} "
              f"{d:9.2f} [{lo:7.2f}, {hi:7.2f}]")  # fmt: skip


def overhead_line(label: str, over: float, floor: float, step: float) -> str:
    """``label: overhead X ms = Y x floor, Z% of step (target <= 2x, <= 5%)``."""
    ratio = f"{over / floor:.2f}x floor" if floor > 0 else "floor below noise"
    return (f"{label}: overhead {over:.2f} ms = {ratio}, {100 * over / step:.2f}% of step "
            f"(target <= 2x, <= 5%)")  # fmt: skip
