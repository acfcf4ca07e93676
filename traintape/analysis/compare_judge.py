"""Judging stat vectors and snapshots of one tensor against per-step tolerances.

:class:`Judge` accumulates, for one (tensor, kind), the largest differences over the
blocks of steps it is handed, each named by the statistic behind it, and the first step
at which the tensor leaves tolerance. Statistics are judged by what they are:

- **data-unit** (``mean``, ``std``, ``min``, ``max``, ``l2``, ``abs_mean``, and any
  statistic not listed below): ``|a − b| <= atol + rtol·|b|``;
- **scale-free** (``sig``, ``zero_frac``): only where the tensor is above its noise
  floor in at least one run — ``sig`` (a signed sum over ``l2``: its error is the data's
  relative error) to ``atol/l2 + rtol + rtol·|b|``, ``zero_frac`` to
  ``max(1, rtol·numel)/numel + rtol`` (one element may flip to or from zero);
- **counts** (``nan_count``, ``inf_count``): exactly.

A tensor within noise in both runs at a step is judged on its counts only. NaN agrees
with NaN and ±Inf with the same Inf. Relative errors are reported only where the
relative part of the tolerance is at least its absolute part (``rtol·|b| >= atol``):
elsewhere ``|a − b|/|b|`` measures nothing (``b`` is within the absolute tolerance of 0).
"""

from __future__ import annotations

import numpy as np

from traintape.analysis.compare_models import TensorDiff

DATA_STATS = frozenset({"mean", "std", "min", "max", "l2", "abs_mean"})
SCALE_FREE = frozenset({"sig", "zero_frac"})
"""Statistics normalised by the tensor's own scale: random for a tensor of pure noise."""
COUNTS = frozenset({"nan_count", "inf_count"})
_PRIORITY = {"nan_count": 0, "inf_count": 1, "l2": 2, "mean": 3, "std": 4, "abs_mean": 5,
             "min": 6, "max": 7, "sig": 8, "zero_frac": 9}  # fmt: skip
"""Which statistic names a step's difference when several leave tolerance at once."""


def stat_tolerances(
    labels: list[str],
    b: np.ndarray,
    l2_ref: np.ndarray,
    atol: np.ndarray,
    rtol: np.ndarray,
    numel: np.ndarray,
) -> np.ndarray:
    """Allowed |a − b| per entry: ``b`` [n, T, S] (run B's stats, labels name S),
    ``l2_ref`` [n, T] the larger l2 of the two runs, ``atol`` [n, T], ``rtol`` [n],
    ``numel`` [T] (NaN where unknown)."""
    r = rtol[:, None]
    tol = np.empty(b.shape, dtype=np.float64)
    with np.errstate(all="ignore"):
        for j, name in enumerate(labels):
            bj = np.abs(b[..., j])
            if name in COUNTS:
                tol[..., j] = 0.5
            elif name == "sig":
                rel = np.where(l2_ref > 0, atol / l2_ref, np.inf)
                tol[..., j] = rel + r + r * bj
            elif name == "zero_frac":
                flips = np.maximum(1.0, r * numel[None, :]) / numel[None, :]
                tol[..., j] = np.where(np.isfinite(flips), flips, 0.0) + r
            else:
                tol[..., j] = atol + r * bj
    return tol


def judged_mask(labels: list[str], within_noise: np.ndarray) -> np.ndarray:
    """[n, T, S]: which stats are judged — counts always; the rest unless the tensor is
    within noise in both runs."""
    count = np.array([n in COUNTS for n in labels])
    return count[None, None, :] | ~within_noise[..., None]


class Judge:
    """Running comparison of one tensor of one kind (or one metric)."""

    def __init__(self, tensor: str, kind: str, atol: float, rtol: float) -> None:
        self.d = TensorDiff(tensor=tensor, kind=kind, atol=atol, rtol=rtol)

    def add(
        self,
        a: np.ndarray,
        b: np.ndarray,
        tol: np.ndarray,
        judged: np.ndarray,
        steps: np.ndarray,
        labels: list[str] | str,
        rtol: np.ndarray,
    ) -> None:
        """Rows ``a``, ``b``, ``tol``, ``judged`` [n, m] at ``steps`` [n]; ``labels`` name
        the m columns (stats, or ``snapshot`` for every element); ``rtol`` [n]."""
        same = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
        with np.errstate(all="ignore"):
            err = np.abs(a - b)
            bad = judged & ~same & ~(err <= tol)
            finite = judged & np.isfinite(a) & np.isfinite(b)
            err_f = np.where(finite, err, 0.0)
            meaningful = finite & (rtol[:, None] * np.abs(b) >= tol - rtol[:, None] * np.abs(b))
            rel = np.where(meaningful & (b != 0), err / np.abs(b), 0.0)
            ratio = np.where(
                finite & (tol > 0), err / tol, np.where(finite & (err > 0), np.inf, 0.0)
            )
        self._track(np.where(finite, err_f, -1.0), np.where(finite, rel, -1.0),
                    np.where(finite, ratio, -1.0), labels)  # fmt: skip
        rows = np.flatnonzero(bad.any(axis=1))
        if rows.size:
            r0 = int(rows[0])
            st = int(steps[r0])
            if self.d.first_step_out is None or st < self.d.first_step_out:
                cols = np.flatnonzero(bad[r0])
                col = int(min(cols, key=lambda c: _PRIORITY.get(_name(labels, int(c)), 10)))
                self.d.first_step_out = st
                self.d.first_out_via = _name(labels, col)
                self.d.first_out_a = _f(a[r0, col])
                self.d.first_out_b = _f(b[r0, col])
                self.d.first_out_tol = _f(tol[r0, col])
            self.d.within = False

    def _track(
        self, err: np.ndarray, rel: np.ndarray, ratio: np.ndarray, labels: list[str] | str
    ) -> None:
        """Largest values (entries not judged are -1 and never win)."""
        if not err.size or err.max() < 0:
            return
        i = np.unravel_index(int(np.argmax(err)), err.shape)
        if self.d.max_abs is None or err[i] > self.d.max_abs:
            self.d.max_abs, self.d.worst_stat = float(err[i]), _name(labels, int(i[1]))
        i = np.unravel_index(int(np.argmax(rel)), rel.shape)
        if self.d.max_rel is None or rel[i] > self.d.max_rel:
            self.d.max_rel, self.d.max_rel_stat = float(rel[i]), _name(labels, int(i[1]))
        i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        if self.d.max_tol_ratio is None or ratio[i] > self.d.max_tol_ratio:
            self.d.max_tol_ratio = _f(ratio[i])
            self.d.max_tol_ratio_stat = _name(labels, int(i[1]))


def _name(labels: list[str] | str, col: int) -> str:
    return labels if isinstance(labels, str) else labels[col]


def _f(v: float) -> float | None:
    v = float(v)
    return v if np.isfinite(v) else None
