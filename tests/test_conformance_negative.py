"""Negative controls: a deliberately wrong mapping or model must be caught by
``traintape.compare``, which must name the broken tensor and the first step.

Each control trains one conformance model twice (torch, or Keras for the GRU gate
permutation) — once correctly, once with one thing broken — and compares the stores
under the conformance tolerances.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# conformance/ is a top-level package next to traintape/ (not installed): make it importable
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("torch")

import traintape
from conformance import spec as S
from conformance.matrix import TOLERANCES, check_pair

TOL = TOLERANCES["float32"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Correct float32 torch stores of the transformer, the MLP, the GRU and the LLM block."""
    from conformance import models_torch

    root = tmp_path_factory.mktemp("reference")
    out = {}
    for m in ("transformer", "mlp", "gru", "llm"):
        models_torch.train(m, str(root / m), "float32")
        out[m] = str(root / m)
    return out


def _report(a: str, b: str):
    return traintape.compare(a, b, tolerances=TOL, strict=True)


def _same_verdict_from_stats_only(a, b, rep) -> None:
    """A compare of the stat vectors alone (no snapshot is read: what the default policy
    records) names the same first divergence — tensor, kind and step — as the full one."""
    stats_only = traintape.compare(a, b, tolerances=TOL, strict=True, snapshots=False)
    want, got = rep.first_divergence, stats_only.first_divergence
    assert not stats_only.identical
    assert (got.kind, got.tensor, got.first_step_out) == (
        want.kind,
        want.tensor,
        want.first_step_out,
    )


def test_reference_is_reproducible(reference, tmp_path):
    """Control of the controls: a second correct run is identical (else nothing below
    would mean anything)."""
    from conformance import models_torch

    models_torch.train("transformer", str(tmp_path / "again"), "float32")
    assert check_pair(
        reference["transformer"], tmp_path / "again", "transformer", "float32"
    ).identical


def test_untransposed_square_kernel(reference, tmp_path, monkeypatch):
    """The adapter forgets the (in, out) ↔ (out, in) transpose of the attention query
    kernel (square, 8×8: shapes cannot tell). Loading and recording use the same wrong
    mapping, so the recorded initial param round-trips exactly; the model computes with
    the transposed matrix. compare must flag attention output, then the q-kernel grad,
    at step 0."""
    import importlib

    from conformance import models_torch

    mods = [importlib.import_module(f"traintape.adapters.torch.{m}")
            for m in ("names", "canonical", "watch")]  # fmt: skip
    real = mods[0].model_layout

    def wrong_layout(*a, **k):
        lay = real(*a, **k)
        for e in lay.entries:
            if e.name == "attn/q/kernel":
                e.permutation = None
        return lay

    for mod in mods:
        monkeypatch.setattr(mod, "model_layout", wrong_layout)
    models_torch.train("transformer", str(tmp_path / "bad"), "float32")
    rep = _report(reference["transformer"], tmp_path / "bad")
    assert not rep.identical
    fd = rep.first_divergence
    assert (fd.kind, fd.tensor, fd.first_step_out) == ("activation", "attn/output", 0)
    _same_verdict_from_stats_only(reference["transformer"], tmp_path / "bad", rep)
    assert rep.diff("attn/q/kernel", "grad").first_step_out == 0
    assert rep.diff("attn/q/kernel", "param").first_step_out == 1
    # tensors upstream of the attention are untouched at step 0
    assert rep.diff("ln1/output", "activation").first_step_out == 1
    assert rep.diff("attn/k/kernel", "param").first_step_out == 1


def test_wrong_layernorm_epsilon(reference, tmp_path):
    """ln1 built with epsilon 1e-3 instead of 2^-17: ln1's output leaves tolerance at
    step 0 and is named as the first divergence (emb, before it, is fine at step 0)."""
    from conformance import models_torch

    def mutate(model):
        model.ln1.eps = 1e-3

    models_torch.train("transformer", str(tmp_path / "eps"), "float32", mutate=mutate)
    rep = _report(reference["transformer"], tmp_path / "eps")
    assert not rep.identical
    fd = rep.first_divergence
    assert (fd.kind, fd.tensor, fd.first_step_out) == ("activation", "ln1/output", 0)
    assert rep.diff("emb/output", "activation").first_step_out != 0  # upstream: fine at 0
    assert rep.diff("ln1/output", "activation").first_out_via in traintape.STAT_NAMES


