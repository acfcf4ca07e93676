"""Hugging Face / PEFT models under canonical names (tiny models from config, CPU).

GPT-2's ``Conv1D`` is a dense layer already in the (in, out) layout; integer buffers
(``position_ids``, ``token_type_ids``) are never recorded; HF projection names map to
the analysis components (q/k/v/o, fused qkv, mlp); a PEFT LoRA model records under the
wrapped model's names with ``<layer>/lora_A|lora_B/kernel`` adapters (layer kind
``lora``) that alone get ``grad``/``update``. Grad references are ``p.grad`` itself.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import traintape  # noqa: E402
import traintape.torch as tt  # noqa: E402
from traintape.adapters.torch.canonical import from_canonical, to_canonical  # noqa: E402
from traintape.adapters.torch.names import model_layout  # noqa: E402
from traintape.analysis.change import (  # noqa: E402
    attention_projection,
    component,
    component_of,
    parameter_change,
    qkv_groups,
)

STEPS = 3
VOCAB = 32


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        num_hidden_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=16,
    )
    return transformers.BertModel(cfg)


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, transformers.BertModel):
        out = model(input_ids=ids, token_type_ids=torch.zeros_like(ids))
        return out.last_hidden_state.square().mean() + out.pooler_output.square().mean()
    return model(input_ids=ids, labels=ids).loss


def _train(
    model: torch.nn.Module, url: str, watch_grads: dict[str, torch.nn.Parameter] | None = None
) -> tuple[traintape.Run, list[warnings.WarningMessage], list[dict[str, float]]]:
    """SGD for STEPS steps under ``watch``; per step the l2 of ``p.grad`` of each
    parameter in ``watch_grads`` (canonical name → parameter), read before the step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05)
    g = torch.Generator().manual_seed(1)
    ref: list[dict[str, float]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (
            traintape.Recorder(url, traintape.CapturePolicy(full_every=1)) as rec,
            tt.watch(model, rec, optimizer=opt),
        ):
            for _ in range(STEPS):
                ids = torch.randint(0, VOCAB, (2, 8), generator=g)
                opt.zero_grad()
                _loss(model, ids).backward()
                ref.append(
                    {
                        n: float(p.grad.double().norm())
                        for n, p in (watch_grads or {}).items()
                        if p.grad is not None
                    }
                )
                opt.step()
    return traintape.open_run(url), list(caught), ref


def _no_layout_warning(caught: list[warnings.WarningMessage]) -> None:
    msgs = [str(w.message) for w in caught if "no canonical layout" in str(w.message)]
    assert msgs == []


def _recorded_l2(run: traintape.Run, kind: str, name: str) -> np.ndarray:
    df = run.stats(kind)
    return df[df.tensor == name].sort_values("step")["l2"].to_numpy()


def _check_ref(run: traintape.Run, ref: list[dict[str, float]]) -> None:
    assert ref and all(ref)
    for name in ref[0]:
        want = np.array([r[name] for r in ref])
        np.testing.assert_allclose(_recorded_l2(run, "grad", name), want, rtol=1e-5, err_msg=name)


def _no_constant_buffers(run: traintape.Run) -> None:
    for kind in run.kinds():
        names = run.tensor_names(kind)
        bad = [n for n in names if any(b in n for b in ("position_ids", "token_type_ids"))]
        assert bad == [], (kind, bad)
        assert not [n for n in names if "inv_freq" in n or "masked_bias" in n], kind


def _components(run: traintape.Run) -> dict[str, str]:
    return {s.name: component_of(s) for s in run.manifest.specs("param")}


def test_gpt2_conv1d_is_a_dense_kernel_in_stored_layout(tmp_path) -> None:
    torch.manual_seed(0)
    model = _gpt2()
    c_attn = model.transformer.h[0].attn.c_attn
    kname = "transformer/h/0/attn/c_attn/kernel"
    run, caught, ref = _train(model, str(tmp_path / "gpt2"), {kname: c_attn.weight})
    _no_layout_warning(caught)
    _no_constant_buffers(run)
    spec = run.spec(kname, "param")
    assert spec.layer_kind == "dense" and spec.role == "kernel"
    assert spec.shape == list(c_attn.weight.shape) == [16, 48]  # (in, out) as stored
    assert spec.source_shape == spec.shape and spec.permutation in (None, [0, 1])
    assert spec.source_name == "transformer.h.0.attn.c_attn.weight"
    fc = run.spec("transformer/h/0/mlp/c_fc/kernel", "param")
    assert fc.shape == [16, 64] and fc.layer_kind == "dense"
    _check_ref(run, ref)  # recorded grad l2 == ‖p.grad‖ of the Conv1D weight, every step
    # the recorded param is the weight itself, no transpose: snapshot == weight after STEPS
    snap = run.snapshot(kname, "param", STEPS - 1)
    assert snap.shape == tuple(c_attn.weight.shape)
    comps = _components(run)
    assert comps[kname] == "attention/qkv"  # fused q/k/v
    assert comps["transformer/h/0/attn/c_attn/bias"] == "attention/qkv"
    assert comps["transformer/h/0/attn/c_proj/kernel"] == "attention/o"
    assert comps["transformer/h/0/mlp/c_fc/kernel"] == "mlp"
    assert comps["transformer/h/0/mlp/c_proj/kernel"] == "mlp"
    assert comps["transformer/h/0/ln_1/scale"] == "norm"
    assert comps["transformer/wte/embedding"] == "embedding"
    assert qkv_groups(s.layer for s in run.manifest.specs("grad")) == {}  # fused: no group
    change = parameter_change(run)
    assert set(change.pairs[0].per_component) == {
        "attention/qkv", "attention/o", "embedding", "mlp", "norm"
    }  # fmt: skip
    assert traintape.validate(str(tmp_path / "gpt2")).ok


def test_bert_integer_buffers_are_not_recorded_and_qkv_components(tmp_path) -> None:
    torch.manual_seed(0)
    model = _bert()
    assert model.embeddings.position_ids.dtype == torch.int64  # present, not recorded
    q = model.encoder.layer[0].attention.self.query
    qname = "encoder/layer/0/attention/self/query/kernel"
    run, caught, ref = _train(model, str(tmp_path / "bert"), {qname: q.weight})
    _no_layout_warning(caught)
    _no_constant_buffers(run)
    params = run.tensor_names("param")
    assert "embeddings/token_type_embeddings/embedding" in params  # the float table is
    assert run.spec(qname, "param").shape == list(q.weight.T.shape)
    _check_ref(run, ref)
    comps = _components(run)
    pre = "encoder/layer/0/attention/"
    for s, c in (("query", "q"), ("key", "k"), ("value", "v")):
        assert comps[f"{pre}self/{s}/kernel"] == f"attention/{c}"
        assert comps[f"{pre}self/{s}/bias"] == f"attention/{c}"
    assert comps[f"{pre}output/dense/kernel"] == "attention/o"
    assert comps["encoder/layer/0/intermediate/dense/kernel"] == "mlp"
    assert comps["encoder/layer/0/output/dense/kernel"] == "mlp"
    assert comps[f"{pre}output/LayerNorm/scale"] == "norm"
    layers = {s.layer for s in run.manifest.specs("grad")}
    assert qkv_groups(layers) == {
        f"{pre}self": {"q": f"{pre}self/query", "k": f"{pre}self/key", "v": f"{pre}self/value"}
    }


def test_llama_names_rms_norm_and_qkv_components(tmp_path) -> None:
    torch.manual_seed(0)
    model = _llama()
    attn = model.model.layers[0].self_attn
    qname = "model/layers/0/self_attn/q_proj/kernel"
    kname = "model/layers/0/self_attn/k_proj/kernel"
    run, caught, ref = _train(
        model, str(tmp_path / "llama"), {qname: attn.q_proj.weight, kname: attn.k_proj.weight}
    )
    _no_layout_warning(caught)  # LlamaRMSNorm included
    _no_constant_buffers(run)
    assert run.spec(kname, "param").shape == [16, 8]  # (in, out): 1 kv head of 8
    norm = run.spec("model/layers/0/input_layernorm/scale", "param")
    assert norm.layer_kind == "rms_norm" and norm.shape == [16]
    _check_ref(run, ref)
    comps = _components(run)
    pre = "model/layers/0/"
    for p in "qkvo":
        assert comps[f"{pre}self_attn/{p}_proj/kernel"] == f"attention/{p}"
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert comps[f"{pre}mlp/{p}/kernel"] == "mlp"
    assert comps[f"{pre}post_attention_layernorm/scale"] == "norm"
    groups = qkv_groups({s.layer for s in run.manifest.specs("grad")})
    assert sorted(groups) == [f"model/layers/{i}/self_attn" for i in range(2)]
    assert list(groups[f"{pre}self_attn"].items()) == [
        (p, f"{pre}self_attn/{p}_proj") for p in "qkv"
    ]


def test_peft_lora_llama_records_lora_adapters_only_as_trained(tmp_path) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(
        _llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    inner = model.base_model.model.model.layers[0].self_attn
    pre = "model/layers/0/self_attn/"
    refs = {
        f"{pre}q_proj/lora_A/kernel": inner.q_proj.lora_A["default"].weight,
        f"{pre}q_proj/lora_B/kernel": inner.q_proj.lora_B["default"].weight,
    }
    run, caught, ref = _train(model, str(tmp_path / "lora"), refs)
    _no_layout_warning(caught)
    lora = sorted(
        f"model/layers/{i}/self_attn/{p}/lora_{ab}/kernel"
        for i in range(2)
        for p in ("q_proj", "v_proj")
        for ab in "AB"
    )
    assert sorted(run.tensor_names("grad")) == lora
    assert sorted(run.tensor_names("update")) == lora
    params = run.tensor_names("param")
    assert not [n for n in params if n.startswith("base_model") or "/default/" in n]
    assert f"{pre}q_proj/base_layer/kernel" in params  # frozen base: param only
    assert f"{pre}k_proj/kernel" in params  # not adapted: plain name
    a = run.spec(f"{pre}q_proj/lora_A/kernel", "param")
    b = run.spec(f"{pre}v_proj/lora_B/kernel", "param")
    assert (a.layer_kind, a.role, a.shape) == ("lora", "kernel", [16, 4])  # (in, r)
    assert (b.layer_kind, b.role, b.shape) == ("lora", "kernel", [4, 8])  # (r, out)
    assert run.spec(f"{pre}q_proj/base_layer/kernel", "param").layer_kind == "dense"
    _check_ref(run, ref)  # step 0: lora_B is zero, so lora_A's grad is exactly 0
    assert ref[0][f"{pre}q_proj/lora_A/kernel"] == 0.0
    assert ref[1][f"{pre}q_proj/lora_A/kernel"] > 0
    comps = _components(run)
    assert comps[f"{pre}q_proj/lora_A/kernel"] == "lora/attention/q"
    assert comps[f"{pre}v_proj/lora_B/kernel"] == "lora/attention/v"
    assert comps[f"{pre}q_proj/base_layer/kernel"] == "attention/q"
    # the LoRA sub-layers are no attention projections of their own
    assert qkv_groups(s.layer for s in run.manifest.specs("grad")) == {}
    assert attention_projection(f"{pre}q_proj/lora_A") is None
    assert traintape.validate(str(tmp_path / "lora")).ok


def test_lora_adapter_names_embedding_conv_and_dora() -> None:
    """A non-default adapter adds its name; embedding, conv and DoRA adapters have
    canonical layouts too, and to/from_canonical round-trips them bit for bit."""
    peft = pytest.importorskip("peft")

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 6)
            self.fc = torch.nn.Linear(6, 4)
            self.conv = torch.nn.Conv2d(3, 4, 3)

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=2, target_modules=["emb", "fc", "conv"], use_dora=True)
    model = peft.get_peft_model(M(), cfg)
    model.add_adapter("extra", peft.LoraConfig(r=3, target_modules=["fc"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no canonical layout" warning
        lay = model_layout(model)
    got = {e.name: (e.layer_kind, e.shape) for e in lay.entries if e.layer_kind == "lora"}
    assert got == {
        "emb/lora_A/embedding": ("lora", (10, 2)),  # (vocab, r)
        "emb/lora_B/kernel": ("lora", (2, 6)),  # (r, dim)
        "emb/lora_magnitude/magnitude": ("lora", (6,)),
        "fc/lora_A/kernel": ("lora", (6, 2)),
        "fc/lora_B/kernel": ("lora", (2, 4)),
        "fc/lora_magnitude/magnitude": ("lora", (4,)),
        "fc/lora_A/extra/kernel": ("lora", (6, 3)),
        "fc/lora_B/extra/kernel": ("lora", (3, 4)),
        "conv/lora_A/kernel": ("lora", (3, 3, 3, 2)),  # (*K, in, r)
        "conv/lora_B/kernel": ("lora", (1, 1, 2, 4)),
        "conv/lora_magnitude/magnitude": ("lora", (1, 1, 1, 4)),  # channels-last
    }
    by = {e.name: e for e in lay.entries}
    assert by["emb/lora_magnitude/magnitude"].role == "magnitude"
    assert by["fc/base_layer/kernel"].layer_kind == "dense"
    emb = model.base_model.model.emb
    c = to_canonical(model)
    np.testing.assert_array_equal(
        c["emb/lora_A/embedding"], emb.lora_embedding_A["default"].detach().T.numpy()
    )
    shifted = {k: v + 1 for k, v in c.items()}
    from_canonical(model, shifted)
    back = to_canonical(model)
    for k in c:
        np.testing.assert_array_equal(back[k], shifted[k], err_msg=k)
    assert component("fc/lora_A/extra/kernel", layer_kind="lora") == "lora/mlp"
    assert component("emb/lora_A/embedding", layer_kind="lora") == "lora/embedding"


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("blocks/0/attn/q/kernel", "attention/q"),  # torch MHA / Flax canonical
        ("model/layers/3/self_attn/o_proj/kernel", "attention/o"),
        ("model/decoder/layers/0/self_attn/out_proj/bias", "attention/o"),  # OPT/BART
        ("distilbert/transformer/layer/0/attention/v_lin/kernel", "attention/v"),
        ("gpt_neox/layers/0/attention/query_key_value/kernel", "attention/qkv"),
        ("transformer/h/0/self_attention/dense/kernel", "attention/o"),  # Falcon/Bloom
        ("transformer/h/0/mlp/c_proj/kernel", "mlp"),
        ("encoder/layer/0/output/dense/kernel", "mlp"),
        ("critic/value/kernel", "mlp"),  # an RL value head is no attention value
        ("key/kernel", "mlp"),
        ("model/layers/0/mlp/down_proj/kernel", "mlp"),
        ("transformer/h/0/ln_2/bias", "norm"),
        ("model/layers/0/self_attn/q_proj/lora_B/kernel", "lora/attention/q"),
        ("model/layers/0/self_attn/q_proj/base_layer/kernel", "attention/q"),
        ("model/layers/0/mlp/up_proj/lora_A/other/kernel", "lora/mlp"),
    ],
)
def test_component_rule(name: str, want: str) -> None:
    assert component(name) == want


def test_health_sees_qkv_imbalance_on_hf_names(tmp_path) -> None:
    """The attention q/k/v imbalance check works on HF's q_proj/k_proj/v_proj names: a
    Llama whose layer-0 q_proj gradient is scaled up 1000x (by a hook, so it is the
    gradient the optimizer applies and traintape records; lr 0 keeps every other
    gradient as it was) is flagged for that attention layer only."""
    from traintape.analysis.health import HealthThresholds, IssueType, health

    torch.manual_seed(0)
    model = _llama()
    model.model.layers[0].self_attn.q_proj.weight.register_hook(lambda g: g * 1000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1)
    url = str(tmp_path / "llama")
    with traintape.Recorder(url, system_metrics=False) as rec, tt.watch(model, rec, optimizer=opt):
        for _ in range(STEPS):
            opt.zero_grad()
            _loss(model, torch.randint(0, VOCAB, (2, 8), generator=g)).backward()
            opt.step()
    # at initialisation attention is near uniform: q and k get ~1e-3 of v's gradient by
    # themselves (max/min ~250 in both layers here); the planted 1000x makes layer 0's
    # ~1400: a threshold between the two must flag layer 0 only
    run = traintape.open_run(url)
    ratios = {
        i.layer: max(i.evidence.values()) / min(i.evidence.values())
        for i in health(run).issues()
        if i.type == IssueType.ATTENTION_QKV_IMBALANCE
    }
    assert ratios["model/layers/0/self_attn"] > 4 * ratios["model/layers/1/self_attn"]
    rep = health(run, HealthThresholds(qkv_ratio=2 * ratios["model/layers/1/self_attn"]))
    issues = [i for i in rep.issues() if i.type == IssueType.ATTENTION_QKV_IMBALANCE]
    assert [i.layer for i in issues] == ["model/layers/0/self_attn"]
    ev = issues[0].evidence
    assert ev["grad_norm_q"] == max(ev.values())  # the planted projection
