"""Parameter change from snapshots and stats, and sparse-update quality (real JAX forward)."""

from __future__ import annotations

import numpy as np
import pytest
from _stores import stores  # noqa: F401
from _training import mlp_forward

import traintape
from traintape.analysis import change_from_stats, parameter_change, sparse_update_quality
from traintape.analysis.change import component_of
from traintape.schema import TensorSpec


def test_parameter_change_matches_snapshots(stores):  # noqa: F811
    run = traintape.open_run(stores["healthy"])
    pc = parameter_change(run)
    assert [(p.step_old, p.step_new) for p in pc.pairs] == [(0, 10), (10, 20), (20, 30)]
    p = pc.pairs[0]
    old = {n: run.snapshot(n, "param", 0).astype(np.float64) for n in run.tensor_names("param")}
    new = {n: run.snapshot(n, "param", 10).astype(np.float64) for n in run.tensor_names("param")}
    d = np.concatenate([(new[n] - old[n]).ravel() for n in old])
    o = np.concatenate([old[n].ravel() for n in old])
    assert p.total.numel == d.size
    assert p.total.l2 == pytest.approx(np.linalg.norm(d))
    assert p.total.l1 == pytest.approx(np.abs(d).sum())
    assert p.total.max == pytest.approx(np.abs(d).max())
    assert p.total.relative == pytest.approx(np.linalg.norm(d) / np.linalg.norm(o))
    assert p.total.sparsity["0.0001"] == pytest.approx(np.mean(np.abs(d) <= 1e-4))
    k = p.per_tensor["layers/0/kernel"]
    dk = new["layers/0/kernel"] - old["layers/0/kernel"]
    assert k.l2 == pytest.approx(np.linalg.norm(dk))
    assert set(p.per_layer) == {"layers/0", "layers/1", "layers/2"}
    assert set(p.per_component) == {"mlp"}


def test_change_from_stats_is_update_over_param(stores):  # noqa: F811
    run = traintape.open_run(stores["healthy"])
    _, layers, r = change_from_stats(run)
    u = run.stats_array("update")[:, :, 4]
    p = run.stats_array("param")[:, :, 4]
    names = run.tensor_names("param")
    idx = [i for i, n in enumerate(names) if n.startswith("layers/2/")]
    want = np.sqrt((u[:, idx] ** 2).sum(1)) / np.sqrt((p[:, idx] ** 2).sum(1))
    np.testing.assert_allclose(r[:, layers.index("layers/2")], want)


def test_components():
    def spec(name, **kw):
        layer, role = name.rsplit("/", 1)
        return TensorSpec(name=name, kind="param", role=role, layer=layer, dtype="float32",
                          shape=[2], **kw)  # fmt: skip

    assert component_of(spec("blocks/0/attn/q/kernel")) == "attention/q"
    assert component_of(spec("embed/embedding")) == "embedding"
    assert component_of(spec("blocks/0/ln1/scale", layer_kind="layer_norm")) == "norm"
    assert component_of(spec("blocks/0/mlp/fc1/kernel", layer_kind="dense")) == "mlp"


def test_sparse_update_quality_magnitude_beats_random(stores):  # noqa: F811
    run = traintape.open_run(stores["healthy"])
    names = run.tensor_names("param")
    old = {n: run.snapshot(n, "param", 0) for n in names}
    new = {n: run.snapshot(n, "param", 30) for n in names}
    delta = {n: new[n] - old[n] for n in names}
    x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)

    def fwd(p, inputs):
        return mlp_forward(p, inputs, "tanh")[0]

    q = sparse_update_quality(fwd, old, delta, x, thresholds=(1e-8, 1e-2))
    mag = {r.threshold: r for r in q.results if r.variant == "magnitude"}
    rnd = {r.threshold: r for r in q.results if r.variant == "random"}
    assert mag[1e-8].kept == 1.0 and mag[1e-8].mse == 0.0 and mag[1e-8].top1 == 1.0
    assert 0 < mag[1e-2].kept < 1
    assert rnd[1e-2].kept == pytest.approx(mag[1e-2].kept)
    assert mag[1e-2].mse < rnd[1e-2].mse
    assert mag[1e-2].kl <= rnd[1e-2].kl
    assert q.baseline.mse > mag[1e-2].mse


def test_sparse_update_quality_torch_module():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    old = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
    rng = np.random.default_rng(1)
    delta = {k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in old.items()}
    x = torch.randn(16, 4)
    from traintape.torch import as_forward

    q = sparse_update_quality(as_forward(model), old, delta, x, thresholds=(0.0,))
    assert q.results[0].kept == pytest.approx(1.0, abs=1e-3)
    assert q.results[0].cosine == pytest.approx(1.0)
    assert q.baseline.mse > 0