def test_one_layer_initialised_differently(reference, tmp_path):
    """fc1's kernel from another seed (same shape and scale): the initial param
    snapshot differs at step 0, and the conformance check's exactness test says so."""
    from conformance import models_torch

    w = S.initial_weights("mlp")
    rng = np.random.default_rng(1)
    w["fc1/kernel"] = rng.normal(0, 1 / np.sqrt(S.MLP_IN), w["fc1/kernel"].shape).astype("float32")
    models_torch.train("mlp", str(tmp_path / "init"), "float32", weights=w)
    rep = _report(reference["mlp"], tmp_path / "init")
    fd = rep.first_divergence
    assert (fd.kind, fd.tensor, fd.first_step_out) == ("param", "fc1/kernel", 0)
    assert rep.diff("head/kernel", "param").first_step_out == 1
    cell = check_pair(reference["mlp"], tmp_path / "init", "mlp", "float32")
    assert not cell.identical and not cell.initial_exact
    assert any("initial param fc1/kernel" in p for p in cell.problems)


def test_one_layer_initialised_slightly_differently(reference, tmp_path):
    """A perturbation far below the float32 tolerances (one ulp on one element of the
    head bias) still fails the *exact* initial-parameter test."""
    from conformance import models_torch

    w = S.initial_weights("mlp")
    b = w["head/bias"]
    before = float(b[0])
    b[0] = np.nextafter(b[0], np.float32(np.inf))
    ulp = abs(float(b[0]) - before)
    models_torch.train("mlp", str(tmp_path / "ulp"), "float32", weights=w)
    cell = check_pair(reference["mlp"], tmp_path / "ulp", "mlp", "float32")
    assert not cell.identical and not cell.initial_exact
    initial = [p for p in cell.problems if p.startswith("initial")]
    assert initial == [f"initial param head/bias not bit-identical (max |a-b| {ulp})"]


def test_swapped_gru_gates(reference, tmp_path, monkeypatch):
    """The Keras adapter forgets to permute the GRU gate blocks (Keras z, r, h →
    canonical r, z, n). Load and record share the mapping, so the initial params match
    the torch reference exactly; the GRU's output is wrong from step 0."""
    pytest.importorskip("tensorflow")
    from conformance import models_tf
    from traintape.adapters.tf import names

    monkeypatch.setattr(names, "_gate_cols", lambda units, order: tuple(range(3 * units)))
    models_tf.train("gru", str(tmp_path / "gates"), "float32")
    cell = check_pair(reference["gru"], tmp_path / "gates", "gru", "float32")
    assert cell.initial_exact  # the wrong mapping round-trips: only behaviour shows it
    rep = _report(reference["gru"], tmp_path / "gates")
    fd = rep.first_divergence
    assert (fd.kind, fd.tensor, fd.first_step_out) == ("activation", "gru/output", 0)
    assert rep.diff("gru/kernel_ih", "grad").first_step_out == 0


# ----------------------------------------------------------------------------- llm block
def test_llm_swapped_q_k(reference, tmp_path):
    """The block's attention uses the k projection as queries and q as keys (logits
    transposed — under the causal mask a different function). Names, weights and the
    projections' own outputs are untouched at step 0: the initial params are exact,
    attn/q/output is fine at step 0; compare names attn/o/output at step 0, and the q
    and k kernels' grads (snapshots included) at step 0."""
    from conformance import models_torch

    def mutate(model):
        att = model.attn

        def swapped(x):
            q, k = att.q(x), att.k(x)
            return att.o(models_torch.causal_attention(k, q, att.v(x), S.LLM_HEADS))

        att.forward = swapped

    models_torch.train("llm", str(tmp_path / "qk"), "float32", mutate=mutate)
    cell = check_pair(reference["llm"], tmp_path / "qk", "llm", "float32")
    assert cell.initial_exact and not cell.identical
    rep = _report(reference["llm"], tmp_path / "qk")
    fd = rep.first_divergence
    assert (fd.kind, fd.tensor, fd.first_step_out) == ("activation", "attn/o/output", 0)
    _same_verdict_from_stats_only(reference["llm"], tmp_path / "qk", rep)
    for name in ("attn/q/output", "attn/k/output", "attn/v/output"):
        assert rep.diff(name, "activation").first_step_out == 1, name
    for name in ("attn/q/kernel", "attn/k/kernel"):
        assert rep.diff(name, "grad").first_step_out == 0, name
        assert rep.diff(name, "param").first_step_out == 1, name
    # the step-0 grad snapshots differ too, element by element, not just their stats
    snap = traintape.open_run(str(tmp_path / "qk")).snapshot("attn/q/kernel", "grad", 0)
    ref = traintape.open_run(reference["llm"]).snapshot("attn/q/kernel", "grad", 0)
    assert not np.allclose(snap, ref, rtol=TOL["grad"]["rtol"], atol=TOL["grad"]["atol"])


