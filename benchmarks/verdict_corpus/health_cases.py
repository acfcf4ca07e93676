"""The health half of the verdict corpus (issue 24): healthy trainings and planted
pathologies, judged by ``traintape.analysis.health`` and ``anomalies`` as the CLI's
``traintape health RUN`` / ``traintape anomalies RUN`` judge them (default thresholds).

- :data:`CASES` — every :class:`~verdict_corpus.health_case.HealthCase` (healthy ones from
  :mod:`.healthy`, pathologies from :mod:`.pathologies`); :func:`cases` the ``--quick``
  subset or all.
- :func:`record` — record a case's store once (reused while its marker file says it is
  complete and was recorded by the same code: ``benchmarks/verdicts.py --only health
  --workdir DIR`` run twice judges the second time without training); :func:`judge` — judge a recorded store, as often as wanted, optionally with
  other health/anomalies functions (a calibration loop passes its own).
- :func:`run` — record and judge every case; a :class:`~verdict_corpus.Section` with one
  :class:`~verdict_corpus.CaseResult` per case and the rates: false alarms (critical or
  warning) on healthy runs (target 0), pathologies detected with the right issue type
  (target >= 90%), and on the right layer (reported); also (reported) healthy runs
  with a critical or warning issue in ``traintape health --window 50``.

Verdict rules: a health issue counts when its severity is ``critical`` or ``warning``, an
anomaly when it is ``error`` or ``warning``; ``info`` never counts.
"""

from __future__ import annotations

import fnmatch
import hashlib
import inspect
import json
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import CaseResult, Rate, Section
from .health_case import ISSUE_TYPES, HealthCase
from .healthy import CASES as HEALTHY
from .pathologies import CASES as PATHOLOGIES

CASES: list[HealthCase] = [*HEALTHY, *PATHOLOGIES]
"""Every case, healthy first."""

TITLE = "health / anomalies"
_MARKER = ".recorded.json"
WINDOW = 50
"""Steps per window of the secondary measure ``traintape health --window 50`` on the
healthy runs (reported, no target: issue 24 asks for windows sized to the run)."""


def cases(quick: bool = False, names: Iterable[str] | None = None) -> list[HealthCase]:
    """The cases to run: those named (in corpus order), else the ``quick`` subset or all."""
    if names is not None:
        want = set(names)
        unknown = want - {c.name for c in CASES}
        if unknown:
            raise KeyError(f"unknown health case(s): {sorted(unknown)}")
        return [c for c in CASES if c.name in want]
    return [c for c in CASES if c.quick or not quick]


def fingerprint(case: HealthCase) -> str:
    """A hash of the code that records ``case``: its module's source and the torch loop's
    (a store recorded by other code is not reused)."""
    from . import torch_training

    src = inspect.getsource(inspect.getmodule(case.record)) + inspect.getsource(torch_training)
    return hashlib.sha256(f"{case.name}\n{src}".encode()).hexdigest()[:16]


def record(case: HealthCase, workdir: Path, *, reuse: bool = True) -> tuple[Path, float]:
    """Record ``case`` under ``workdir`` (or reuse the store recorded there before, when
    ``reuse`` and its marker ``<store>/.recorded.json`` names the same :func:`fingerprint`);
    returns the store's path and the seconds recording took (0 when reused)."""
    store = workdir / case.name
    marker = store / _MARKER
    fp = fingerprint(case)
    if reuse and marker.exists() and json.loads(marker.read_text()).get("fingerprint") == fp:
        return store, 0.0
    t0 = time.perf_counter()
    path = case.record(workdir)
    seconds = time.perf_counter() - t0
    (path / _MARKER).write_text(json.dumps({"case": case.name, "fingerprint": fp,
                                            "seconds": seconds}))  # fmt: skip
    return path, seconds


@dataclass
class Alarm:
    """One issue or anomaly that counts (warning or worse), flattened."""

    source: str  # "health" or "anomalies"
    type: str
    severity: str
    layer: str | None
    step: int | None
    message: str


def alarms(store: Path, health_fn: Callable[..., Any] | None = None,
           anomalies_fn: Callable[..., Any] | None = None) -> tuple[list[Alarm], Any, Any]:  # fmt: skip
    """Every health issue (critical/warning) and anomaly (error/warning) of the store;
    also the two reports. ``health_fn(run)`` / ``anomalies_fn(run)`` default to the
    library's ``health`` / ``anomalies``."""
    import traintape
    from traintape.analysis import anomalies, health

    run = traintape.open_run(str(store))
    rep = (health_fn or health)(run)
    an = (anomalies_fn or anomalies)(run)
    out = [
        Alarm("health", str(i.type), str(i.severity), i.layer, None, i.message)
        for i in rep.issues()
        if str(i.severity) in ("critical", "warning")
    ]
    out += [
        Alarm("anomalies", a.type, str(a.severity), a.layer or a.tensor, a.step, a.message)
        for a in an.anomalies
        if str(a.severity) in ("error", "warning")
    ]
    return out, rep, an


def window_alarms(store: Path, window: int = WINDOW,
                  trend_fn: Callable[..., Any] | None = None) -> list[Alarm]:  # fmt: skip
    """The critical/warning issues of ``health_trend(run, window)`` (what ``traintape
    health --window`` lists), run level and per layer."""
    import traintape
    from traintape.analysis import health_trend

    tr = (trend_fn or health_trend)(traintape.open_run(str(store)), window)
    issues = [*tr.run_issues, *(i for lt in tr.layers for i in lt.issues)]
    return [
        Alarm("health --window", str(i.type), str(i.severity), i.layer, i.first_step, i.message)
        for i in issues
        if str(i.severity) in ("critical", "warning")
    ]


