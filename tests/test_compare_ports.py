"""issue 24's must-show cases for compare, on real ports between frameworks
(``tests/_compare_ports.py``): the GPT decoder with a key bias (Flax NNX ↔ torch, SGD)
compares identical, and each planted porting bug — causal mask missing, attention scaled
by 1/d, q kernel transposed — differs with the first divergence inside
``blocks/0/attn`` from the stats alone. The LLaMA block (Flax Linen ↔ torch, AdamW after
global-norm clipping) compares identical, and weight decay on the norm scales in torch
only differs at the scales' ``update``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("flax")

import _compare_ports as P

from traintape.analysis import compare
from traintape.cli import app

BUGS = ("no_mask", "scale_1_over_d", "transposed_q")


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt")
    out = {"nnx": str(root / "nnx"), "torch": str(root / "torch")}
    P.train_nnx_gpt(out["nnx"])
    P.train_torch_gpt(out["torch"])
    for bug in BUGS:
        out[bug] = str(root / bug)
        P.train_torch_gpt(out[bug], bug=bug, snapshots=False)
    out["bf16"] = str(root / "bf16")
    P.train_torch_gpt(out["bf16"], bf16=True)
    for bug in ("no_mask", "transposed_q"):
        out[f"bf16-{bug}"] = str(root / f"bf16-{bug}")
        P.train_torch_gpt(out[f"bf16-{bug}"], bug=bug, snapshots=False, bf16=True)
    return out


def test_gpt_port_is_identical(gpt):
    rep = compare(gpt["nnx"], gpt["torch"])
    assert rep.identical, rep.first_divergence
    assert compare(gpt["torch"], gpt["nnx"]).identical
    # the key-projection biases' gradients are rounding noise (zero in exact arithmetic)
    within = set(rep.numerics["grad"].tensors_within_noise)
    assert {"blocks/0/attn/k/bias", "blocks/1/attn/k/bias"} <= within
    for name in ("blocks/0/attn/k/bias", "blocks/1/attn/k/bias"):
        d = rep.diff(name, "grad")
        assert d.steps_within_noise == P.STEPS and d.max_abs < d.noise_floor
    # every other tensor is judged on all its statistics, well inside tolerance
    judged = [d for d in rep.tensors if d.steps_within_noise == 0 and d.kind != "metrics"]
    assert len(judged) > 100 and max(d.max_tol_ratio for d in judged) < 0.5
    assert rep.diff("loss", "metrics").max_rel < 1e-6
    r = CliRunner().invoke(app, ["compare", gpt["nnx"], gpt["torch"]])
    assert r.exit_code == 0, r.output
    assert "within noise" in r.output and "blocks/0/attn/k/bias" in r.output


@pytest.mark.parametrize("bug", BUGS)
def test_gpt_planted_bug_found_in_attention_from_stats(gpt, bug):
    rep = compare(gpt["nnx"], gpt[bug], snapshots=False)
    assert not rep.identical and not rep.structural  # the numbers differ, not the structure
    fd = rep.first_divergence
    assert fd.tensor.startswith("blocks/0/attn/") and fd.first_step_out == 0, fd
    assert fd.first_out_via is not None
    r = CliRunner().invoke(app, ["compare", gpt["nnx"], gpt[bug], "--no-snapshots"])
    assert r.exit_code == 1 and "first divergence" in r.output and "blocks/0/attn/" in r.output


def test_gpt_bf16_autocast_identical_at_its_precision(gpt):
    """torch under bf16 autocast (the store records precision 'bf16-mixed') against the
    float32 NNX run: not bit-equal (fp32 mode says differs), identical at bf16's
    precision, read from the store; the activations' bfloat16 dtype is a note there."""
    rep = compare(gpt["nnx"], gpt["bf16"])
    assert rep.identical, (rep.structural[:3], rep.first_divergence)
    assert rep.precision.mode == "bf16" and rep.precision.source.startswith("recorded in")
    assert any("expected under bf16 mixed precision" in n for n in rep.notes)
    assert max(d.max_tol_ratio or 0 for d in rep.tensors) < 0.5
    assert not compare(gpt["nnx"], gpt["bf16"], precision="fp32").identical


@pytest.mark.parametrize("bug", ("no_mask", "transposed_q"))
def test_gpt_bf16_planted_bug_still_found(gpt, bug):
    rep = compare(gpt["nnx"], gpt[f"bf16-{bug}"], snapshots=False)
    assert rep.precision.mode == "bf16" and not rep.identical
    fd = rep.first_divergence
    assert fd.tensor.startswith("blocks/0/attn/") and fd.first_step_out == 0, fd


# ----------------------------------------------------------------------------- LLaMA
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    out = {}
    for clip in ("clip", "noclip"):
        c = P.CLIP if clip == "clip" else 1e6  # 1e6: clipping never acts
        out[f"linen-{clip}"] = str(root / f"linen-{clip}")
        P.train_linen_llama(out[f"linen-{clip}"], clip=c)
        for bug in (None, "decay_norms"):
            key = f"torch-{clip}" + (f"-{bug}" if bug else "")
            out[key] = str(root / key)
            P.train_torch_llama(out[key], bug=bug, clip=c)
    return out


def test_llama_adamw_port_is_identical_without_clipping(llama):
    """AdamW amplifies gradient rounding by up to lr/eps where v is small: the update
    tolerance follows it (gain from the recorded opt_state)."""
    rep = compare(llama["linen-noclip"], llama["torch-noclip"])
    assert rep.identical, rep.first_divergence
    assert rep.numerics["update"].gain_from.startswith("opt_state")


def test_llama_decay_on_norm_scales_found_at_their_update(llama):
    rep = compare(llama["linen-noclip"], llama["torch-noclip-decay_norms"])
    fd = rep.first_divergence
    assert (fd.kind, fd.first_step_out) == ("update", 0) and fd.tensor.endswith("norm/scale")


def test_llama_adamw_port_with_clipping_is_identical(llama):
    """Clipping acting at every step (pre-clip norms > 1): every adapter records ``grad``
    before clipping (docs/store-format.md), so the Linen and torch ports are identical
    (torch's watch once read p.grad after clip_grad_norm_ had scaled it)."""
    rep = compare(llama["linen-clip"], llama["torch-clip"])
    assert rep.identical, rep.first_divergence


def test_llama_decay_on_norm_scales_with_clipping(llama):
    rep = compare(llama["linen-clip"], llama["torch-clip-decay_norms"])
    fd = rep.first_divergence
    assert (fd.kind, fd.first_step_out) == ("update", 0) and fd.tensor.endswith("norm/scale")