def test_llm_wrong_rms_norm_epsilon(reference, tmp_path):
    """attn_norm with epsilon 1e-3 instead of 2^-17: attn_norm/output is the first
    divergence at step 0 (and its scale's grad); embed/output (before it) is fine at
    step 0, the scale itself (loaded right) too."""
    from conformance import models_torch

    def mutate(model):
        model.attn_norm.eps = 1e-3

    models_torch.train("llm", str(tmp_path / "rms"), "float32", mutate=mutate)
    rep = _report(reference["llm"], tmp_path / "rms")
    fd = rep.first_divergence
    assert (fd.kind, fd.tensor, fd.first_step_out) == ("activation", "attn_norm/output", 0)
    _same_verdict_from_stats_only(reference["llm"], tmp_path / "rms", rep)
    assert rep.diff("embed/output", "activation").first_step_out != 0  # upstream: fine at 0
    assert rep.diff("attn/q/output", "activation").first_step_out == 0  # downstream
    assert rep.diff("attn_norm/scale", "grad").first_step_out == 0
    assert rep.diff("attn_norm/scale", "param").first_step_out > 0  # loaded right


@pytest.mark.xfail(
    strict=True,
    reason="known gap: torch watch takes grad stats at the end of backward (pre-clip) but "
    "grad snapshots at the optimizer step; a gradient replaced between the two (here by "
    "the previous step's) makes them disagree, so the stats-only and full compares name "
    "different first divergences (update vs grad). Fix: snapshot grads at the end of "
    "backward on full-capture steps.",
)
def test_llm_one_step_late_gradient(reference, tmp_path):
    """The optimizer is handed the previous step's gradient (a pipelining bug; zeros at
    step 0). The forward pass and the params of step 0 are right; the gradient applied
    and recorded at step 0 is all zeros: compare names a grad at step 0 (every grad
    snapshot of step 0 differs), params from step 1."""
    import torch

    from conformance import models_torch

    late: dict[str, torch.Tensor] = {}

    def before_step(model, t):
        for n, p in model.named_parameters():
            prev = late.get(n, torch.zeros_like(p.grad))
            late[n] = p.grad.detach().clone()
            p.grad.copy_(prev)

    models_torch.train("llm", str(tmp_path / "late"), "float32", before_step=before_step)
    cell = check_pair(reference["llm"], tmp_path / "late", "llm", "float32")
    assert cell.initial_exact and not cell.identical
    rep = _report(reference["llm"], tmp_path / "late")
    fd = rep.first_divergence
    assert (fd.kind, fd.first_step_out) == ("grad", 0)
    assert fd.tensor == "lm_head/kernel"  # the first gradient computed (backward order)
    _same_verdict_from_stats_only(reference["llm"], tmp_path / "late", rep)
    run, ref = traintape.open_run(str(tmp_path / "late")), traintape.open_run(reference["llm"])
    for name in S.LLM.params:
        assert rep.diff(name, "grad").first_step_out == 0, name
        assert rep.diff(name, "param").first_step_out == 1, name
        assert not run.snapshot(name, "grad", 0).any(), name  # the stale (zero) gradient
        assert ref.snapshot(name, "grad", 0).any(), name
    assert all(
        rep.diff(n, "activation").first_step_out == 1 for n in run.tensor_names("activation")
    )
