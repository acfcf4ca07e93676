"""traintape.torch.watch: hooks, step semantics and recorded values."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import traintape  # noqa: E402
from traintape import CapturePolicy, Kind, Recorder  # noqa: E402
from traintape.core.stats import stat_vectors  # noqa: E402
from traintape.schema.stats import activation_map  # noqa: E402
from traintape.torch import to_canonical, watch  # noqa: E402

torch.set_num_threads(1)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.out(torch.tanh(self.fc(h.flatten(1))))


def batch(i: int, n: int = 6):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 2, 4, 4, generator=g), torch.randn(n, 2, generator=g)


def loss_of(model, i, n=6):
    x, y = batch(i, n)
    return ((model(x) - y) ** 2).mean()


def by_name(model, kind):
    from traintape.adapters.torch.names import model_layout

    return model_layout(model).by_name()


def canonical_grads(model):
    out = {}
    for e in by_name(model, Kind.GRAD).values():
        if e.trainable:
            out[e.name] = e.canonical(e.tensor().grad).detach().clone().numpy()
    return out


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_grads_params_updates_equal_torch(mem_url, opt_name):
    torch.manual_seed(0)
    model = ConvNet()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if opt_name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=1e-2)
    )
    want: dict[str, list[dict[str, np.ndarray]]] = {"param": [], "grad": [], "update": []}
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    with rec, watch(model, rec, optimizer=opt):
        for i in range(3):
            # θ_t: everything before batch t's forward pass (the forward updates the
            # BatchNorm running statistics in place; weights only change in opt.step())
            theta = to_canonical(model)
            want["param"].append(theta)
            opt.zero_grad()
            loss_of(model, i).backward()
            want["grad"].append(canonical_grads(model))
            opt.step()
            after = to_canonical(model)
            want["update"].append(
                {k: after[k] - theta[k] for k in want["grad"][-1]}  # trainable only
            )
    run = traintape.open_run(mem_url)
    assert list(run.steps) == [0, 1, 2]
    assert run.manifest.producer.framework == "torch"
    for kind in ("param", "grad", "update"):
        names = run.tensor_names(kind)
        assert sorted(names) == sorted(want[kind][0])
        stats = run.stats_array(kind)
        for t in range(3):
            ref = stat_vectors([want[kind][t][n] for n in names])
            np.testing.assert_allclose(stats[t], ref, rtol=2e-5, atol=1e-7)
            for n in names:
                got = run.snapshot(n, kind, t)
                if kind == "update":
                    np.testing.assert_allclose(got, want[kind][t][n], rtol=0, atol=1e-7)
                else:
                    np.testing.assert_array_equal(got, want[kind][t][n])
    assert "bn/running_mean" in run.tensor_names("param")
    assert "bn/running_mean" not in run.tensor_names("grad")
    spec = run.spec("conv/kernel", "grad")
    assert spec.source_name == "conv.weight" and spec.permutation == [2, 3, 1, 0]
    assert traintape.validate(mem_url).ok


def test_update_snapshot_is_exact_difference(mem_url):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    rec = Recorder(mem_url, CapturePolicy(full_every=1, kinds=(Kind.UPDATE,)))
    with rec, watch(model, rec, optimizer=opt):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        w0 = model.weight.detach().clone()
        opt.step()
        w1 = model.weight.detach().clone()
    got = traintape.open_run(mem_url).snapshot("kernel", "update", 0)
    np.testing.assert_array_equal(got, (w1 - w0).T.numpy())


def test_gradient_accumulation_four_micro_batches_is_one_step(mem_url):
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    with rec, watch(model, rec, optimizer=opt) as h:
        for step in range(2):
            opt.zero_grad()
            acts = []
            for mb in range(4):
                x, y = batch(10 * step + mb, 3)
                acts.append(model.conv(x).detach())
                ((model(x) - y) ** 2).mean().backward()
            assert h.micro_batches == 4
            grads = canonical_grads(model)
            opt.step()
            conv_out = torch.cat(acts).permute(0, 2, 3, 1).numpy()
    run = traintape.open_run(mem_url)
    assert list(run.steps) == [0, 1]
    names = run.tensor_names("grad")
    np.testing.assert_allclose(
        run.stats_array("grad")[1], stat_vectors([grads[n] for n in names]), rtol=2e-5, atol=1e-7
    )
    # activation stats are over all 4 micro-batches of the step (channels-last conv output)
    i = run.tensor_names("activation").index("conv/output")
    # the manual model.conv calls above also went through the hook: stats cover 8 batches
    np.testing.assert_allclose(
        run.stats_array("activation")[1, i],
        stat_vectors([a := np.concatenate([conv_out, conv_out])], maps=[activation_map(a.shape)])[
            0
        ],
        rtol=2e-5,
        atol=1e-6,
    )
    spec = run.spec("conv/output", "activation")
    assert spec.shape == [None, 4, 4, 3] and spec.permutation == [0, 2, 3, 1]


def hook_state(model, opt):
    mods = [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for m in model.modules()
    ]
    params = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    optim = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
    return mods, params, optim


def test_hooks_fully_removed_and_training_unchanged(mem_url):
    def train(watched: bool):
        torch.manual_seed(0)
        model = ConvNet()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        before = hook_state(model, opt)
        if watched:
            rec = Recorder(mem_url, CapturePolicy(full_every=2))
            with watch(model, rec, optimizer=opt) as h:
                assert hook_state(model, opt) != before
                for i in range(2):
                    opt.zero_grad()
                    loss_of(model, i).backward()
                    opt.step()
            assert h.step_index == 2
            assert hook_state(model, opt) == before
            rec.close()
        else:
            for i in range(2):
                opt.zero_grad()
                loss_of(model, i).backward()
                opt.step()
        for i in range(2, 4):  # after removal: plain training
            opt.zero_grad()
            loss_of(model, i).backward()
            opt.step()
        return model, opt

    m1, o1 = train(True)
    m2, o2 = train(False)
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    for k in s2:
        for f in s2[k]:
            assert torch.equal(s1[k][f], s2[k][f])
    x, _ = batch(9)
    assert torch.equal(m1(x), m2(x))


def test_nan_grads_are_counted_not_fatal(mem_url):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(mem_url)
    with rec, watch(model, rec, optimizer=opt):
        opt.zero_grad()
        x = torch.ones(2, 3)
        x[0, 0] = float("nan")
        model(x).sum().backward()
        g = model[0].weight.grad.T.clone().numpy()
        opt.step()
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    run = traintape.open_run(mem_url)
    assert list(run.steps) == [0, 1]
    names = run.tensor_names("grad")
    row = run.stats_array("grad")[0, names.index("0/kernel")]
    np.testing.assert_allclose(row, stat_vectors([g])[0], rtol=2e-5)
    assert row[7] == np.isnan(g).sum() > 0
    assert any(e.type == "nan" and e.kind == "grad" for e in run.events())


def test_frozen_params_recorded_as_param_only_and_no_optimizer_step(mem_url):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    model[0].weight.requires_grad_(False)
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    with rec, watch(model, rec) as h:
        for _ in range(2):
            theta = to_canonical(model)
            model(torch.randn(5, 3)).pow(2).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
            h.step()
            for p in model.parameters():
                p.grad = None
    run = traintape.open_run(mem_url)
    assert "0/kernel" in run.tensor_names("param")
    assert "0/kernel" not in run.tensor_names("grad")
    assert "0/kernel" not in run.tensor_names("update")
    np.testing.assert_array_equal(run.snapshot("1/scale", "param", 1), theta["1/scale"])
    after = to_canonical(model)
    np.testing.assert_allclose(
        run.snapshot("1/scale", "update", 1), after["1/scale"] - theta["1/scale"], atol=1e-7
    )
    assert run.spec("1/scale", "param").layer_kind == "layer_norm"


def test_probe_activation_snapshots_channels_last(mem_url):
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe, _ = batch(50, 2)
    rec = Recorder(mem_url, CapturePolicy(full_every=2, kinds=(Kind.ACTIVATION,)))
    with rec, watch(model, rec, optimizer=opt, probe=probe):
        for i in range(3):
            opt.zero_grad()
            if i == 2:
                model.eval()
                with torch.no_grad():
                    want = model.conv(probe).permute(0, 2, 3, 1).numpy()
                model.train()
            loss_of(model, i).backward()
            opt.step()
    run = traintape.open_run(mem_url)
    assert list(run.snapshot_steps("conv/output", "activation")) == [0, 2]
    np.testing.assert_array_equal(run.snapshot("conv/output", "activation", 2), want)
    assert run.snapshot("fc/output", "activation", 2).shape == (2, 5)
    assert traintape.validate(mem_url).ok


def test_policy_every_other_step_and_tied_weights(mem_url):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.embed(ids)))

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rec = Recorder(mem_url, CapturePolicy(every=2, full_every=2))
    grads = {}
    with rec, watch(model, rec, optimizer=opt) as h:
        for step in range(4):
            opt.zero_grad()
            model(torch.tensor([[1, 2, 3], [4, 5, 6]])).logsumexp(-1).sum().backward()
            grads[step] = model.embed.weight.grad.clone().numpy()
            opt.step()
        assert h.step_index == 4
    run = traintape.open_run(mem_url)
    assert list(run.steps) == [0, 2]
    assert run.tensor_names("grad") == ["embed/embedding"]
    assert run.spec("embed/embedding", "grad").aliases == ["head/kernel"]
    np.testing.assert_array_equal(run.snapshot("embed/embedding", "grad", 2), grads[2])
    assert sorted(run.tensor_names("activation")) == ["embed/output", "head/output"]


def test_bfloat16_model_records_and_validates(mem_url):
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    with rec, watch(model, rec, optimizer=opt):
        opt.zero_grad()
        model(torch.ones(4, 3, dtype=torch.bfloat16)).float().sum().backward()
        w = model.weight.detach().float().T.numpy()
        opt.step()
    run = traintape.open_run(mem_url)
    assert run.spec("kernel", "param").dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(run.snapshot("kernel", "param", 0), np.float32), w)
    assert traintape.validate(mem_url).ok


def test_batchnorm_buffers_and_probe_are_theta_t_with_optimizer_hooks(mem_url):
    """With optimizer hooks, step t's running statistics and probe activations are those
    *before* batch t's forward pass (read at the end of step t - 1), as with step()."""
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe, _ = batch(50, 2)
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    want_mean, want_var, want_bn = [], [], []
    with rec, watch(model, rec, optimizer=opt, probe=probe):
        for i in range(3):
            want_mean.append(model.bn.running_mean.clone().numpy())
            want_var.append(model.bn.running_var.clone().numpy())
            model.eval()
            with torch.no_grad():
                want_bn.append(model.bn(model.conv(probe)).permute(0, 2, 3, 1).numpy())
            model.train()
            opt.zero_grad()
            loss_of(model, i).backward()
            assert not np.array_equal(model.bn.running_mean.numpy(), want_mean[-1])
            opt.step()
    run = traintape.open_run(mem_url)
    for t in range(3):
        np.testing.assert_array_equal(run.snapshot("bn/running_mean", "param", t), want_mean[t])
        np.testing.assert_array_equal(run.snapshot("bn/running_var", "param", t), want_var[t])
        np.testing.assert_array_equal(run.snapshot("bn/output", "activation", t), want_bn[t])
    names = run.tensor_names("param")
    i = names.index("bn/running_mean")
    np.testing.assert_allclose(
        run.stats_array("param")[2, i], stat_vectors([want_mean[2]])[0], rtol=2e-5, atol=1e-7
    )
    assert traintape.validate(mem_url).ok


class OutOfOrder(nn.Module):
    """Attributes declared (and named) in an order unlike the forward order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.norm = nn.LayerNorm(4)
        self.body = nn.Linear(3, 4)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


@pytest.mark.parametrize("with_probe", [False, True])
def test_activations_declared_in_forward_order(mem_url, with_probe):
    torch.manual_seed(0)
    model = OutOfOrder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(mem_url, CapturePolicy(full_every=1))
    probe = torch.randn(2, 3) if with_probe else None
    with rec, watch(model, rec, optimizer=opt, probe=probe):
        opt.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
    run = traintape.open_run(mem_url)
    assert run.manifest.forward_order == ["body", "norm", "head"]
    assert run.tensor_names("activation") == ["body/output", "head/output", "norm/output"]
