"""Each built-in health rule added for issue 24: a small real torch training that fires it
and the same training done right that does not (the corpus cases of
benchmarks/verdict_corpus/ at test size); plus the context the rules read (roles,
clipping, the optimizer) and the run-level recommendations."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import traintape  # noqa: E402
import traintape.torch as tt  # noqa: E402
from traintape.analysis import IssueType, Severity, health, recommendations  # noqa: E402
from traintape.analysis.health_model import RunContext  # noqa: E402
from traintape.analysis.health_rules import advice, loss_period  # noqa: E402
from traintape.analysis.health_trend import default_window  # noqa: E402
from traintape.analysis.registry import rules  # noqa: E402

nn = torch.nn


def _teacher(n: int = 512, d: int = 16, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, classes, generator=g)
    return x, (x @ w).argmax(1)


def _mlp(width: int = 32, bn: bool = False) -> nn.Module:
    torch.manual_seed(0)
    mid = [nn.BatchNorm1d(width)] if bn else []
    return nn.Sequential(nn.Linear(16, width), *mid, nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 4))  # fmt: skip


def _train(url, model, opt, steps=60, *, zero_grad=True, order=None, batch=32, x=None, y=None):
    """Train ``model`` on the teacher task, recording with ``watch``; ``order``: the
    example indices in reading order (default: reshuffled every epoch)."""
    if x is None:
        x, y = _teacher()
    gen = torch.Generator().manual_seed(1)
    n = len(x)
    with traintape.Recorder(url) as rec, tt.watch(model, rec, optimizer=opt):
        for t in range(steps):
            k = (t * batch) % n
            idx = (order if order is not None else torch.randperm(n, generator=gen))[k : k + batch]
            if zero_grad:
                opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            rec.log(t, loss=float(loss.detach()))
    return traintape.open_run(url)


def _types(rep, severity=("warning", "critical")) -> set[str]:
    return {str(i.type) for i in rep.issues() if i.severity in severity}


def test_every_rule_is_registered_with_its_thresholds_and_a_docstring():
    from traintape.analysis.health_model import HealthThresholds

    fields = set(HealthThresholds.model_fields)
    reg = rules()
    assert {"vanishing", "accumulating_gradients", "frozen_by_mistake", "lr_too_small",
            "periodic_loss", "norm_stats_frozen", "turbulent"} <= set(reg)  # fmt: skip
    for name, r in reg.items():
        assert r.kind == "rule" and r.source == "built-in"
        assert set(r.thresholds) <= fields, name
        assert "Corpus" in (r.fn.__doc__ or ""), f"{name}: no corpus case named"


# ----------------------------------------------------------------- ACCUMULATING_GRAD
def test_forgotten_zero_grad_is_accumulating(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rep = health(_train(str(tmp_path / "acc"), model, opt, steps=100, zero_grad=False))
    acc = {i.layer for i in rep.issues() if i.type == IssueType.ACCUMULATING_GRAD}
    assert acc == {"0", "2", "4"}, [i.message for i in rep.issues()]
    assert all("zero_grad" in r.recommendation for r in rep.recommendations()
               if r.type == "ACCUMULATING_GRAD")  # fmt: skip


def test_zero_grad_every_step_is_not_accumulating(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rep = health(_train(str(tmp_path / "ok"), model, opt))
    assert IssueType.ACCUMULATING_GRAD not in _types(rep), rep.issues()
    assert rep.status == "healthy", [i.message for i in rep.issues()]


# ----------------------------------------------------------------- NOT_UPDATED
def test_layer_left_out_of_the_optimizer_is_not_updated(tmp_path):
    model = _mlp()
    opt = torch.optim.Adam([*model[0].parameters(), *model[4].parameters()], lr=3e-3)
    rep = health(_train(str(tmp_path / "left"), model, opt))
    assert rep.has(IssueType.NOT_UPDATED, "2")
    assert not rep.has(IssueType.NOT_UPDATED, "0") and not rep.has(IssueType.NOT_UPDATED, "4")


def test_middle_layer_frozen_by_mistake_but_not_a_frozen_prefix(tmp_path):
    model = _mlp()
    model[2].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    rep = health(_train(str(tmp_path / "mid"), model, opt))
    assert rep.has(IssueType.NOT_UPDATED, "2") and rep.frozen == ["2"]
    model = _mlp()
    model[0].requires_grad_(False)  # a frozen input layer: fine-tuning on top of it
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    rep = health(_train(str(tmp_path / "prefix"), model, opt))
    assert not rep.has(IssueType.NOT_UPDATED) and rep.frozen == ["0"]


# ----------------------------------------------------------------- LR_TOO_SMALL
def test_learning_rate_far_too_small(tmp_path):
    model = _mlp()
    rep = health(
        _train(str(tmp_path / "tiny"), model, torch.optim.Adam(model.parameters(), lr=1e-7))
    )
    assert rep.has(IssueType.LR_TOO_SMALL)
    model = _mlp()
    rep = health(
        _train(str(tmp_path / "fine"), model, torch.optim.Adam(model.parameters(), lr=3e-3))
    )
    assert not rep.has(IssueType.LR_TOO_SMALL) and rep.status == "healthy"


# ----------------------------------------------------------------- NORM_STATS_FROZEN
def test_batchnorm_trained_in_eval_mode(tmp_path):
    model = _mlp(bn=True)
    model.eval()  # train() forgotten after an evaluation
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rep = health(_train(str(tmp_path / "eval"), model, opt, steps=30))
    assert {i.layer for i in rep.issues() if i.type == IssueType.NORM_STATS_FROZEN} == {"1"}
    model = _mlp(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rep = health(_train(str(tmp_path / "train"), model, opt, steps=30))
    assert not rep.has(IssueType.NORM_STATS_FROZEN)


# ----------------------------------------------------------------- PERIODIC_LOSS
def test_data_read_class_by_class_gives_a_periodic_loss(tmp_path):
    x, y = _teacher()
    by_class = torch.argsort(y, stable=True)  # never shuffled
    model = _mlp()
    rep = health(_train(str(tmp_path / "ordered"), model,
                        torch.optim.Adam(model.parameters(), lr=3e-3), steps=160,
                        order=by_class, x=x, y=y))  # fmt: skip
    per = [i for i in rep.issues() if i.type == IssueType.PERIODIC_LOSS]
    assert per and per[0].severity == Severity.WARNING and per[0].evidence["period"] == 16
    model = _mlp()
    rep = health(_train(str(tmp_path / "shuffled"), model,
                        torch.optim.Adam(model.parameters(), lr=3e-3), steps=160, x=x, y=y))  # fmt: skip
    assert not rep.has(IssueType.PERIODIC_LOSS)


def test_loss_period_finds_the_period_of_a_noisy_falling_loss():
    rng = np.random.default_rng(0)
    t = np.arange(300)
    loss = np.exp(-t / 200) * (1 + 0.5 * (t % 25 < 12)) * np.exp(0.05 * rng.standard_normal(300))
    assert loss_period(loss)[0] == 25
    _, acf = loss_period(np.exp(0.3 * rng.standard_normal(300)))
    assert acf < 0.5


# ----------------------------------------------------------------- roles and context
class _TinyEncoder(nn.Module):
    """An embedding, a pre-LayerNorm attention block with q/k/v/o and an MLP, and a
    classifier head: the layer roles whose healthy gradients differ by orders of
    magnitude (issue 24: VANISHING on every q/k/LayerNorm after 6 steps)."""

    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.ModuleDict({p: nn.Linear(d, d) for p in ("q", "k", "v", "o")})
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 2)

    def forward(self, ids):
        h = self.embed(ids)
        a = self.ln1(h)
        q, k, v = self.attn["q"](a), self.attn["k"](a), self.attn["v"](a)
        w = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1)
        h = h + self.attn["o"](w @ v)
        h = h + self.mlp(self.ln2(h))
        return self.head(h.mean(1))


def _encoder_run(url, steps, log_clip=False, clip=True):
    model = _TinyEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (64, 12), generator=g)
    y = (ids[:, 0] > 25).long()
    with traintape.Recorder(url) as rec, tt.watch(model, rec, optimizer=opt):
        for t in range(steps):
            idx = torch.randint(0, 64, (16,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(ids[idx]), y[idx])
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) if clip else 0.0
            opt.step()
            rec.log(t, loss=float(loss.detach()))
            if log_clip:  # what an adapter that sees clipping logs (docs/store-format.md)
                rec.log(t, **{"grad/clip_factor": min(1.0, 1.0 / max(norm, 1e-12))})
    return traintape.open_run(url)


@pytest.mark.parametrize("steps", [6, 60])
def test_transformer_from_init_with_clipping_is_healthy(tmp_path, steps):
    """Embedding, LayerNorm scales, q/k at init and the head are each judged in their
    role: no warning or critical, and no advice to add clipping or replace sigmoid."""
    rep = health(_encoder_run(str(tmp_path / "enc"), steps))
    assert rep.status == "healthy", [(i.type, i.layer, i.message) for i in rep.issues()]
    for i in rep.issues():
        assert "instead of sigmoid" not in i.recommendation


def test_advice_knows_what_the_run_already_does():
    clipped = RunContext(clipping="metric", clip_frac=0.4, adaptive=True,
                         bounded_activations=False)  # fmt: skip
    bare = RunContext()
    assert "add gradient clipping" in advice(IssueType.EXPLODING, bare)
    assert "add gradient clipping" not in advice(IssueType.EXPLODING, clipped)
    assert "already clips" in advice(IssueType.EXPLODING, clipped)
    assert "sigmoid" in advice(IssueType.VANISHING, bare)
    assert "sigmoid" not in advice(IssueType.VANISHING, clipped)
    assert "Adam" in advice(IssueType.LAYER_IMBALANCE, bare)
    assert "Adam" not in advice(IssueType.LAYER_IMBALANCE, clipped)
    assert "clip" not in advice(IssueType.TURBULENT, clipped)


def test_clipping_is_seen_in_the_clip_factor_metric(tmp_path):
    # torch's watch logs grad/clip_factor itself when clip_grad_norm_ scales the grads
    run = _encoder_run(str(tmp_path / "clip"), 30)
    assert "grad/clip_factor" in run.manifest.metrics
    rep = health(run)
    assert rep.clipping == "metric" and 0 < rep.clip_frac <= 1
    assert rep.adaptive_optimizer is True  # AdamW's exp_avg_sq is not recorded: from u/g
    rep = health(_encoder_run(str(tmp_path / "noclip"), 30, clip=False))
    assert rep.clipping is None


def test_each_recommendation_once_with_its_layers(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rep = health(_train(str(tmp_path / "acc"), model, opt, steps=100, zero_grad=False))
    recs = rep.recommendations()
    assert len({(r.type, r.recommendation) for r in recs}) == len(recs)
    acc = next(r for r in recs if r.type == "ACCUMULATING_GRAD")
    assert acc.layers == ["0", "2", "4"]
    assert recommendations(rep.issues()) == recs


def test_windows_are_sized_to_the_run():
    from traintape.analysis.health_trend import window_rows

    w = default_window(np.arange(6))
    assert len(window_rows(np.arange(6), w)[0]) == 1  # one window, not six 1-step windows
    w = default_window(np.arange(300))
    assert w >= 10 and 300 / w <= 10
    assert default_window(np.arange(0, 3000, 10)) >= 100  # 10 recorded steps per window


def test_health_against_ignores_info_issues(tmp_path):
    """A run whose only findings are info (a short transformer run: early-phase q/k) is
    compared with a baseline without raising on the info severity."""
    from traintape.analysis import health_against

    a = _encoder_run(str(tmp_path / "a"), 6)
    b = _encoder_run(str(tmp_path / "b"), 6)
    cmp = health_against(a, b)
    assert all(ic.before != "info" and ic.after != "info"
               for lc in cmp.layers for ic in lc.issues)  # fmt: skip