_RANK = {"critical": 0, "error": 0, "warning": 1}


def _summary(found: list[Alarm]) -> str:
    """``worst severity: type×count, ...`` (most frequent type first)."""
    if not found:
        return "no alarms"
    worst = min(found, key=lambda a: _RANK.get(a.severity, 2)).severity
    c = Counter(f"{a.type}" for a in found)
    return worst + ": " + ", ".join(f"{t}×{n}" if n > 1 else t for t, n in c.most_common())


def _final_loss(store: Path) -> float | None:
    """Median of the last 10 finite logged losses (``loss``, or HF's ``train/loss``)."""
    import numpy as np

    import traintape

    met = traintape.open_run(str(store)).metrics()
    for col in ("loss", "train/loss"):
        if col in met.columns:
            v = met[col].to_numpy(dtype=np.float64)
            v = v[np.isfinite(v)]
            if len(v):
                return float(np.median(v[-10:]))
    return None


def _layer_matches(layer: str | None, globs: tuple[str, ...]) -> bool:
    if not globs:
        return True
    return layer is not None and any(fnmatch.fnmatchcase(layer, g) for g in globs)


def judge(
    case: HealthCase,
    store: Path,
    *,
    health_fn: Callable[..., Any] | None = None,
    anomalies_fn: Callable[..., Any] | None = None,
) -> CaseResult:
    """The verdict on one recorded case (see the module docstring)."""
    found, _rep, _an = alarms(store, health_fn, anomalies_fn)
    loss = _final_loss(store)
    notes = [f"final loss {loss:.3g}" if loss is not None else "no loss logged"]
    if case.max_final_loss is not None and (loss is None or loss > case.max_final_loss):
        notes.append(f"CORPUS: loss above {case.max_final_loss:g}, not a healthy training")
    if case.group == "healthy":
        ok = not found
        got = "healthy" if ok else _summary(found)
        if found:
            where = Counter(f"{a.type}@{a.layer}" for a in found)
            notes.append("alarms: " + ", ".join(f"{k}×{n}" if n > 1 else k
                                               for k, n in where.most_common(12)))  # fmt: skip
        return CaseResult(case.name, "healthy", case.frameworks, "no critical/warning", got,
                          ok, None, "; ".join(notes))  # fmt: skip
    accepted = case.accepted_types()
    right = [a for a in found if a.type in accepted]
    ok = bool(right)
    localised = any(
        _layer_matches(a.layer, case.layers) and (case.step is None or a.step == case.step)
        for a in right
    )
    expected = " | ".join(case.expect)
    if case.layers:
        expected += " on " + ",".join(case.layers)
    if case.step is not None:
        expected += f" at step {case.step}"
    if right:
        layers = sorted({str(a.layer) for a in right})
        steps = sorted({a.step for a in right if a.step is not None})
        got = _summary(right) + " on " + ",".join(layers[:6]) + ("…" if len(layers) > 6 else "")
        if steps:
            got += f" at step {steps[0]}"
    else:
        got = "missed (" + _summary(found) + ")"
    others = [a for a in found if a.type not in accepted]
    if others and right:
        notes.append("also: " + _summary(others))
    return CaseResult(case.name, "pathology", case.frameworks, expected, got, ok,
                      localised if ok else False, "; ".join(notes))  # fmt: skip


def rates(results: list[CaseResult], window_alarmed: int | None = None) -> list[Rate]:
    """The summary rows of the section; ``window_alarmed``: healthy runs with a critical or
    warning issue in ``health --window`` (:data:`WINDOW`), when measured."""
    healthy = [r for r in results if r.group == "healthy"]
    path = [r for r in results if r.group == "pathology"]
    false_alarms = sum(not r.ok for r in healthy)
    detected = sum(r.ok for r in path)
    localised = sum(bool(r.localised) for r in path)
    out = [
        Rate("critical or warning on healthy runs", false_alarms, len(healthy),
             f"0 of {len(healthy)}", false_alarms == 0),
        Rate("pathologies detected with the right issue type", detected, len(path),
             ">= 90%", bool(path) and detected >= 0.9 * len(path)),
        Rate("pathologies detected with the right issue type on the right layer",
             localised, len(path), "reported", True),
    ]  # fmt: skip
    if window_alarmed is not None:
        out.append(Rate(f"healthy runs with critical or warning in health --window {WINDOW}",
                        window_alarmed, len(healthy), "reported", True))  # fmt: skip
    return out


def run(quick: bool, workdir: Path, names: Iterable[str] | None = None) -> Section:
    """Record (once) and judge every case (``quick``: the subset); the section."""
    workdir.mkdir(parents=True, exist_ok=True)
    results: list[CaseResult] = []
    window_alarmed = 0
    for case in cases(quick, names):
        t0 = time.perf_counter()
        try:
            store, _ = record(case, workdir)
            res = judge(case, store)
            if case.group == "healthy":
                w = window_alarms(store)
                window_alarmed += bool(w)
                res.detail += f"; --window {WINDOW}: " + _summary(w)
        except Exception as e:  # a broken case is a wrong verdict, never a crash
            tb = traceback.format_exc(limit=3).replace("\n", " | ")
            res = CaseResult(case.name, case.group, case.frameworks, "", f"ERROR {e!r}",
                             False, None if case.group == "healthy" else False, tb)  # fmt: skip
        res.seconds = time.perf_counter() - t0
        results.append(res)
    return Section(TITLE, results, rates(results, window_alarmed))


__all__ = ["CASES", "ISSUE_TYPES", "TITLE", "WINDOW", "Alarm", "alarms", "cases",
           "fingerprint", "judge", "rates", "record", "run", "window_alarms"]  # fmt: skip
