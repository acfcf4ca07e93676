"""Analyses of a LoRA (PEFT) fine-tune: health judges frozen base layers and LoRA factors
for what they are, and the effective update ΔW = s·A·B of each adapted layer (norm,
spectrum, effective rank, stats bound) equals numpy's on the model's own parameters.

A real run: a tiny LlamaForCausalLM from config, PEFT LoRA r=4, alpha=8 (s = 2) on
q_proj/v_proj, Adam, recorded by ``traintape.torch.watch`` with full snapshots every 4
steps (θ at the start of steps 0, 4, 8)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import traintape  # noqa: E402
import traintape.torch as tt  # noqa: E402
from traintape.analysis import (  # noqa: E402
    IssueType,
    Status,
    health,
    health_trend,
    lora_delta,
    parameter_change,
    render_report,
)
from traintape.analysis.change import (  # noqa: E402
    effective_rank,
    lora_norm_bounds,
    lora_pairs,
    lora_scale,
    lowrank_singular_values,
)

R, ALPHA = 4, 8
S = ALPHA / R  # PEFT's scaling
SNAPS = (4, 8)  # snapshot steps whose factors the run keeps from the model itself
_PRE = "base_model.model."


def _lora_run(url: str, *, lr: float = 1e-3, zero: str | None = None, user=None):
    """Train 9 steps; returns ``(run, refs)``: ``refs[step][layer] = (A, B, W_base)`` as
    PEFT holds them (``lora_A.default.weight`` (r, in), ``lora_B.default.weight``
    (out, r), ``base_layer.weight`` (out, in)) at the start of each step of ``SNAPS``.
    ``zero``: gradients of parameters whose name contains it are zeroed before each step."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
        initializer_range=0.2,  # attention not uniform: q and v get comparable gradients
    )  # fmt: skip
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(1)
    refs: dict[int, dict[str, tuple[np.ndarray, ...]]] = {}
    user = {"lora_alpha": ALPHA} if user is None else user
    with (
        traintape.Recorder(url, traintape.CapturePolicy(full_every=4), user=user) as rec,
        tt.watch(model, rec, optimizer=opt),
    ):
        for t in range(9):
            if t in SNAPS:
                refs[t] = _factors(model)
            ids = torch.randint(0, 64, (4, 12), generator=gen)
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            if zero:
                for n, p in model.named_parameters():
                    if zero in n and p.grad is not None:
                        p.grad.zero_()
            opt.step()
    return traintape.open_run(url), refs


def _factors(model) -> dict[str, tuple[np.ndarray, ...]]:
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            layer = name.removeprefix(_PRE).replace(".", "/")
            out[layer] = tuple(
                w.detach().double().numpy().copy()
                for w in (mod.lora_A["default"].weight, mod.lora_B["default"].weight,
                          mod.base_layer.weight)
            )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def normal(tmp_path_factory):
    return _lora_run(str(tmp_path_factory.mktemp("lora") / "normal"))


ADAPTED = [f"model/layers/{i}/self_attn/{p}_proj" for i in range(2) for p in "qv"]
FACTORS = [f"{x}/lora_{ab}" for x in ADAPTED for ab in "AB"]


# ----------------------------------------------------------------------------- health


def test_normal_lora_fine_tune_is_healthy(normal):
    run, _ = normal
    h = health(run)
    assert h.status == Status.HEALTHY, [i.message for i in h.issues()]
    assert h.issues() == [] and h.score == 100
    by = {lh.layer: lh for lh in h.layers}
    # the frozen base model: param without grad → frozen, never VANISHING/DEAD
    for layer in ("model/embed_tokens", "lm_head", "model/layers/0/self_attn/q_proj/base_layer",
                  "model/layers/1/mlp/down_proj", "model/layers/0/self_attn/k_proj"):  # fmt: skip
        assert layer in h.frozen and by[layer].frozen and by[layer].issues == [], layer
    assert not set(FACTORS) & set(h.frozen)
    for f in FACTORS:
        lh = by[f]
        assert lh.lora is not None and lh.lora.part == f.rsplit("/", 1)[1]
        assert lh.lora.scale == S and lh.lora.scale_source == "user.lora_alpha"
        assert lh.lora.adapted == f.rsplit("/", 1)[0]
        assert 0 < lh.lora.update_ratio < h.thresholds.update_ratio_high
        if f.endswith("lora_B"):  # what the plain rule misread: ‖ΔB‖/‖B‖ with B from 0
            assert lh.update_ratio > h.thresholds.update_ratio_high
    trend = health_trend(run, 3)
    bad = {IssueType.EXPLODING, IssueType.VANISHING, IssueType.DEAD}
    assert not [i for i in trend.issues() if i.type in bad]
    assert h.model_dump_json()  # JSON-safe


