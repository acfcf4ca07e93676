"""Architecture-aware health checks on real (tiny) torch trainings with planted defects.

Each model is trained for real on CPU (plain SGD, a few dozen steps) and recorded with
traintape: the residual and transformer stacks by hand with the core Recorder under
canonical names, the LSTM through ``traintape.torch.watch`` (canonical gate layout from the
adapter). Every planted defect must raise its issue; the healthy runs must raise none.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import traintape  # noqa: E402
from traintape import CapturePolicy, Recorder  # noqa: E402
from traintape.analysis import IssueType, health  # noqa: E402
from traintape.analysis.architecture import (  # noqa: E402
    ArchitectureThresholds,
    architecture,
)
from traintape.torch import watch  # noqa: E402

ARCH_TYPES = {
    "BOTTLENECK",
    "RESIDUAL_DECAY",
    "ATTENTION_FFN_IMBALANCE",
    "ATTENTION_HEAD_IMBALANCE",
    "GATE_SATURATION",
    "FORGET_GATE_CLOSED",
}


def _record_step(rec: Recorder, t: int, params: dict, acts: dict, lr: float, loss: float) -> None:
    """Record θ_t, activations, ∇L(θ_t) and the SGD update of step ``t``; apply it."""
    p = {k: v.detach().numpy().copy() for k, v in params.items()}
    g = {k: v.grad.detach().numpy().copy() for k, v in params.items()}
    rec.record(t, "param", p)
    rec.record(t, "activation", {k: v.detach().numpy() for k, v in acts.items()})
    rec.record(t, "grad", g)
    rec.record(t, "update", {k: -lr * g[k] for k in g})
    rec.log(t, loss=loss)
    with torch.no_grad():
        for v in params.values():
            v -= lr * v.grad
            v.grad = None


# ------------------------------------------------------------------ residual MLP stack
def train_residual(
    url: str,
    *,
    blocks: int = 6,
    width: int = 16,
    steps: int = 30,
    lr: float = 0.02,
    skip: bool = True,
    prenorm: bool = True,
    branch_gain: float = 1.0,
    act: str = "relu",
    sat_block: int | None = None,
    seed: int = 0,
) -> None:
    """A stack ``blocks/<i>`` of MLP branches ``fc2(act(fc1(norm(h))))`` added to the
    residual stream ``h`` (``skip``), recorded with the block outputs ``blocks/<i>/output``.

    ``branch_gain`` scales the init of every ``fc1``/``fc2``; ``sat_block``: that block's
    ``fc1`` bias is +6, so its tanh is saturated (tanh' ≈ 2.5e-5) and ``fc1`` gets almost
    no gradient while the skip connection keeps feeding the other blocks.
    """
    g = torch.Generator().manual_seed(seed)
    init_std = 1.0 / math.sqrt(width) * (1.0 / math.sqrt(2 * blocks) if prenorm else 1.0)
    params: dict[str, torch.Tensor] = {}
    for i in range(blocks):
        for fc in ("fc1", "fc2"):
            w = torch.randn(width, width, generator=g) * init_std * branch_gain
            params[f"blocks/{i}/{fc}/kernel"] = w.requires_grad_()
            b = torch.zeros(width)
            if fc == "fc1" and i == sat_block:
                b += 6.0
            params[f"blocks/{i}/{fc}/bias"] = b.requires_grad_()
    params["head/kernel"] = (torch.randn(width, 1, generator=g) / math.sqrt(width)).requires_grad_()
    w_true = torch.randn(width, 1, generator=g)
    f = torch.relu if act == "relu" else torch.tanh
    with Recorder(url) as rec:
        for t in range(steps):
            x = torch.randn(32, width, generator=g)
            y = torch.tanh(x @ w_true)
            h, acts = x, {}
            for i in range(blocks):
                z = F.layer_norm(h, (width,)) if prenorm else h
                z = f(z @ params[f"blocks/{i}/fc1/kernel"] + params[f"blocks/{i}/fc1/bias"])
                z = z @ params[f"blocks/{i}/fc2/kernel"] + params[f"blocks/{i}/fc2/bias"]
                h = h + z if skip else z
                acts[f"blocks/{i}/output"] = h
            out = (F.layer_norm(h, (width,)) if prenorm else h) @ params["head/kernel"]
            loss = F.mse_loss(out, y)
            loss.backward()
            _record_step(rec, t, params, acts, lr, loss.item())


# -------------------------------------------------------------- transformer-ish stack
HEADS, D = 4, 16


def train_transformer(
    url: str,
    *,
    blocks: int = 3,
    steps: int = 24,
    lr: float = 0.05,
    attn_scale: float = 1.0,
    dead_head: int | None = None,
    full_every: int | None = 8,
    bert_names: bool = False,
    seed: int = 0,
) -> None:
    """Pre-LN blocks ``blocks/<i>`` of multi-head self-attention (``attn/{q,k,v,o}``,
    ``HEADS`` heads in the canonical column layout ``h·head_dim + d``) and an FFN
    (``mlp/fc1``, ``mlp/fc2``), on a copy-the-previous-token regression task. Snapshots
    every ``full_every`` steps; ``user={"attention_heads": HEADS}``.

    ``attn_scale`` scales the init of every attention projection; ``dead_head``: that
    head's q and k columns start 1e-3 times smaller (a collapsed head). ``bert_names``:
    BERT's names (``attention/self/query``, ``attention/output/dense``,
    ``intermediate/dense``, ``output/dense``) instead of ``attn/q`` and ``mlp/fc1``.
    """
    bert = {"q": "attention/self/query", "k": "attention/self/key",
            "v": "attention/self/value", "o": "attention/output/dense",
            "fc1": "intermediate/dense", "fc2": "output/dense"}  # fmt: skip

    def nm(i: int, part: str) -> str:
        sub = bert[part] if bert_names else (f"attn/{part}" if part in "qkvo" else f"mlp/{part}")
        return f"blocks/{i}/{sub}/kernel"

    g = torch.Generator().manual_seed(seed)
    seq, hd = 8, D // HEADS
    params: dict[str, torch.Tensor] = {}

    def w(a: int, b: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(a, b, generator=g) / math.sqrt(a) * scale

    for i in range(blocks):
        for p in "qkvo":
            k = w(D, D, attn_scale)
            if dead_head is not None and p in "qk":
                k[:, dead_head * hd : (dead_head + 1) * hd] *= 1e-3
            params[nm(i, p)] = k
        params[nm(i, "fc1")] = w(D, 4 * D)
        params[nm(i, "fc2")] = w(4 * D, D, 1 / math.sqrt(2 * blocks))
    params["head/kernel"] = w(D, D)
    for v in params.values():
        v.requires_grad_()

    def attention(x: torch.Tensor, i: int) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = ((x @ params[nm(i, p)]).view(b, seq, HEADS, hd).transpose(1, 2) for p in "qkv")
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)
        return (a @ v).transpose(1, 2).reshape(b, seq, D) @ params[nm(i, "o")]

    policy = CapturePolicy(full_every=full_every)
    with Recorder(url, policy, user={"attention_heads": HEADS}) as rec:
        for t in range(steps):
            x = torch.randn(16, seq, D, generator=g)
            y = torch.roll(x, 1, dims=1)
            h, acts = x, {}
            for i in range(blocks):
                h = h + attention(F.layer_norm(h, (D,)), i)
                z = torch.relu(F.layer_norm(h, (D,)) @ params[nm(i, "fc1")])
                h = h + z @ params[nm(i, "fc2")]
                acts[f"blocks/{i}/output"] = h
            loss = F.mse_loss(F.layer_norm(h, (D,)) @ params["head/kernel"], y)
            loss.backward()
            _record_step(rec, t, params, acts, lr, loss.item())


# ------------------------------------------------------------------------------ LSTM
class _Seq(nn.Module):
    def __init__(self, hidden: int = 12) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def train_lstm(
    url: str,
    *,
    steps: int = 30,
    gate_bias: dict[str, float] | None = None,
    seed: int = 0,
) -> None:
    """An LSTM (4 → 12) + linear head trained with SGD to output the sum of the first
    input channel over a 10-step sequence (needs memory), recorded through
    ``traintape.torch.watch`` with snapshots every 5 steps. ``gate_bias={"f": -8.0}`` sets
    that gate's ``bias_ih`` block (PyTorch gate order i, f, g, o) and zeroes its
    ``bias_hh`` block."""
    torch.manual_seed(seed)
    model = _Seq()
    hid = model.lstm.hidden_size
    with torch.no_grad():
        for gate, v in (gate_bias or {}).items():
            j = "ifgo".index(gate)
            model.lstm.bias_ih_l0[j * hid : (j + 1) * hid] = v
            model.lstm.bias_hh_l0[j * hid : (j + 1) * hid] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    rec = Recorder(url, CapturePolicy(full_every=5))
    with rec, watch(model, rec, optimizer=opt):
        for _ in range(steps):
            x = torch.randn(16, 10, 4, generator=gen)
            y = x[:, :, :1].sum(dim=1) / 3
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()


# ------------------------------------------------ torch encoder + GRU through watch
class _EncGru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            16, 4, 32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.gru = nn.GRU(16, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.enc(x))[0][:, -1])


def train_enc_gru(url: str, *, z_bias: float | None = None, steps: int = 20) -> None:
    """A pre-LN ``nn.TransformerEncoder`` (3 layers, 4 heads) feeding a GRU, Adam, recorded
    through ``traintape.torch.watch`` (snapshots every 5 steps, ``attention_heads`` 4).
    ``z_bias``: the GRU's update-gate ``bias_ih`` block (gate order r, z, n)."""
    torch.manual_seed(0)
    model = _EncGru()
    if z_bias is not None:
        with torch.no_grad():
            model.gru.bias_ih_l0[8:16] = z_bias
            model.gru.bias_hh_l0[8:16] = 0.0
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    gen = torch.Generator().manual_seed(1)
    rec = Recorder(url, CapturePolicy(full_every=5), user={"attention_heads": 4})
    with rec, watch(model, rec, optimizer=opt):
        for _ in range(steps):
            x = torch.randn(8, 6, 16, generator=gen)
            opt.zero_grad()
            F.mse_loss(model(x), x[:, :, :1].sum(dim=1)).backward()
            opt.step()


