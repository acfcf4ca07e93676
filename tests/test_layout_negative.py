"""Negative control for the layout signature: a transposed square kernel is caught by
``traintape.compare`` from stat vectors alone (no snapshots), naming the tensor and the
first step — and only ``sig`` can catch it.

The adapter's mapping of one square ``Linear`` forgets the (out, in) → (in, out)
transpose when *recording* (the model itself trains correctly): the recorded tensor is
the transposed canonical kernel, whose mean, std, min, max, l2, ... are exactly the
canonical one's, at every step, for params, grads and updates alike. A stats-only
store (the default policy) without ``sig`` would call the runs identical.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import traintape  # noqa: E402
import traintape.torch  # noqa: E402
from traintape.schema.stats import STAT_NAMES  # noqa: E402

SQUARE = "fc2/kernel"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)  # square: shapes cannot tell (in, out) from (out, in)
        self.fc3 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _train(url: str, steps: int = 3) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)) for _ in range(steps)
    ]
    with traintape.Recorder(url) as rec, traintape.torch.watch(model, rec, optimizer=opt):
        assert rec.policy.full_every is None  # stats only: no snapshots
        for x, y in data:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()


def test_transposed_square_kernel_is_caught_by_stats_alone(tmp_path, monkeypatch) -> None:
    good = str(tmp_path / "good")
    _train(good)

    mods = [importlib.import_module(f"traintape.adapters.torch.{m}") for m in ("names", "watch")]
    real = mods[0].model_layout

    def wrong_layout(*a, **k):
        lay = real(*a, **k)
        for e in lay.entries:
            if e.name == SQUARE:
                e.permutation = None  # records weight (out, in) as the (in, out) kernel
        return lay

    for mod in mods:
        monkeypatch.setattr(mod, "model_layout", wrong_layout)
    bad = str(tmp_path / "bad")
    _train(bad)

    ra, rb = traintape.open_run(good), traintape.open_run(bad)
    for r in (ra, rb):  # nothing but stat vectors to compare
        assert not any(r.manifest.commit.snapshots.values())
    rep = traintape.compare(good, bad)
    assert not rep.identical
    fd = rep.first_divergence
    assert (fd.tensor, fd.kind, fd.first_step_out, fd.first_out_via) == (SQUARE, "param", 0, "sig")
    for kind in ("param", "grad", "update"):
        d = rep.diff(SQUARE, kind)
        assert (d.first_step_out, d.first_out_via) == (0, "sig"), kind
    # everything else agrees: the other tensors, and every other statistic of this one
    others = [d for d in rep.tensors if not d.within]
    assert {d.tensor for d in others} == {SQUARE}
    keep = [i for i, n in enumerate(STAT_NAMES) if n != "sig"]
    for kind in ("param", "grad", "update"):
        i = ra.tensor_names(kind).index(SQUARE)
        a, b = ra.stats_array(kind)[:, i][:, keep], rb.stats_array(kind)[:, i][:, keep]
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # blind without sig
