"""Mutation check: plant plausible bugs one at a time in a COPY of the package and run
the tests that should catch each (issue 29).

Each mutation replaces one exact snippet of one file (it must occur exactly once: a
mutation whose snippet has drifted is reported as ``stale``, never silently skipped) in
a temporary copy of ``traintape/``, ``conformance/`` and ``tests/``; then the mapped
test files run there with ``PYTHONPATH`` pointing at the copy (``pytest -x -q``, the
listed ``-k`` selection). A mutation is *caught* when that run fails. The worktree is
never modified.

Usage::

    python benchmarks/mutation_check.py                 # every mutation
    python benchmarks/mutation_check.py --list          # ids and what each plants
    python benchmarks/mutation_check.py --only nan-merge-max,validate-repeated
    python benchmarks/mutation_check.py --limit 10 --timeout 600

Prints one line per mutation (caught / MISSED / stale / timeout) and the score
``caught / run``. Exit status 0 iff every mutation that ran was caught.

Add a mutation for every class of bug a user reports.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    id: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    k: str | None = None
    why: str = ""
    env: dict[str, str] = field(default_factory=dict)


SCHEMA = "traintape/schema/stats.py"
TORCH = "traintape/adapters/torch/stats.py"
JAXS = "traintape/adapters/jax/stats.py"
TFS = "traintape/adapters/tf/stats.py"
REF = "tests/test_stats_reference.py"
ESC = "tests/test_verdict_escapes.py"
ANCHOR = "tests/test_conformance_anchor.py"

M = Mutation
MUTATIONS: list[Mutation] = [
    # ------------------------------------------------ the seven escapes of issue 29
    M("nan-merge-max", SCHEMA,
      'RawField("nan", Merge.ADD,', 'RawField("nan", Merge.MAX,',
      (REF,), "merged and host", "NaN counts of parts merged with max"),
    M("torch-large-zeros-0", TORCH,
      "zeros=n - nz, nan=", "zeros=n * 0, nan=",
      (REF,), "torch", "torch ops: zero count 0 for large tensors"),
    M("torch-small-abs-of-sum", TORCH,
      "abs_sum=seg(xz.abs()),", "abs_sum=seg(xz).abs(),",
      (REF,), "torch", "torch ops: |sum x| for sum |x| (small tensors)"),
    M("compare-ignores-tolerances", "traintape/analysis/compare.py",
      "        tols[k] = v if isinstance(v, Tolerance) else Tolerance(**{**tols[k].model_dump(), **v})",
      "        pass",
      (ESC,), "compare", "compare ignores tolerances="),
    M("compare-either-side-nan", "traintape/analysis/compare.py",
      "present = ~(np.isnan(A).all(axis=2) & np.isnan(B).all(axis=2))",
      "present = ~(np.isnan(A).all(axis=2) | np.isnan(B).all(axis=2))",
      (ESC,), "compare", "compare drops a row when either side is all-NaN"),
    M("anomalies-block-offset", "traintape/analysis/_common.py",
      "            first[j] = start + r\n", "            first[j] = r\n",
      (ESC,), "nan", "first-NaN step loses its read-block offset"),
    M("validate-repeated-steps", "traintape/core/validate.py",
      "bad = np.flatnonzero(np.diff(steps) <= 0)", "bad = np.flatnonzero(np.diff(steps) < 0)",
      (ESC,), "validate", "validate accepts repeated steps"),
    M("shard-no-fsync", "traintape/core/writer.py",
      "            try:\n                os.fsync(fd)\n", "            try:\n                pass\n",
      ("tests/test_durability.py",), None, "snapshot shard not fsynced before its rename"),
    # ------------------------------------------------ conformance (shared statistics)
    M("std-sample", SCHEMA,
      "lambda r: _unscale(np.sqrt(_ratio(np.maximum(r.m2, 0.0), r.nfinite)), r),",
      "lambda r: _unscale(np.sqrt(_ratio(np.maximum(r.m2, 0.0), r.nfinite - 1)), r),",
      (ANCHOR,), "itself", "std with n-1 (every framework equally wrong)"),
    M("nan-count-zero", SCHEMA,
      'Stat("nan_count", "number of NaN elements", lambda r: r.nan, None),',
      'Stat("nan_count", "number of NaN elements", lambda r: r.nan * 0, None),',
      (ANCHOR,), "itself", "nan_count forced to 0 (every framework equally wrong)"),
    # ------------------------------------------------ schema: the stat algebra
    M("inf-count-sign", SCHEMA,
      "lambda r: r.numel - r.nfinite - r.nan, None)", "lambda r: r.numel - r.nfinite + r.nan, None)",
      (REF,), "host", "inf_count adds NaNs"),
    M("abs-mean-over-numel", SCHEMA,
      "lambda r: _unscale(_ratio(r.abs_sum, r.nfinite), r),",
      "lambda r: _unscale(_ratio(r.abs_sum, r.numel), r),",
      (REF,), "host", "abs_mean over all elements, not the finite ones"),
    M("zero-frac-over-nfinite", SCHEMA,
      "_ratio(r.zeros, r.numel), np.nan)", "_ratio(r.zeros, r.nfinite), np.nan)",
      (REF,), "host", "zero_frac over the finite elements"),
    M("l2-no-sqrt", SCHEMA,
      "lambda r: _unscale(np.sqrt(r.sumsq), r), 0.0)", "lambda r: _unscale(r.sumsq, r), 0.0)",
      (REF,), "host", "l2 without the square root"),
    M("merge-min-as-max", SCHEMA,
      "            cols.append(xp.minimum(ai, bi))", "            cols.append(xp.maximum(ai, bi))",
      (REF,), "merged", "merge takes the larger minimum"),
    M("chan-no-cross", SCHEMA,
      "cols.append(ai + bi + xp.where((na > 0) & (nb > 0), cross, 0.0))",
      "cols.append(ai + bi)", (REF,), "merged", "Chan's merge without the means' spread"),
    M("sig-sign-bit", SCHEMA,
      "return np.where(h >> np.uint32(31), -1.0, 1.0)", "return np.where(h >> np.uint32(30) & np.uint32(1), -1.0, 1.0)",
      (REF,), "numpy", "sig pattern from the wrong hash bit (numpy backend)"),
    M("ref-nan-as-zero", SCHEMA,
      '"nan": np.add.reduceat(np.isnan(x), starts, dtype=np.float64),',
      '"nan": np.add.reduceat(np.isinf(x), starts, dtype=np.float64),',
      (REF,), "numpy", "numpy backend counts Inf as NaN"),
    M("merge-exp-min", SCHEMA,
      "e = xp.maximum(xp.where(na > 0, ea, eb), xp.where(nb > 0, eb, ea))",
      "e = xp.minimum(xp.where(na > 0, ea, eb), xp.where(nb > 0, eb, ea))",
      ("tests/test_stat_algebra.py",), None, "merge rescales to the smaller exponent"),
    M("zeros-merge-max", SCHEMA,
      'RawField("zeros", Merge.ADD,', 'RawField("zeros", Merge.MAX,',
      (REF,), "merged and host", "zero counts of parts merged with max"),
    M("numel-merge-max", SCHEMA,
      'RawField("numel", Merge.ADD,', 'RawField("numel", Merge.MAX,',
      (REF,), "merged and host", "element counts of parts merged with max"),
    # ------------------------------------------------ torch ops
    M("torch-pattern-constant", TORCH,
      "h = (h * 0x85EBCA6B) & _M32", "h = (h * 0x85EBCA6C) & _M32",
      (REF,), "torch", "torch ops: sig pattern from a wrong hash constant"),
    M("torch-small-sig-unsigned", TORCH,
      "sig=seg(xz * torch.cat([p.signs() for p in pats])),", "sig=seg(xz),",
      (REF,), "torch", "torch ops: small tensors' sig without the sign pattern"),
    M("torch-small-min-max", TORCH,
      'min=seg(torch.where(fin, flat, float("inf")), "min"),',
      'min=seg(torch.where(fin, flat, float("inf")), "max"),',
      (REF,), "torch", "torch ops: small-tensor min is the max"),
    M("torch-small-nan-isinf", TORCH,
      "nan=seg(torch.isnan(flat).to(torch.float64)),", "nan=seg(torch.isinf(flat).to(torch.float64)),",
      (REF,), "torch", "torch ops: NaN count counts Inf"),
    M("torch-masked-zeros", TORCH,
      "zeros=(x == 0).sum().to(torch.float64),", "zeros=(xz == 0).sum().to(torch.float64),",
      (REF,), "torch", "torch ops: masked path counts non-finite as zeros"),
    M("torch-onepass-m2", TORCH,
      "m2 = (sumsq - s * s / n).clamp(min=0.0)", "m2 = sumsq.clamp(min=0.0)",
      (REF,), "torch", "torch ops: m2 without the mean term"),
    M("torch-no-masked-fallback", TORCH,
      "    if bool(bad.any()):  # rare", "    if False:  # rare",
      (REF,), "torch", "torch ops: NaN/Inf in a large tensor not recomputed masked"),
    # ------------------------------------------------ XLA reductions
    M("xla-fast-abs", JAXS,
      "lambda v: jnp.sum(jnp.abs(v)),", "lambda v: jnp.abs(jnp.sum(v)),",
      (REF,), "xla", "XLA: |sum x| for sum |x|"),
    M("xla-masked-zeros", JAXS,
      "zeros = jnp.sum(x == 0, dtype=jnp.int32)", "zeros = jnp.sum(x == 1, dtype=jnp.int32)",
      (REF,), "xla", "XLA masked path: zero count wrong"),
    M("xla-masked-nan", JAXS,
      "nnan = jnp.sum(jnp.isnan(x), dtype=jnp.int32)", "nnan = jnp.int32(0)",
      (REF,), "xla", "XLA masked path: NaN count 0"),
    M("xla-m2", JAXS,
      '"m2": jnp.maximum(s2 - s * (s / safe), 0.0),', '"m2": jnp.maximum(s2, 0.0),',
      (REF,), "xla", "XLA: m2 without the shift correction"),
    # ------------------------------------------------ TF ops
    M("tf-fast-abs", TFS,
      "asum = tf.cast(tf.reduce_sum(tf.abs(x)), tf.float64)", "asum = tf.cast(tf.abs(tf.reduce_sum(x)), tf.float64)",
      (REF,), "tf", "TF: |sum x| for sum |x| (large tensors)"),
    M("tf-segment-zeros", TFS,
      "zeros=seg(tf.cast(tf.equal(x, 0), dt)),", "zeros=seg(tf.cast(tf.equal(xz, 0), dt)),",
      (REF,), "tf", "TF segment path: non-finite counted as zeros"),
    M("tf-raw-nan", TFS,
      "nan=tf.reduce_sum(tf.cast(tf.math.is_nan(x), dt)),", "nan=tf.reduce_sum(tf.cast(tf.math.is_inf(x), dt)),",
      (REF,), "tf", "TF masked path: NaN count counts Inf"),
    M("tf-fast-zeros", TFS,
      "zeros=n - nonzero,", "zeros=n * 0,",
      (REF,), "tf", "TF fast path: zero count 0"),
    # ------------------------------------------------ core
    M("check-step-negative", "traintape/core/inputs.py",
      "    if s < 0 or s > MAX_STEP:", "    if s > MAX_STEP:",
      ("tests/test_record_input.py", "tests/test_store.py"), None, "negative steps accepted"),
    M("validate-negative", "traintape/core/validate.py",
      "        if (steps < 0).any():", "        if (steps < -1).any():",
      (ESC,), "validate", "validate accepts step -1"),
    M("shard-no-dir-fsync", "traintape/core/writer.py",
      "            try:\n                os.fsync(d)\n", "            try:\n                pass\n",
      ("tests/test_durability.py",), None, "directory not fsynced after the shard rename"),
    M("shard-no-rename", "traintape/core/writer.py",
      "            os.replace(tmp, path)\n", "            os.link(tmp, path)\n",
      ("tests/test_durability.py", "tests/test_snapshot_stream.py"), None,
      "shard published by a hard link (the temporary never renamed)"),
    M("validate-commit-last-step", "traintape/core/validate.py",
      "        if int(steps[-1]) != self.m.commit.last_step:", "        if False:",
      (ESC,), "validate",
      "validate ignores a commit mark whose last step disagrees"),
    # ------------------------------------------------ analysis
    M("close-rtol-of-a", "traintape/analysis/compare.py",
      "ok = np.abs(a - b) <= atol + tol.rtol * np.abs(b)", "ok = np.abs(a - b) <= atol + tol.rtol * np.abs(b) + 1.0",
      ("tests/test_compare.py", ESC), None, "compare adds a unit of slack"),
    M("close-nonfinite-any", "traintape/analysis/compare.py",
      "same_nonfinite = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))",
      "same_nonfinite = np.isnan(a) | np.isnan(b) | (np.isinf(a) & (a == b))",
      (ESC,), "compare", "compare treats NaN on one side as agreement"),
    M("compare-atol-ignored", "traintape/analysis/compare.py",
      "        if atol is not None:\n            tols[k].atol = atol", "        if False:\n            tols[k].atol = atol",
      (ESC,), "compare", "compare ignores atol="),
    M("anomalies-first-nan-count", "traintape/analysis/_common.py",
      "        count += bad.sum(axis=0)", "        count += bad.any(axis=0)",
      (ESC,), "nan", "first-NaN reducer counts blocks, not steps"),
    M("health-exploding-threshold", "traintape/analysis/health.py",
      "            if lh.grad_norm > th.exploding_norm or gmax > th.exploding_norm:",
      "            if lh.grad_norm > th.exploding_norm * 1e6:",
      ("tests/test_analysis_health.py",), None, "health misses exploding gradients"),
]  # fmt: skip


def _copy(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for d in ("traintape", "conformance", "tests"):
        shutil.copytree(ROOT / d, dst / d, ignore=ignore)
    for f in ("pyproject.toml", "setup.py"):
        if (ROOT / f).exists():
            shutil.copy2(ROOT / f, dst / f)


def run_one(m: Mutation, timeout: float) -> tuple[str, float, str]:
    """(outcome, seconds, tail of the test output) of mutation ``m``."""
    src = (ROOT / m.path).read_text()
    if src.count(m.old) != 1:
        return "stale", 0.0, f"{m.path}: snippet found {src.count(m.old)} times"
    with tempfile.TemporaryDirectory(prefix=f"mut-{m.id}-") as tmp:
        dst = Path(tmp)
        _copy(dst)
        (dst / m.path).write_text(src.replace(m.old, m.new))
        env = {**os.environ, **m.env, "PYTHONPATH": str(dst), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
        if m.k:
            cmd += ["-k", m.k]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=dst, env=env, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - t0, ""
        dt = time.perf_counter() - t0
        out = p.stdout.decode(errors="replace").strip().splitlines()
        tail = out[-1] if out else ""
        if p.returncode == 5:  # no tests collected: the mapping is wrong
            return "no-tests", dt, tail
        return ("caught" if p.returncode != 0 else "MISSED"), dt, tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutation ids")
    ap.add_argument("--limit", type=int, default=0, help="run at most this many")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutation")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    a = ap.parse_args(argv)
    todo = MUTATIONS
    if a.only:
        want = [s.strip() for s in a.only.split(",") if s.strip()]
        unknown = sorted(set(want) - {m.id for m in MUTATIONS})
        if unknown:
            ap.error(f"unknown mutation ids: {unknown}")
        todo = [m for m in MUTATIONS if m.id in want]
    if a.limit:
        todo = todo[: a.limit]
    if a.list:
        for m in todo:
            print(f"{m.id:28s} {m.path:38s} {m.why}")
        print(f"{len(todo)} mutations")
        return 0
    results = []
    for m in todo:
        outcome, dt, tail = run_one(m, a.timeout)
        results.append(outcome)
        print(f"{outcome:8s} {m.id:28s} {dt:6.1f}s  {m.why}  [{tail[:90]}]", flush=True)
    run = [r for r in results if r in ("caught", "MISSED", "timeout")]
    caught = results.count("caught")
    print(f"\nscore: {caught} / {len(run)} caught ({len(todo)} mutations selected, "
          f"{results.count('stale')} stale, {results.count('no-tests')} without tests)")  # fmt: skip
    return 0 if caught == len(run) and len(run) == len(todo) else 1


if __name__ == "__main__":
    sys.exit(main())