# ----------------------------------------------------------------------------- tests
def _arch_issues(rep) -> list:
    return [i for i in rep.issues() if i.type.value in ARCH_TYPES]


def test_healthy_residual_stack_has_no_architecture_issue(tmp_path):
    url = str(tmp_path / "res")
    train_residual(url)
    run = traintape.open_run(url)
    arch = architecture(run)
    assert not arch.issues, arch.issues
    prof = arch.residual[0]
    assert prof.stack == "blocks" and len(prof.blocks) == 6
    assert prof.factor is not None and 0.5 < prof.factor < 2
    assert arch.measure_name == "rel_grad"
    assert [u.unit for u in arch.units][:2] == ["blocks/0/fc1", "blocks/0/fc2"]
    assert not _arch_issues(health(run))


@pytest.fixture(scope="module")
def saturated_branch(tmp_path_factory) -> str:
    """The residual stack with block 3's tanh saturated (trained once for this module)."""
    url = str(tmp_path_factory.mktemp("arch") / "sat")
    train_residual(url, act="tanh", sat_block=3)
    return url


def test_saturated_branch_is_a_bottleneck(saturated_branch):
    rep = health(traintape.open_run(saturated_branch))
    hits = [i for i in rep.issues() if i.type == IssueType.BOTTLENECK]
    assert [i.layer for i in hits] == ["blocks/3/fc1"], hits
    assert hits[0].severity == "critical" and hits[0].recommendation
    assert hits[0].evidence["previous"] == "blocks/2/fc2"
    assert hits[0].evidence["next"] == "blocks/3/fc2"
    # it is the layer's own issue (counts in its score), and neighbours are untouched
    by = {lh.layer: lh for lh in rep.layers}
    assert any(i.type == IssueType.BOTTLENECK for i in by["blocks/3/fc1"].issues)
    assert not any(i.type == IssueType.BOTTLENECK for i in by["blocks/3/fc2"].issues)