def test_exploding_lora_learning_rate_is_flagged_on_the_adapters(tmp_path):
    run, _ = _lora_run(str(tmp_path / "lr1e3"), lr=1e3)
    h = health(run)
    assert h.status == Status.CRITICAL
    for f in FACTORS:
        assert h.has(IssueType.EXPLODING, f), f
    assert all(lh.issues == [] for lh in h.layers if lh.frozen)
    assert {i.layer for i in h.issues() if i.layer is not None} <= set(FACTORS)


def test_adapter_with_zeroed_gradient_is_dead(tmp_path):
    run, _ = _lora_run(str(tmp_path / "dead"), zero="layers.1.self_attn.v_proj.lora_")
    h = health(run)
    dead = {i.layer for i in h.issues() if i.type == IssueType.DEAD}
    assert dead == {"model/layers/1/self_attn/v_proj/lora_A",
                    "model/layers/1/self_attn/v_proj/lora_B"}  # fmt: skip
    assert "model/layers/1/self_attn/v_proj/lora_A" not in h.frozen  # a zero grad is recorded


def test_frozen_layer_with_zero_output_is_not_dead(tmp_path):
    """An all-zero activation of a frozen layer is no DEAD issue (nor SATURATED)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    url = str(tmp_path / "frozen")
    with traintape.Recorder(url) as rec, tt.watch(model, rec, optimizer=opt):
        for t in range(4):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(t))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    h = health(traintape.open_run(url))
    assert h.frozen == ["0"]
    by = {lh.layer: lh for lh in h.layers}
    assert by["0"].act_zero_frac == 1.0 and by["0"].frozen
    assert by["0"].issues == [] and by["0"].score == 100


# ------------------------------------------------------------------------------ ΔW


def test_delta_w_equals_numpy_svd_of_the_model_factors(normal):
    run, refs = normal
    d = lora_delta(run)
    assert d.step == 8 and d.from_snapshots and d.scale_known
    assert set(d.per_layer) == set(ADAPTED)
    assert set(d.per_component) == {"lora/attention/q", "lora/attention/v"}
    for layer in ADAPTED:
        a, b, w = refs[8][layer]
        dw = S * (b @ a)  # PEFT's ΔW (out, in); canonical is its transpose
        sv = np.linalg.svd(dw, compute_uv=False)[:R]
        x = d.per_layer[layer]
        assert x.scale == S and x.scale_source == "user.lora_alpha" and x.rank == R
        assert x.shape == [a.shape[1], b.shape[0]]
        np.testing.assert_allclose(x.singular_values, sv, rtol=1e-5)
        assert x.norm == pytest.approx(np.linalg.norm(dw), rel=1e-5)
        assert x.relative == pytest.approx(np.linalg.norm(dw) / np.linalg.norm(w), rel=1e-5)
        np.testing.assert_allclose(x.energy, np.cumsum(sv**2) / np.sum(sv**2), rtol=1e-5)
        p = sv / sv.sum()
        assert x.effective_rank == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-5)
        bound = S * np.linalg.norm(a) * np.linalg.norm(b)
        assert x.norm_bound == pytest.approx(bound, rel=1e-5) and x.norm_bound >= x.norm
    q = d.per_component["lora/attention/q"]
    want = np.sqrt(sum(d.per_layer[x].norm ** 2 for x in ADAPTED if x.endswith("q_proj")))
    assert q.adapters == 2 and q.norm == pytest.approx(want, rel=1e-12)
    # the other snapshot step; unknown scale: ΔW up to the scale
    d4 = lora_delta(run, step=4, scale=1.0)
    for layer in ADAPTED:
        a, b, _ = refs[4][layer]
        sv = np.linalg.svd(b @ a, compute_uv=False)[:R]
        np.testing.assert_allclose(d4.per_layer[layer].singular_values, sv, rtol=1e-5)


def test_stats_bound_every_step(normal):
    run, refs = normal
    steps, keys, bound = lora_norm_bounds(run)
    assert keys == [p.key for p in lora_pairs(run)] and bound.shape == (run.rows, len(keys))
    assert (bound[0] == 0).all()  # B starts at 0
    assert np.isfinite(bound).all() and (bound[1:] > 0).all()
    for t in SNAPS:
        row = int(np.flatnonzero(steps == t)[0])
        for c, key in enumerate(keys):
            a, b, _ = refs[t][key]
            assert bound[row, c] == pytest.approx(
                S * np.linalg.norm(a) * np.linalg.norm(b), rel=1e-5
            )


def test_parameter_change_reports_delta_w_per_layer_and_component(normal):
    run, refs = normal
    pc = parameter_change(run)
    assert [(p.step_old, p.step_new) for p in pc.pairs] == [(0, 4), (4, 8)]
    first, last = pc.pairs
    for layer in ADAPTED:
        assert first.lora[layer].norm_old == 0.0  # B = 0 at step 0
        a4, b4, w = refs[4][layer]
        a8, b8, _ = refs[8][layer]
        ch = last.lora[layer]
        assert ch.norm_old == pytest.approx(S * np.linalg.norm(b4 @ a4), rel=1e-5)
        assert ch.norm == pytest.approx(S * np.linalg.norm(b8 @ a8), rel=1e-5)
        move = S * np.linalg.norm(b8 @ a8 - b4 @ a4)
        assert ch.change == pytest.approx(move, rel=1e-5)
        assert ch.relative == pytest.approx(move / np.linalg.norm(w), rel=1e-5)
        assert ch.effective_rank == pytest.approx(pc.lora.per_layer[layer].effective_rank)
    v = last.lora_per_component["lora/attention/v"]
    want = np.sqrt(sum(last.lora[x].change ** 2 for x in ADAPTED if x.endswith("v_proj")))
    assert v.change == pytest.approx(want, rel=1e-12)
    assert pc.lora is not None and pc.lora.step == 8
    assert pc.model_dump_json()


def test_report_shows_delta_w(normal):
    run, _ = normal
    html = render_report(run)
    assert "LoRA effective update" in html
    assert all(x in html for x in ADAPTED)


# ----------------------------------------------------------------------- scale, math


def test_scale_sources():
    pair = SimpleNamespace(key="m/q_proj:other", layer="m/q_proj", rank=4)

    def run(user):
        return SimpleNamespace(manifest=SimpleNamespace(user=user))

    assert lora_scale(run({}), pair) == (1.0, None)  # type: ignore[arg-type]
    assert lora_scale(run({"lora_alpha": 16}), pair) == (4.0, "user.lora_alpha")  # type: ignore[arg-type]
    assert lora_scale(run({"lora_alpha": 16, "use_rslora": True}), pair) == (8.0, "user.lora_alpha")  # type: ignore[arg-type]
    user = {"lora_scaling": {"*v_proj": 3.0, "*q_proj": 0.5}, "lora_alpha": 16}
    assert lora_scale(run(user), pair) == (0.5, "user.lora_scaling")  # type: ignore[arg-type]
    assert lora_scale(run({"lora_scaling": {"m/q_proj:other": 7}}), pair)[0] == 7.0  # type: ignore[arg-type]
    assert lora_scale(run(user), pair, {"m/q_proj": 9.0}) == (9.0, "argument")  # type: ignore[arg-type]
    assert lora_scale(run(user), pair, 2.5) == (2.5, "argument")  # type: ignore[arg-type]


def test_lowrank_singular_values_never_form_the_product():
    """A (200000, 4) @ B (4, 100000) would be 160 GB; its 4 singular values come from
    the 4×4 problem, σ² = eigenvalues of (AᵀA)(BBᵀ)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((200_000, 4))
    b = rng.standard_normal((4, 100_000)) * np.array([[10.0], [1.0], [0.1], [0.0]])
    sv = lowrank_singular_values(a, b)
    want = np.sqrt(np.clip(np.sort(np.linalg.eigvals((a.T @ a) @ (b @ b.T)).real)[::-1], 0, None))
    np.testing.assert_allclose(sv, want, rtol=1e-8, atol=1e-6 * want[0])
    assert sv[-1] < 1e-9 * sv[0]  # rank 3
    assert effective_rank(np.array([2.0, 0.0])) == pytest.approx(1.0)
    assert effective_rank(np.ones(4)) == pytest.approx(4.0)
    assert effective_rank(np.zeros(3)) is None
