"""Anomaly detection on real (tiny) JAX trainings and on hand-made series."""

from __future__ import annotations

import numpy as np
from _stores import NAN_STEP, NAN_TENSOR, stores  # noqa: F401

import traintape
from traintape.analysis import anomalies
from traintape.analysis._common import robust_z


def test_nan_injected_reports_step_and_tensor_first(stores):  # noqa: F811
    rep = anomalies(traintape.open_run(stores["nan"]))
    first = rep.first_nonfinite
    assert first is not None
    assert (first.step, first.tensor, first.kind) == (NAN_STEP, NAN_TENSOR, "param")
    nan = rep.of_type("nan")
    assert nan[0] == first
    assert all(a.step >= NAN_STEP for a in nan)
    # gradients of earlier layers also went NaN at that step, but come after the param
    assert any(a.kind == "grad" and a.tensor == "layers/0/kernel" for a in nan)


def test_dead_units_from_activation_zero_fraction(stores):  # noqa: F811
    rep = anomalies(traintape.open_run(stores["dead"]))
    dead = [a for a in rep.of_type("dead_units") if a.layer == "layers/1"]
    assert dead and dead[0].severity == "error"
    assert dead[0].evidence["dead_unit_frac"] == 1.0  # from the activation snapshots


def test_healthy_run_has_no_errors(stores):  # noqa: F811
    rep = anomalies(traintape.open_run(stores["healthy"]))
    assert rep.first_nonfinite is None
    assert not [a for a in rep.anomalies if a.severity == "error"]


def test_loss_spike_and_stall(tmp_path):
    rng = np.random.default_rng(0)
    loss = 1.0 + 0.01 * rng.standard_normal(60)
    loss[40] = 5.0
    with traintape.Recorder(str(tmp_path / "a")) as rec:
        for t, v in enumerate(loss):
            rec.log(t, loss=float(v))
    rep = anomalies(traintape.open_run(str(tmp_path / "a")))
    spikes = rep.of_type("loss_spike")
    assert [a.step for a in spikes] == [40]
    assert spikes[0].evidence["z"] > 6
    with traintape.Recorder(str(tmp_path / "b")) as rec:
        for t in range(40):
            rec.log(t, loss=0.5 + 1e-7 * t)
    assert anomalies(traintape.open_run(str(tmp_path / "b"))).of_type("stalled")


def test_robust_z_ignores_smooth_decrease():
    x = np.exp(-np.arange(100) / 30)
    z = robust_z(x, 20)
    assert np.nanmax(np.abs(z)) < 6


def test_root_level_tensor_has_layer_empty_and_stats_by_name(tmp_path):
    """A tensor at the root (``scale``) belongs to layer '' (as ``split_name`` says);
    stat columns are looked up by the store's own stat names."""
    import pytest

    from traintape.analysis._common import layer_of, stat_index

    url = str(tmp_path / "root")
    with traintape.Recorder(url) as rec:
        for t in range(6):
            v = np.ones(4, np.float32) if t != 3 else np.array([1, np.nan, 1, 1], np.float32)
            rec.record(t, "param", {"scale": v, "net/0/kernel": np.ones((2, 2), np.float32)})
    run = traintape.open_run(url)
    assert layer_of("scale") == "" and layer_of("net/0/kernel") == "net/0"
    nan = anomalies(run).of_type("nan")
    assert [(a.step, a.tensor, a.layer) for a in nan] == [(3, "scale", "")]
    assert stat_index(run, "l2") == run.manifest.stat_names.index("l2")
    with pytest.raises(KeyError, match="no statistic 'kurtosis'"):
        stat_index(run, "kurtosis")


def _loss_run(path, loss) -> traintape.Run:
    with traintape.Recorder(str(path)) as rec:
        for t, v in enumerate(loss):
            rec.log(t, loss=float(v))
    return traintape.open_run(str(path))


def test_a_spike_the_loss_recovers_from_is_info_one_it_stays_up_after_is_a_warning(tmp_path):
    rng = np.random.default_rng(1)
    loss = 1.0 + 0.01 * rng.standard_normal(80)
    loss[:10] = 3.0  # an earlier, higher level: the spike climbs back to it
    once = loss.copy()
    once[50] = 2.5  # one hard batch
    (spike,) = anomalies(_loss_run(tmp_path / "once", once)).of_type("loss_spike")
    assert (spike.step, spike.severity) == (50, "info")
    stays = loss.copy()
    stays[50:] = 2.5  # the loss jumps and stays up
    warn = [a for a in anomalies(_loss_run(tmp_path / "stays", stays)).of_type("loss_spike")
            if a.severity == "warning"]  # fmt: skip
    assert warn and warn[0].step == 50


def test_a_stall_far_above_the_start_is_a_warning_a_converged_plateau_is_info(tmp_path):
    flat = np.full(40, 0.7)
    (st,) = anomalies(_loss_run(tmp_path / "flat", flat)).of_type("stalled")
    assert st.severity == "warning"
    converged = np.concatenate([np.linspace(0.8, 0.004, 40), np.full(40, 0.0035)])
    (st,) = anomalies(_loss_run(tmp_path / "conv", converged)).of_type("stalled")
    assert st.severity == "info"