def test_exploding_residual_stream(tmp_path):
    url = str(tmp_path / "explode")
    # no norm and branches initialised 2x too large: each block multiplies the stream
    # (~3.5x); a tiny learning rate keeps the run at its init (a larger one diverges)
    train_residual(url, prenorm=False, branch_gain=2.0, lr=1e-6, steps=20)
    arch = architecture(traintape.open_run(url))
    hits = [i for i in arch.issues if i.type == "RESIDUAL_DECAY"]
    assert len(hits) == 1 and hits[0].layer == "blocks", arch.issues
    assert hits[0].evidence["factor"] > 2 and hits[0].evidence["total"] > 10
    assert hits[0].severity == "warning"  # < 1e3x over the stack
    assert "grows" in hits[0].message


def test_collapsing_stream_without_skip(tmp_path):
    url = str(tmp_path / "collapse")
    train_residual(url, skip=False, prenorm=False, branch_gain=0.4, act="tanh", steps=20, lr=1e-3)
    rep = health(traintape.open_run(url))
    hits = [i for i in rep.run_issues if i.type == IssueType.RESIDUAL_DECAY]
    assert len(hits) == 1 and "decays" in hits[0].message
    assert hits[0].evidence["total"] < 0.1
    assert "pre-norm" in hits[0].recommendation


