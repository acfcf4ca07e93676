"""Sparse-update quality: masked updates vs the full one, from arrays and from runs."""

from __future__ import annotations

import numpy as np
import pytest
from _stores import stores  # noqa: F401

import traintape
from traintape.analysis import SparseUpdateQuality, sparse_update_from_run, sparse_update_quality

PROBE = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)


def tanh_mlp(p: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The forward of the ``healthy`` test store on canonical names (numpy)."""
    h = x
    for i in range(3):
        h = h @ p[f"layers/{i}/kernel"] + p[f"layers/{i}/bias"]
        h = np.tanh(h) if i < 2 else h
    return h


def test_docstring_example():
    def forward(p, x):
        return x @ p["w"]

    old = {"w": np.eye(4)}
    q = sparse_update_quality(forward, old, {"w": np.full((4, 4), 1e-3)}, np.eye(4))
    assert q.result("magnitude", 1e-4).kept == 1.0
    assert q.result("magnitude", 1e-4).kl == 0.0 and q.result("magnitude", 1e-4).top1 == 1.0
    q = sparse_update_quality(forward, old, {"w": np.full((4, 4), 1e-3)}, np.eye(4), (1e-2,))
    none = q.result("magnitude", 1e-2)
    assert none.kept == 0.0 and none.mse == pytest.approx(q.baseline.mse)


def test_from_run_matches_the_snapshots_and_magnitude_beats_random(stores):  # noqa: F811
    run = traintape.open_run(stores["healthy"])  # param snapshots at 0, 10, 20, 30
    thr = (1e-4, 1e-3, 1e-2)
    q = sparse_update_from_run(run, tanh_mlp, PROBE, thresholds=thr)
    assert (q.step_old, q.step_new, q.tensors) == (0, 30, 6) and q.url == run.url
    names = run.tensor_names("param")
    old = {n: run.snapshot(n, "param", 0) for n in names}
    delta = {n: run.snapshot(n, "param", 30).astype(np.float64) - old[n] for n in names}
    direct = sparse_update_quality(tanh_mlp, old, delta, PROBE, thr)
    assert direct.results == q.results and direct.baseline == q.baseline
    kept = [q.result("magnitude", t).kept for t in thr]
    assert kept == sorted(kept, reverse=True) and kept[-1] < 0.9
    for t in thr:  # the random control keeps as many entries
        assert q.result("random", t).kept == q.result("magnitude", t).kept
    # keeping the largest 70% of Δ does far better than a random 70%
    mag, rnd = q.result("magnitude", 1e-2), q.result("random", 1e-2)
    assert mag.kl < rnd.kl / 10 and mag.cosine > rnd.cosine and mag.top1 >= rnd.top1
    assert q.baseline.kl > mag.kl  # and far better than no update at all
    assert SparseUpdateQuality.model_validate_json(q.model_dump_json()) == q


def test_from_run_steps_and_errors(stores):  # noqa: F811
    run = traintape.open_run(stores["healthy"])
    q = sparse_update_from_run(run, tanh_mlp, PROBE, 10, 20, (1e-3,))
    assert (q.step_old, q.step_new) == (10, 20)
    with pytest.raises(ValueError, match="no param snapshot at step 5; snapshot steps: 0, 10"):
        sparse_update_from_run(run, tanh_mlp, PROBE, 5, 20)
    with pytest.raises(ValueError, match="two different steps"):
        sparse_update_from_run(run, tanh_mlp, PROBE, 10, 10)
    no_snaps = traintape.open_run(stores["sigmoid_deep"])
    with pytest.raises(ValueError, match="full_every"):
        sparse_update_from_run(no_snaps, tanh_mlp, PROBE)


def test_torch_module_gets_its_own_names_and_layouts(tmp_path):
    torch = pytest.importorskip("torch")
    import traintape.torch as ttorch

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.fc2 = torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.as_tensor(PROBE[:32])
    y = torch.tanh(x[:, :4])
    url = str(tmp_path / "torch")
    with traintape.Recorder(url, traintape.CapturePolicy(full_every=5)) as rec:
        for t in range(11):
            rec.record(t, "param", ttorch.to_canonical(net))
            opt.zero_grad()
            loss = torch.mean((net(x) - y) ** 2)
            loss.backward()
            opt.step()
            rec.log(t, loss=loss.item())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    run = traintape.open_run(url)
    with pytest.raises(TypeError, match="as_forward"):
        sparse_update_from_run(run, net, torch.as_tensor(PROBE))
    q = sparse_update_from_run(
        run, ttorch.as_forward(net), torch.as_tensor(PROBE), thresholds=(1e-3, 1e-2)
    )
    assert (q.step_old, q.step_new) == (0, 10)
    # the module's weights are restored
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())

    # the same numbers as a numpy forward on the canonical snapshots
    def canonical_forward(p, xx):
        h = np.tanh(xx @ p["fc1/kernel"] + p["fc1/bias"])
        return h @ p["fc2/kernel"] + p["fc2/bias"]

    ref = sparse_update_from_run(run, canonical_forward, PROBE, thresholds=(1e-3, 1e-2))
    for a, b in [(q.baseline, ref.baseline)] + [
        (q.result("magnitude", t), ref.result("magnitude", t)) for t in (1e-3, 1e-2)
    ]:
        assert a.kept == b.kept and a.top1 == b.top1
        assert a.cosine == pytest.approx(b.cosine, abs=1e-6)
        assert a.mse == pytest.approx(b.mse, rel=1e-3, abs=1e-10)
