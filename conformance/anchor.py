"""The conformance matrix's anchor outside traintape: "identical" must also mean "right".

Two frameworks whose statistics come from the same kernel and the same shared code are
equally wrong when that code is wrong, so comparing them with each other cannot see it.
Each cell therefore also checks one framework's store against float64 numpy computed
here (no traintape code) from that framework's own tensors:

- :func:`recorded_vs_snapshots`: at every step with a full snapshot, the recorded stat
  vector of each ``param``/``grad`` tensor against the statistics of the snapshot (the
  tensor itself, canonical layout), per tensor and per statistic with a tolerance
  relative to that tensor's own scale;
- :func:`planted_probe`: the same tensors with NaN, +Inf/-Inf and zeros planted in them,
  through the host stats path every CPU adapter shares (``traintape.core.stats``,
  finalized by ``traintape.schema.stats``), against the same reference — conformance
  runs train without non-finite values, so this is where a wrong ``nan_count`` or
  ``inf_count`` shows.

A problem is a line naming the kind, tensor, step and statistic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

KINDS = ("param", "grad")
RTOL = 1e-5
"""Relative to the tensor's own scale: float32 accumulation in the device paths is
~1e-6; a population/sample std mix-up is 1/(2n), 3% for a 16-element bias."""
_M = np.uint64(0xFFFFFFFF)


def _signs(n: int) -> np.ndarray:
    """The ``sig`` pattern of canonical flat indices 0..n-1 (spelled out here)."""
    h = np.arange(n, dtype=np.uint64) & _M
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _M
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _M
    return np.where(h >> np.uint64(31), -1.0, 1.0)


def reference(x: np.ndarray) -> tuple[dict[str, float], dict[str, float]]:
    """(stat vector by name, tolerance scale by name) of ``x`` in float64."""
    v = np.asarray(x).astype(np.float64).ravel()
    fin = np.isfinite(v)
    f = v[fin]
    l2 = float(np.sqrt(np.sum(f * f)))
    out = {
        "zero_frac": float(np.mean(v == 0)) if v.size else np.nan,
        "nan_count": float(np.isnan(v).sum()),
        "inf_count": float(np.isinf(v).sum()),
        "l2": l2,
        "mean": np.nan, "std": np.nan, "min": np.nan, "max": np.nan, "abs_mean": np.nan,
        "sig": np.nan,
    }  # fmt: skip
    scale = {"mean": 0.0, "std": 0.0, "l2": l2, "abs_mean": 0.0, "sig": 0.0}
    if f.size:
        mean = float(np.mean(f))
        am = float(np.mean(np.abs(f)))
        out.update(
            mean=mean,
            std=float(np.sqrt(np.mean((f - mean) ** 2))),
            min=float(f.min()),
            max=float(f.max()),
            abs_mean=am,
            sig=float(np.sum(np.where(fin, v, 0.0) * _signs(v.size)) / l2) if l2 > 0 else 0.0,
        )
        big = float(np.max(np.abs(f)))
        scale.update(
            # min/max: within rtol of max|x| — a pre-clip grad's snapshot is the step's
            # clipped tensor divided by the clip factor, which rounds in the last bit
            min=big,
            max=big,
            mean=am,
            std=float(np.sqrt(np.mean(f * f))),
            abs_mean=am,
            sig=float(np.sum(np.abs(f))) / l2 if l2 > 0 else 0.0,
        )
    return out, scale


def mismatches(got: np.ndarray, names: list[str], x: np.ndarray, rtol: float = RTOL) -> list[str]:
    """``'stat: got g, want w'`` for each statistic of ``got`` (named by ``names``) that
    is not the reference of ``x``: counts and ``zero_frac`` exactly, the rest (``min`` and
    ``max`` included) within ``rtol`` of the tensor's scale."""
    want, scale = reference(x)
    bad = []
    for name, g in zip(names, np.asarray(got, dtype=np.float64), strict=True):
        if name not in want:
            continue
        w = want[name]
        if np.isnan(w) or np.isnan(g):
            ok = bool(np.isnan(w) and np.isnan(g))
        elif name in scale:
            ok = abs(g - w) <= rtol * scale[name] * (1 + 1e-12) + 1e-300
        else:
            ok = g == w
        if not ok:
            bad.append(f"{name}: got {g!r}, want {w!r}")
    return bad


def recorded_vs_snapshots(run: Any, label: str, limit: int = 20) -> list[str]:
    """Recorded stats of ``run`` (an open traintape run) against its snapshots."""
    problems: list[str] = []
    names = list(run.manifest.stat_names)
    steps = np.asarray(run.steps)
    checked = 0
    for kind in KINDS:
        if kind not in {k.value if hasattr(k, "value") else str(k) for k in run.kinds()}:
            continue
        tensors = run.tensor_names(kind)
        for t in tensors:
            for st in run.snapshot_steps(t, kind):
                row = int(np.searchsorted(steps, st))
                if row >= steps.size or steps[row] != st:
                    continue
                got = run.stats_array(kind, tensors=[t], rows=slice(row, row + 1))[0, 0]
                if np.all(np.isnan(got)):
                    continue
                x = run.snapshot(t, kind, int(st))
                checked += 1
                for m in mismatches(got, names, x):
                    problems.append(f"anchor {label}: {kind} {t} step {int(st)}: {m}")
    if checked == 0:
        problems.append(f"anchor {label}: no param/grad snapshot to check the stats against")
    return problems[:limit]


def planted_probe(run: Any, label: str, limit: int = 20) -> list[str]:
    """NaN, ±Inf and zeros planted in ``run``'s first param snapshots, through the
    shared host stats path, against the reference."""
    from traintape.core.stats import stat_vectors
    from traintape.schema.stats import STAT_NAMES

    arrays = []
    for t in run.tensor_names("param"):
        st = run.snapshot_steps(t, "param")
        if st.size == 0:
            continue
        x = np.array(run.snapshot(t, "param", int(st[0])), dtype=np.float64).ravel()
        if x.size < 4:
            continue
        x[0], x[x.size // 3], x[-1], x[x.size // 2] = np.nan, np.inf, -np.inf, 0.0
        arrays.append((t, x))
    got = stat_vectors([x for _, x in arrays])
    problems = [
        f"anchor {label}: planted NaN/Inf/zero in param {t}: {m}"
        for (t, x), g in zip(arrays, got, strict=True)
        for m in mismatches(g, list(STAT_NAMES), x, rtol=1e-9)
    ]
    if not arrays:
        problems.append(f"anchor {label}: no param snapshot to plant NaN/Inf in")
    return problems[:limit]


def anchor_problems(run: Any, label: str) -> list[str]:
    """Both checks of one framework's store (``label`` names it in the problems)."""
    return recorded_vs_snapshots(run, label) + planted_probe(run, label)
