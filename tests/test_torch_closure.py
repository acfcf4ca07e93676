"""``opt.step(closure)`` and wrapper optimizers: the recorded gradient is the one the
optimizer applies, compared with a plain torch loop (never the previous step's)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import traintape  # noqa: E402
import traintape.torch as tt  # noqa: E402
from traintape.adapters.torch.watch import unwrap_optimizer  # noqa: E402

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def _loss(m: torch.nn.Module, t: int) -> torch.Tensor:
    x, y = _batch(t)
    return ((m(x) - y) ** 2).mean()


CANON = {"0/kernel": "0.weight", "0/bias": "0.bias", "2/kernel": "2.weight", "2/bias": "2.bias"}


def _plain_grads(make_opt, steps: int = STEPS) -> list[dict[str, np.ndarray]]:
    """A plain loop with the same closure: p.grad right after the first evaluation."""
    m = _model()
    opt = make_opt(m.parameters())
    out = []
    for t in range(steps):
        seen: list[dict[str, np.ndarray]] = []

        def closure(t=t, seen=seen):
            opt.zero_grad()
            loss = _loss(m, t)
            loss.backward()
            if not seen:
                seen.append({n: p.grad.detach().clone().numpy() for n, p in m.named_parameters()})
            return loss

        opt.step(closure)
        out.append(seen[0])
    return out


def _recorded(url: str, make_opt, wrap=lambda o: o) -> traintape.Run:
    m = _model()
    opt = make_opt(m.parameters())
    pol = traintape.CapturePolicy(full_every=1)
    with traintape.Recorder(url, pol) as rec, tt.watch(m, rec, optimizer=wrap(opt)):
        for t in range(STEPS):

            def closure(t=t):
                opt.zero_grad()
                loss = _loss(m, t)
                loss.backward()
                return loss

            wrap(opt).step(closure)
    return traintape.open_run(url)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.05),
        lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=4),
    ],
    ids=["sgd", "adam", "lbfgs"],
)
def test_closure_grad_is_the_gradient_at_theta_t(tmp_path, make_opt) -> None:
    run = _recorded(str(tmp_path / "run"), make_opt)
    want = _plain_grads(make_opt)
    assert run.steps.tolist() == list(range(STEPS))
    for t in range(STEPS):
        for canon, torch_name in CANON.items():
            got = run.snapshot(canon, "grad", t)
            w = want[t][torch_name]
            np.testing.assert_allclose(got, w.T if w.ndim == 2 else w, rtol=1e-5, atol=1e-7)
    l2 = run.stats("grad")
    assert (l2[l2.step == 0]["l2"] > 0).all()  # the regression: step 0 was all-zero


def test_lbfgs_activations_come_from_the_first_evaluation(tmp_path) -> None:
    """LBFGS evaluates the closure several times per step: activation stats are those of
    the first forward pass (θ_t on batch t), checked against a forward hook of our own."""
    m = _model()
    opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=5)
    first: list[torch.Tensor] = []
    h = m[0].register_forward_hook(lambda mod, a, out: first.append(out.detach().clone()))
    url = str(tmp_path / "run")
    with traintape.Recorder(url) as rec, tt.watch(m, rec, optimizer=opt) as w:
        evals = []
        for t in range(2):
            n0 = len(first)

            def closure(t=t):
                opt.zero_grad()
                loss = _loss(m, t)
                loss.backward()
                return loss

            opt.step(closure)
            evals.append(len(first) - n0)
            first[n0 + 1 :] = []  # keep the first evaluation's output only
        assert w.micro_batches == 0  # reset at the boundary of the next step
    h.remove()
    assert max(evals) > 1  # LBFGS really evaluated the closure more than once
    df = traintape.open_run(url).stats("activation")
    for t in range(2):
        got = df[(df.step == t) & (df.tensor == "0/output")].iloc[0]
        want = first[t].numpy()
        assert got["l2"] == pytest.approx(float(np.linalg.norm(want)), rel=1e-5)
        assert got["mean"] == pytest.approx(float(want.mean()), rel=1e-5, abs=1e-7)


class _Delegating:
    """A minimal optimizer wrapper like Accelerate's: step() delegates to .optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def test_wrapper_optimizer_is_unwrapped(tmp_path) -> None:
    run = _recorded(
        str(tmp_path / "run"),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        wrap=lambda o: _Delegating(o),
    )
    want = _plain_grads(lambda ps: torch.optim.SGD(ps, lr=0.1))
    for t in range(STEPS):
        got = run.snapshot("0/kernel", "grad", t)
        np.testing.assert_allclose(got, want[t]["0.weight"].T, rtol=1e-5, atol=1e-7)


def test_non_optimizer_is_refused_naming_its_type() -> None:
    with pytest.raises(TypeError, match=r"optimizer of type dict is not a torch\.optim\.Optimizer"):
        unwrap_optimizer({})
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert unwrap_optimizer(_Delegating(_Delegating(opt))) is opt


def test_accelerate_optimizer(tmp_path) -> None:
    accelerate = pytest.importorskip("accelerate")
    m = _model()
    acc = accelerate.Accelerator(cpu=True)
    model, opt = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    url = str(tmp_path / "run")
    with (
        traintape.Recorder(url, traintape.CapturePolicy(full_every=1)) as rec,
        tt.watch(model, rec, optimizer=opt),
    ):
        grads = []
        for t in range(2):
            opt.zero_grad()
            acc.backward(_loss(model, t))
            grads.append(model[0].weight.grad.detach().clone().numpy())
            opt.step()
    run = traintape.open_run(url)
    for t in range(2):
        np.testing.assert_allclose(run.snapshot("0/kernel", "grad", t), grads[t].T, rtol=1e-6)


def test_grad_scaler_records_unscaled_gradients(tmp_path) -> None:
    """AMP: GradScaler.step unscales before calling the optimizer's step: the hooks see
    the gradients the optimizer applies (unscaled)."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    url = str(tmp_path / "run")
    grads = []
    with (
        traintape.Recorder(url, traintape.CapturePolicy(full_every=1)) as rec,
        tt.watch(m, rec, optimizer=opt),
    ):
        for t in range(2):
            opt.zero_grad()
            scaler.scale(_loss(m, t)).backward()
            scaler.unscale_(opt)
            grads.append(m[0].weight.grad.detach().clone().numpy())
            scaler.step(opt)
            scaler.update()
    run = traintape.open_run(url)
    for t in range(2):
        np.testing.assert_allclose(run.snapshot("0/kernel", "grad", t), grads[t].T, rtol=1e-6)
