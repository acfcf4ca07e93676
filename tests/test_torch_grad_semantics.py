"""torch ``watch`` records docs/store-format.md's ``grad`` (pre-clip, with the clip
factor as a metric) and ``update`` (as applied), checked against torch's own numbers:
``clip_grad_norm_``'s total norm, ``p.grad`` before clipping, θ_{t+1} − θ_t."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import traintape  # noqa: E402
import traintape.torch as tt  # noqa: E402
from traintape import CapturePolicy, Kind, Recorder, RecordError, open_run  # noqa: E402

STEPS = 4
MAX_NORM = 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _loss(m: torch.nn.Module, t: int, k: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + 10 * t + k)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    return ((m(x) - y) ** 2).mean()


def _norm_of(m: torch.nn.Module) -> float:
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters())))


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "grad_scaler"])
def test_grad_is_pre_clip_and_the_clip_factor_is_logged(tmp_path, amp: bool) -> None:
    """AdamW + clip_grad_norm_ (2 micro-batches; with AMP's GradScaler: unscale_ then
    clip): recorded grad == p.grad before clipping; its global l2 == the total norm
    clip_grad_norm_ returns; grad/clip_factor == the factor clip_grad_norm_ applied."""
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if amp else None
    url = str(tmp_path / "run")
    pre, totals, factors = [], [], []
    with Recorder(url, CapturePolicy(full_every=1)) as rec, tt.watch(m, rec, optimizer=opt):
        for t in range(STEPS):
            opt.zero_grad()
            for k in range(2):
                loss = _loss(m, t, k) / 2
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(opt)
            pre.append(m[0].weight.grad.detach().clone().numpy())
            before = _norm_of(m)
            totals.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)))
            factors.append(_norm_of(m) / before)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    run = open_run(url)
    assert run.steps.tolist() == list(range(STEPS))
    g = run.stats("grad")
    m_ = run.metrics()
    for t in range(STEPS):
        total = float(np.sqrt((g[g.step == t]["l2"] ** 2).sum()))
        np.testing.assert_allclose(total, totals[t], rtol=1e-6)
        assert factors[t] < 0.5  # clipping was on
        np.testing.assert_allclose(m_.loc[t, "grad/clip_factor"], factors[t], rtol=1e-6)
        np.testing.assert_allclose(run.snapshot("0/kernel", Kind.GRAD, t), pre[t].T, rtol=1e-6)


def test_no_clipping_no_metric_and_grads_are_p_grad(tmp_path) -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    url = str(tmp_path / "run")
    grads = []
    with Recorder(url, CapturePolicy(full_every=1)) as rec, tt.watch(m, rec, optimizer=opt):
        for t in range(2):
            opt.zero_grad()
            _loss(m, t).backward()
            grads.append(m[2].weight.grad.detach().clone().numpy())
            opt.step()
    run = open_run(url)
    assert "grad/clip_factor" not in run.metrics().columns
    for t in range(2):
        np.testing.assert_array_equal(run.snapshot("2/kernel", Kind.GRAD, t), grads[t].T)


def test_a_non_uniform_change_warns_and_keeps_the_backward_gradient(tmp_path) -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    url = str(tmp_path / "run")
    with Recorder(url, CapturePolicy(full_every=1)) as rec, tt.watch(m, rec, optimizer=opt):
        opt.zero_grad()
        _loss(m, 0).backward()
        pre = m[0].weight.grad.detach().clone().numpy()
        torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)
        with pytest.warns(RuntimeWarning, match="other than one common factor"):
            opt.step()
    run = open_run(url)
    assert "grad/clip_factor" not in run.metrics().columns
    got = run.stats("grad").set_index("tensor").loc["0/kernel", "l2"]
    np.testing.assert_allclose(got, np.linalg.norm(pre), rtol=1e-6)


def test_update_below_half_an_ulp_is_zero(tmp_path) -> None:
    """θ ≈ 1000 (ulp 6.1e-5) for some elements, Adam with lr 1e-5 (its first steps move
    every element by ≈ lr): those never change, and the recorded update is exactly 0
    there — the θ_{t+1} − θ_t the optimizer applied — while the others change."""
    m = _model()
    with torch.no_grad():
        w = m[2].weight
        w[:, :3] += 1000.0
    opt = torch.optim.Adam(m.parameters(), lr=1e-5)
    url = str(tmp_path / "run")
    hist = [w.detach().clone()]
    with Recorder(url, CapturePolicy(full_every=1)) as rec, tt.watch(m, rec, optimizer=opt):
        for t in range(2):
            opt.zero_grad()
            _loss(m, t).backward()
            opt.step()
            hist.append(w.detach().clone())
    run = open_run(url)
    u = run.stats("update").set_index(["step", "tensor"])
    for t in range(2):
        delta = (hist[t + 1] - hist[t]).numpy()
        assert (delta[:, :3] == 0).all() and (delta[:, 3:] != 0).all()
        np.testing.assert_array_equal(run.snapshot("2/kernel", Kind.UPDATE, t), delta.T)
        assert u.loc[(t, "2/kernel"), "zero_frac"] == (delta == 0).mean()


def test_start_step_follows_the_recorder(tmp_path) -> None:
    """A recorder continuing a run: watch starts at its next_step; an explicit start
    step that disagrees is a RecordError naming both steps."""
    url = str(tmp_path / "run")
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def train(rec, steps, **kw):
        with tt.watch(m, rec, optimizer=opt, **kw):
            for t in range(steps):
                opt.zero_grad()
                _loss(m, t).backward()
                opt.step()

    with Recorder(url) as rec:
        assert rec.next_step == 0
        train(rec, 3)
    with Recorder(url) as rec:
        assert rec.next_step == 3
        with pytest.raises(RecordError, match=r"start step 0 .* at step 3"):
            tt.watch(m, rec, optimizer=opt, start_step=0)
        train(rec, 2)
        assert rec.next_step == 5  # after what this recorder recorded
        train(rec, 1)  # a second watch of the same recorder continues there
    with Recorder(url, resume_step=2) as rec:
        assert rec.next_step == 2
        train(rec, 1, start_step=2)  # agrees: accepted
    assert open_run(url).steps.tolist() == [0, 1, 2]  # resume_step=2 replaced 2..5


def test_kinds_named_are_recorded_whatever_the_policy(tmp_path) -> None:
    url = str(tmp_path / "run")
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    policy = CapturePolicy()  # default: no opt_state
    assert not policy.records_kind("opt_state")
    with (
        Recorder(url, policy) as rec,
        tt.watch(m, rec, optimizer=opt, kinds=("update", "opt_state")),
    ):
        for t in range(2):
            opt.zero_grad()
            _loss(m, t).backward()
            opt.step()
    run = open_run(url)
    assert set(run.kinds()) == {"update", "opt_state"}
    nu = run.stats("opt_state").set_index(["step", "tensor"]).loc[(1, "0/kernel/nu"), "l2"]
    np.testing.assert_allclose(nu, float(opt.state[m[0].weight]["exp_avg_sq"].norm()), rtol=1e-6)
    with Recorder(url, policy) as rec:  # the stored policy is still the one given
        assert rec.policy == policy
    assert traintape.validate(url).ok
