"""``anomalies`` on a run longer than many read blocks (20,000 steps written with
``Recorder.record_stats``), with the planted events far from step 0: a NaN gradient, a
NaN a user logged, a metric logged only at the end (HF's ``train/total_flos``), and the
system metrics every run carries (issue 24, item 4)."""

from __future__ import annotations

import numpy as np

import traintape as tt
from traintape.analysis import anomalies
from traintape.analysis._common import StatsCache
from traintape.core.stats import stat_vector

STEPS = 20_000
NAN_GRAD_STEP = 13_301
NAN_METRIC_STEP = 17_002
TENSORS = ("dense/bias", "dense/kernel", "head/kernel")


def _record(url: str) -> None:
    rng = np.random.default_rng(0)
    # a few distinct stat vectors, reused: the test is about reading, not about stats
    pool = {n: [np.asarray(stat_vector(rng.standard_normal((8, 4)) * 0.01), np.float64)
                for _ in range(16)] for n in TENSORS}  # fmt: skip
    bad = np.asarray(stat_vector(np.where(np.eye(8, 4) > 0, np.nan, 0.01)), np.float64)
    pol = tt.CapturePolicy(kinds=("grad",), full_every=10**9)
    with tt.Recorder(url, pol) as rec:
        rec.declare(
            [tt.TensorSpec.build(n, "grad", dtype="float32", shape=[8, 4]) for n in TENSORS]
        )
        for t in range(STEPS):
            vecs = {n: pool[n][t % 16] for n in TENSORS}
            if t == NAN_GRAD_STEP:
                vecs["dense/kernel"] = bad
            rec.record_stats(t, "grad", vecs)
            metrics = {"loss": 1.0 / (1 + t / 1000) + 0.01 * rng.standard_normal()}
            if t % 100 == 0:
                metrics["val/loss"] = float("nan") if t == NAN_METRIC_STEP - 2 else 0.9
            if t == NAN_METRIC_STEP:
                metrics["val/acc"] = float("nan")
            if t == STEPS - 1:
                metrics["train/total_flos"] = 1.2e15  # logged once, at the end
            rec.log(t, **metrics)


def test_long_run_reports_only_what_was_recorded_non_finite(tmp_path):
    url = str(tmp_path / "long")
    _record(url)
    run = tt.open_run(url)
    assert run.rows == STEPS
    cache = StatsCache(run)
    assert cache.rows_per_block("grad") * 4 < STEPS  # the run spans several read blocks
    rep = anomalies(run)
    errors = [a for a in rep.anomalies if a.severity == "error"]
    where = {(a.type, a.step, a.tensor) for a in errors}
    assert ("nan", NAN_GRAD_STEP, "dense/kernel") in where
    assert ("nan", NAN_METRIC_STEP - 2, "metric:val/loss") in where
    assert ("nan", NAN_METRIC_STEP, "metric:val/acc") in where
    assert len(errors) == 3, [a.message for a in errors]
    # a metric not logged at a step is missing, not NaN; system metrics are never errors
    assert not any("total_flos" in (a.tensor or "") for a in rep.anomalies)
    assert not any("sys/" in (a.tensor or "") + a.message for a in rep.anomalies)
    assert rep.first_nonfinite is not None and rep.first_nonfinite.step == NAN_GRAD_STEP
    # the loss is logged every step: its smooth decrease is no spike or stall
    assert not [a for a in rep.anomalies if a.severity == "warning"]


def test_report_lists_one_point_metrics_instead_of_an_empty_chart(tmp_path):
    from traintape.analysis.report_figures import single_metrics
    from traintape.analysis.summary import summarize

    url = str(tmp_path / "short")
    with tt.Recorder(url) as rec:
        for t in range(30):
            rec.log(t, loss=1.0 / (1 + t))
        rec.log(29, **{"train/total_flos": 1.5e12})
    run = tt.open_run(url)
    assert single_metrics(run) == {"train/total_flos": (29, 1.5e12)}
    s = summarize(run)
    assert s.single_metrics == {"train/total_flos": (29, 1.5e12)}
    assert not [a for a in s.anomalies.anomalies if a.severity == "error"]