def test_healthy_transformer_has_no_architecture_issue(tmp_path):
    url = str(tmp_path / "tf")
    train_transformer(url)
    run = traintape.open_run(url)
    arch = architecture(run)
    assert not arch.issues, arch.issues
    assert [b.block for b in arch.blocks] == ["blocks/0", "blocks/1", "blocks/2"]
    b0 = arch.blocks[0]
    assert b0.ffn == ["blocks/0/mlp/fc1", "blocks/0/mlp/fc2"]
    assert 0.01 < b0.attn_share < 0.99
    assert [h.attention for h in arch.heads] == [f"blocks/{i}/attn" for i in range(3)]
    h0 = arch.heads[0]
    assert h0.heads == HEADS and h0.heads_source == "user.attention_heads"
    assert h0.steps == [0, 8, 16] and len(h0.grad_norm["q"]) == HEADS
    # the attention (q/k/v/o merged) is one BOTTLENECK unit
    assert arch.units[0].unit == "blocks/0/attn" and len(arch.units[0].layers) == 4
    assert not _arch_issues(health(run))


def test_starved_attention_path(tmp_path):
    url = str(tmp_path / "starved")
    train_transformer(url, attn_scale=1e-3)
    rep = health(traintape.open_run(url))
    hits = [i for i in rep.issues() if i.type == IssueType.ATTENTION_FFN_IMBALANCE]
    assert {i.layer for i in hits} == {"blocks/0", "blocks/1", "blocks/2"}
    assert all(i.evidence["ratio"] < 1e-2 and "attention barely learns" in i.message for i in hits)


