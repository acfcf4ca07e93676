"""Frozen parameters (requires_grad=False, e.g. a LoRA base model) are read at the first
recorded step and on full-capture steps only (``frozen="full"``, the default): rows in
between are NaN ("not recorded"); ``frozen="every"`` reads them every captured step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import traintape
import traintape.torch as tt


def _run(url: str, **kw) -> traintape.Run:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)  # the frozen "base"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with (
        traintape.Recorder(url, traintape.CapturePolicy(full_every=3)) as rec,
        tt.watch(model, rec, optimizer=opt, **kw),
    ):
        for t in range(6):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(t))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return traintape.open_run(url)


def test_frozen_params_are_read_on_full_steps_only(tmp_path):
    run = _run(str(tmp_path / "full"))
    names = run.tensor_names("param")
    stats = run.stats_array("param")
    l2 = stats[:, :, run.manifest.stat_names.index("l2")]
    frozen = [names.index("0/kernel"), names.index("0/bias")]
    trained = [names.index("2/kernel"), names.index("2/bias")]
    assert np.isfinite(l2[:, trained]).all()  # trainable: every step
    for t in range(6):
        read = t in (0, 3)  # the first step and the full-capture steps
        assert np.isfinite(l2[t, frozen]).all() == read, t
        assert np.isnan(stats[t][frozen]).all() != read, t  # all-NaN: not recorded
    # the frozen values, when read, are the module's own (unchanged) weights
    torch.manual_seed(0)
    w = torch.nn.Linear(4, 8)  # model[0] as built
    assert l2[3, names.index("0/kernel")] == pytest.approx(float(w.weight.double().norm()))
    assert list(run.snapshot_steps("0/kernel", "param")) == [0, 3]
    assert "0/kernel" not in run.tensor_names("grad")
    assert traintape.validate(str(tmp_path / "full")).ok
    long = run.stats("param")  # the long table drops rows that were not recorded
    assert sorted(long[long.tensor == "0/kernel"].step) == [0, 3]


def test_frozen_every_reads_them_every_step(tmp_path):
    run = _run(str(tmp_path / "every"), frozen="every")
    assert np.isfinite(run.stats_array("param")[:, :, run.manifest.stat_names.index("l2")]).all()


def test_bad_frozen_option_is_refused(tmp_path):
    with traintape.Recorder(str(tmp_path / "r")) as rec, pytest.raises(ValueError, match="frozen"):
        tt.watch(torch.nn.Linear(2, 2), rec, frozen="sometimes")
