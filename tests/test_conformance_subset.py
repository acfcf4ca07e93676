"""A few cells of the equinox column and the ``llm`` row, and HF Llama's names.

The full matrix — every framework (equinox included) × every model (``llm`` included) ×
float32/float64, plus the Adam block — runs with ``python -m conformance``;
``tests/test_conformance.py`` keeps to the four original frameworks and models. Here:
float32, torch ↔ equinox on ``mlp`` and ``llm``, torch ↔ NNX and NNX ↔ equinox on
``llm`` (one worker subprocess per framework; ~30–40 s on 2 CPU cores). Then a tiny
``transformers.LlamaForCausalLM`` (from config, no download) with the ``llm`` block's
shape takes the block's canonical weights, records under exactly the hand-written torch
block's names, shapes and layer kinds (the ``hf_llama_name_map`` preset) and, trained
like the torch cell, is identical to it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# conformance/ is a top-level package next to traintape/ (not installed): make it importable
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("equinox")

import traintape
from conformance import spec as S
from conformance.matrix import check_pair, produce
from conformance.worker import store_path

FRAMEWORKS = ("torch", "jax-nnx", "equinox")
MODELS = ("mlp", "llm")
CELLS = [
    ("mlp", "torch", "equinox"),
    ("llm", "torch", "jax-nnx"),
    ("llm", "torch", "equinox"),
    ("llm", "jax-nnx", "equinox"),
]


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("conformance-subset")
    failed = produce(root, FRAMEWORKS, ("float32",), MODELS)
    assert not failed, failed
    return root


@pytest.mark.parametrize(("model", "a", "b"), CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_identical(stores, model, a, b):
    cell = check_pair(store_path(stores, a, model, "float32"),
                      store_path(stores, b, model, "float32"), model, "float32",
                      names=(a, b))  # fmt: skip
    assert cell.identical, "\n".join(cell.problems)
    assert cell.initial_exact
    assert cell.max_abs is not None  # something was actually compared


def test_equinox_records_activations_per_layer(stores):
    """equinox's layers run under vmap (batch, tokens): recorded as (B, T, ...) like
    torch, one output per layer, in forward order."""
    run = traintape.open_run(store_path(stores, "equinox", "llm", "float32"))
    acts = run.tensor_names("activation")
    assert sorted(acts) == sorted(f"{layer}/output" for layer in S.FORWARD_ORDER["llm"])
    assert run.spec("attn/q/output", "activation").shape == [None, S.LLM_T, S.LLM_D]
    assert run.spec("lm_head/output", "activation").shape == [None, S.LLM_T, S.LLM_VOCAB]
    assert run.spec("attn_norm/output", "activation").layer_kind == "rms_norm"
    assert run.manifest.forward_order == S.FORWARD_ORDER["llm"]


def test_hf_llama_is_the_llm_block(stores, tmp_path):
    """HF's own modules (LlamaRMSNorm, LlamaAttention's q/k/v/o_proj with rotary
    embeddings, LlamaMLP's gate/up/down_proj) in a one-block ``LlamaForCausalLM`` of the
    ``llm`` shape, named through ``hf_llama_name_map``: the block's canonical weights
    load strictly, the store has exactly the hand-written torch block's tensors — names,
    kinds, shapes, dtypes, roles, layer kinds —, and trained like the torch cell it is
    identical to it (conformance definition: initial params bit-identical, every step
    within the float32 tolerances)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    import torch

    import traintape.torch as tt
    from conformance.policy import recorder

    cfg = transformers.LlamaConfig(
        vocab_size=S.LLM_VOCAB, hidden_size=S.LLM_D, intermediate_size=S.LLM_FF,
        num_hidden_layers=1, num_attention_heads=S.LLM_HEADS,
        num_key_value_heads=S.LLM_HEADS, rms_norm_eps=S.RMS_EPS, rope_theta=S.ROPE_THETA,
        max_position_embeddings=16, tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    name_map = S.hf_llama_name_map(one_block=True)
    tt.from_canonical(hf, S.initial_weights("llm"), name_map=name_map, strict=True)
    x, y = S.batches("llm")
    url = str(tmp_path / "hf")
    opt = torch.optim.SGD(hf.parameters(), lr=S.LR, momentum=S.MOMENTUM)
    with recorder(url, "llm") as rec, tt.watch(hf, rec, name_map=name_map) as handle:
        hf.train()
        for t in range(S.STEPS):
            opt.zero_grad()
            logits = hf(input_ids=torch.from_numpy(x[t]).long()).logits
            torch.nn.functional.mse_loss(logits, torch.from_numpy(y[t])).backward()
            opt.step()
            handle.step()
    ref_url = store_path(stores, "torch", "llm", "float32")
    ref, run = traintape.open_run(ref_url), traintape.open_run(url)
    assert run.kinds() == ref.kinds()
    for kind in ref.kinds():
        assert sorted(run.tensor_names(kind)) == sorted(ref.tensor_names(kind)), kind
        for name in ref.tensor_names(kind):
            a, b = run.spec(name, kind), ref.spec(name, kind)
            got = (a.shape, a.dtype, a.role, a.layer, a.layer_kind)
            assert got == (b.shape, b.dtype, b.role, b.layer, b.layer_kind), (kind, name)
    q = run.spec("attn/q/kernel", "param")
    assert q.source_name == "model.layers.0.self_attn.q_proj.weight"
    cell = check_pair(url, ref_url, "llm", "float32", names=("hf-llama", "torch"))
    assert cell.identical, "\n".join(cell.problems)
    assert cell.initial_exact