def test_collapsed_head(tmp_path):
    url = str(tmp_path / "head")
    train_transformer(url, dead_head=2)
    run = traintape.open_run(url)
    rep = health(run)
    hits = [i for i in rep.run_issues if i.type == IssueType.ATTENTION_HEAD_IMBALANCE]
    assert {i.layer for i in hits} == {"blocks/0/attn", "blocks/1/attn", "blocks/2/attn"}
    assert all(i.evidence["weakest_head"] == 2 for i in hits)
    assert all(i.evidence["projection"] in ("q", "k") for i in hits)
    # the number of heads can come from the argument; a wrong one is refused by name
    assert architecture(run, heads={"blocks/*/attn": 2}).heads[0].heads == 2
    with pytest.raises(ValueError, match=r"3.*'blocks/0/attn'.*16 columns"):
        architecture(run, heads=3)
    # snapshots are read within a byte budget; what it leaves out is noted
    none = architecture(run, ArchitectureThresholds(max_snapshot_bytes=0))
    assert none.heads == [] and not none.issues
    assert any("max_snapshot_bytes" in n and "blocks/0/attn" in n for n in none.notes)


def test_healthy_lstm_gates(tmp_path):
    url = str(tmp_path / "lstm")
    train_lstm(url)
    run = traintape.open_run(url)
    arch = architecture(run)
    assert not arch.issues, arch.issues
    (gs,) = arch.gates
    assert gs.layer == "lstm" and gs.layer_kind == "lstm" and gs.gates == ["i", "f", "g", "o"]
    assert gs.hidden == 12 and gs.grad_steps == [15, 20, 25]
    assert abs(sum(gs.grad_share) - 1) < 1e-9 and min(gs.grad_share) > 0.01
    assert gs.bias_step == 25 and all(abs(b) < 1 for b in gs.bias_median)
    assert not _arch_issues(health(run))


def test_forget_gate_closed(tmp_path):
    url = str(tmp_path / "forget")
    train_lstm(url, gate_bias={"f": -8.0})
    rep = health(traintape.open_run(url))
    by = {lh.layer: lh for lh in rep.layers}
    hits = [i for i in by["lstm"].issues if i.type == IssueType.FORGET_GATE_CLOSED]
    assert len(hits) == 1 and hits[0].severity == "critical", by["lstm"].issues
    assert hits[0].evidence["forget_bias_median"] < -7
    assert "forget-gate bias to +1" in hits[0].recommendation
    # the closed forget gate is not reported a second time as saturated
    assert not any(
        i.type == IssueType.GATE_SATURATION and i.evidence["gate"] == "f" for i in by["lstm"].issues
    )


def test_saturated_input_gate(tmp_path):
    url = str(tmp_path / "input")
    train_lstm(url, gate_bias={"i": 12.0})
    rep = health(traintape.open_run(url))
    hits = [i for i in rep.issues() if i.type == IssueType.GATE_SATURATION]
    assert [(i.layer, i.evidence["gate"]) for i in hits] == [("lstm", "i")], hits
    assert hits[0].evidence["bias_median"] > 11
    assert hits[0].evidence["grad_share"] < 1e-3
    assert not rep.has(IssueType.FORGET_GATE_CLOSED)


def test_thresholds_are_configurable_and_json_roundtrips(tmp_path):
    from traintape.analysis import HealthReport, HealthThresholds

    url = str(tmp_path / "res")
    train_residual(url, steps=10)
    run = traintape.open_run(url)
    strict = ArchitectureThresholds(residual_factor=1.001, residual_total=1.001)
    rep = health(run, HealthThresholds(**strict.model_dump()))
    assert rep.has(IssueType.RESIDUAL_DECAY)
    back = HealthReport.model_validate_json(rep.model_dump_json())
    assert back.architecture is not None and back.architecture.residual == rep.architecture.residual
    assert np.isclose(back.thresholds.residual_factor, 1.001)


def test_without_snapshots_heads_are_skipped_with_a_note(tmp_path):
    url = str(tmp_path / "nosnap")
    train_transformer(url, steps=6, full_every=None)
    arch = architecture(traintape.open_run(url))
    assert arch.heads == [] and len(arch.blocks) == 3  # stats-based checks still run
    assert "attention heads: no grad snapshots of 'blocks/0/attn'" in arch.notes


def test_torch_encoder_and_gru_through_watch_are_healthy(tmp_path):
    url = str(tmp_path / "encgru")
    train_enc_gru(url)
    run = traintape.open_run(url)
    arch = architecture(run)
    assert not arch.issues, arch.issues
    # attention units sit where torch records the attention (its output), not at the end
    assert [u.unit for u in arch.units][:3] == [
        "enc/layers/0/self_attn", "enc/layers/0/linear1", "enc/layers/0/linear2",
    ]  # fmt: skip
    assert arch.blocks[0].ffn == ["enc/layers/0/linear1", "enc/layers/0/linear2"]
    assert len(arch.heads) == 3 and all(h.heads == 4 for h in arch.heads)
    (gru,) = arch.gates
    assert gru.gates == ["r", "z", "n"] and gru.grad_steps == [5, 10, 15]
    # GRU's reset gate gets little gradient by design; with an ordinary bias it is no issue
    assert gru.grad_share[0] < 0.05 and abs(gru.bias_median[0]) < 1
    assert not _arch_issues(health(run))


def test_saturated_gru_update_gate(tmp_path):
    url = str(tmp_path / "gru_z")
    train_enc_gru(url, z_bias=-12.0)  # z ≈ 0: h = n, no memory, and z stops learning
    rep = health(traintape.open_run(url))
    hits = [i for i in rep.issues() if i.type == IssueType.GATE_SATURATION]
    assert [(i.layer, i.evidence["gate"]) for i in hits] == [("gru", "z")], hits


def test_cli_health_json_and_html_report_show_architecture_issues(saturated_branch, tmp_path):
    import json

    from typer.testing import CliRunner

    from traintape.cli import app

    cli = CliRunner()
    r = cli.invoke(app, ["health", saturated_branch])
    assert r.exit_code == 1, r.output  # critical
    assert "BOTTLENECK blocks/3/fc1" in r.output and "saturated nonlinearity" in r.output
    j = cli.invoke(app, ["health", saturated_branch, "--json"])
    doc = json.loads(j.stdout)
    fc1 = next(x for x in doc["layers"] if x["layer"] == "blocks/3/fc1")
    assert [i["type"] for i in fc1["issues"]].count("BOTTLENECK") == 1
    assert doc["architecture"]["residual"][0]["stack"] == "blocks"
    # the thresholds are health thresholds (-t): a looser ratio clears the layer
    loose = ["-t", "bottleneck_ratio=1e-9", "-t", "bottleneck_ratio_critical=1e-10"]
    assert "BOTTLENECK" not in cli.invoke(app, ["health", saturated_branch, *loose]).output
    out = tmp_path / "r.html"
    rr = cli.invoke(app, ["report", saturated_branch, "-o", str(out)])
    assert rr.exit_code == 0, rr.output
    assert "BOTTLENECK" in out.read_text()


def test_bert_names_find_the_block_above_the_attention(tmp_path):
    url = str(tmp_path / "bert")
    train_transformer(url, bert_names=True, attn_scale=1e-3, steps=10)
    arch = architecture(traintape.open_run(url))
    b0 = arch.blocks[0]
    # BERT's attention sits in blocks/0/attention/{self,output}; its FFN in blocks/0
    assert b0.block == "blocks/0"
    assert b0.attention == [
        "blocks/0/attention/output/dense", "blocks/0/attention/self/key",
        "blocks/0/attention/self/query", "blocks/0/attention/self/value",
    ]  # fmt: skip
    assert b0.ffn == ["blocks/0/intermediate/dense", "blocks/0/output/dense"]
    hits = [i for i in arch.issues if i.type == "ATTENTION_FFN_IMBALANCE"]
    assert [i.layer for i in hits] == ["blocks/0", "blocks/1", "blocks/2"]
