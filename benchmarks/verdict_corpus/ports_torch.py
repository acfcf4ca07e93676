"""The compare corpus's architectures in PyTorch, and the training loop a user writes.

Module attribute paths are the canonical layer names (``blocks/0/attn/k``), the same
as the Flax NNX ports (:mod:`verdict_corpus.ports_jax`). A planted bug is one named
line (``bug == "..."``) in the model or the loop; ``bug=None`` is the correct port.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from verdict_corpus import arch as A

TORCH_BUGS = frozenset({
    "no_causal_mask", "attn_scale_1_over_d", "gelu_tanh", "transposed_q_kernel",
    "ln_eps_1e-6", "rms_eps_1e-5", "dropout_left_on", "labels_not_shifted",
    "wd_on_norms_and_biases", "nesterov", "bias_missing", "init_scale_x2",
    "schedule_off_by_one", "grad_accum_sum", "clip_threshold_1", "rope_interleaved",
    "softmax_wrong_axis", "bn_momentum_flax", "moe_gates_not_renormalised",
    "double_softmax", "tie_lost", "post_ln_as_pre_ln", "label_smoothing",
})  # fmt: skip
"""Bugs planted in the torch port (one line each; see :mod:`verdict_corpus.bugs`)."""


class BiasedBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose running variance is updated with the biased batch variance (the
    one it normalises with), as Flax and Keras do; torch's own uses the unbiased one —
    a real difference between the frameworks that a port has to bridge, as here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        mean = x.mean(dim=(0, 2, 3))
        var = x.var(dim=(0, 2, 3), unbiased=False)
        with torch.no_grad():
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            self.running_var.mul_(1 - m).add_(var.detach(), alpha=m)
        xhat = (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + self.eps)
        return xhat * self.weight[None, :, None, None] + self.bias[None, :, None, None]


def gelu(x: torch.Tensor, bug: str | None) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if bug == "gelu_tanh" else "none")


def rope(x: torch.Tensor, bug: str | None) -> torch.Tensor:
    """Rotary embedding on (B, H, T, dh), Llama's rotate_half convention."""
    cos, sin = (torch.from_numpy(a) for a in A.rope_tables(str(x.dtype)[6:]))
    h = x.shape[-1] // 2
    if bug == "rope_interleaved":  # GPT-J's pairs (2i, 2i+1) instead of halves
        rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * cos.to(x.dtype) + rot * sin.to(x.dtype)
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, bias: bool, causal: bool, use_rope: bool, bug: str | None) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(A.D, A.D, bias=bias) for _ in range(4))
        self.causal, self.use_rope, self.bug = causal, use_rope, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        dh = d // A.HEADS

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, A.HEADS, dh).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.use_rope:
            q, k = rope(q, self.bug), rope(k, self.bug)
        scale = 1.0 / d if self.bug == "attn_scale_1_over_d" else 1.0 / math.sqrt(dh)
        logits = (q @ k.transpose(-1, -2)) * scale
        if self.causal and self.bug != "no_causal_mask":
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            logits = logits.masked_fill(~mask, float("-inf"))
        w = torch.softmax(logits, dim=-2 if self.bug == "softmax_wrong_axis" else -1)
        return self.o((w @ v).transpose(1, 2).reshape(b, t, d))


class MLP2(nn.Module):
    """fc → GELU → proj (GPT/BERT/ViT)."""

    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.fc, self.proj, self.bug = nn.Linear(A.D, A.FF), nn.Linear(A.FF, A.D), bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(gelu(self.fc(x), self.bug))


class PreLNBlock(nn.Module):
    def __init__(self, causal: bool, bug: str | None, eps_bug: bool = False) -> None:
        super().__init__()
        eps = 1e-6 if eps_bug and bug == "ln_eps_1e-6" else A.LN_EPS
        self.ln1 = nn.LayerNorm(A.D, eps=eps)
        self.attn = Attention(True, causal, False, bug)
        self.ln2 = nn.LayerNorm(A.D, eps=A.LN_EPS)
        self.mlp = MLP2(bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, tied: bool, bug: str | None) -> None:
        super().__init__()
        self.wte = nn.Embedding(A.VOCAB, A.D)
        self.wpe = nn.Embedding(A.SEQ, A.D)
        self.blocks = nn.ModuleList(
            PreLNBlock(True, bug, eps_bug=i == 0) for i in range(A.N_LAYERS)
        )
        self.ln_f = nn.LayerNorm(A.D, eps=A.LN_EPS)
        self.head = nn.Linear(A.D, A.VOCAB, bias=not tied)
        if tied and bug != "tie_lost":
            self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1])
        x = self.wte(tokens) + self.wpe(pos)[None]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class PostLNBlock(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.attn = Attention(True, False, False, bug)
        self.ln1 = nn.LayerNorm(A.D, eps=A.LN_EPS)
        self.mlp = MLP2(bug)
        self.ln2 = nn.LayerNorm(A.D, eps=A.LN_EPS)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bug == "post_ln_as_pre_ln":
            x = x + self.attn(self.ln1(x))
        else:
            x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class BERT(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.tok = nn.Embedding(A.VOCAB, A.D)
        self.pos = nn.Embedding(A.SEQ, A.D)
        self.emb_ln = nn.LayerNorm(A.D, eps=A.LN_EPS)
        self.blocks = nn.ModuleList(PostLNBlock(bug) for _ in range(A.N_LAYERS))
        self.pooler = nn.Linear(A.D, A.D)
        self.cls = nn.Linear(A.D, A.N_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb_ln(self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))[None])
        for blk in self.blocks:
            x = blk(x)
        return self.cls(torch.tanh(self.pooler(x[:, 0])))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(A.D, A.FF, bias=False)
        self.up = nn.Linear(A.D, A.FF, bias=False)
        self.down = nn.Linear(A.FF, A.D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, bug: str | None, first: bool) -> None:
        super().__init__()
        eps = 1e-5 if first and bug == "rms_eps_1e-5" else A.RMS_EPS
        self.attn_norm = nn.RMSNorm(A.D, eps=eps)
        self.attn = Attention(False, True, True, bug)
        self.mlp_norm = nn.RMSNorm(A.D, eps=A.RMS_EPS)
        self.mlp = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(A.VOCAB, A.D)
        self.layers = nn.ModuleList(LlamaBlock(bug, i == 0) for i in range(A.N_LAYERS))
        self.norm = nn.RMSNorm(A.D, eps=A.RMS_EPS)
        self.lm_head = nn.Linear(A.D, A.VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.layers:
            x = blk(x)
        return self.lm_head(self.norm(x))


class ViT(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        n = (A.IMG // A.PATCH) ** 2
        self.patch = nn.Conv2d(A.IMG_C, A.D, A.PATCH, stride=A.PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, A.D))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, A.D))
        self.blocks = nn.ModuleList([PreLNBlock(False, bug)])
        self.ln = nn.LayerNorm(A.D, eps=A.LN_EPS)
        self.head = nn.Linear(A.D, A.N_CLASSES)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch(img.permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)  # (B, N, D)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x)[:, 0])


class BasicBlock(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        m = 0.9 if bug == "bn_momentum_flax" else A.BN_MOMENTUM_TORCH
        self.conv1 = nn.Conv2d(A.RES_C, A.RES_C, 3, padding=1, bias=False)
        self.bn1 = BiasedBatchNorm2d(A.RES_C, eps=A.BN_EPS, momentum=m)
        self.conv2 = nn.Conv2d(A.RES_C, A.RES_C, 3, padding=1, bias=False)
        self.bn2 = BiasedBatchNorm2d(A.RES_C, eps=A.BN_EPS, momentum=m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class ResNet(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        m = 0.9 if bug == "bn_momentum_flax" else A.BN_MOMENTUM_TORCH
        self.stem = nn.Conv2d(A.IMG_C, A.RES_C, 3, padding=1, bias=False)
        self.bn = BiasedBatchNorm2d(A.RES_C, eps=A.BN_EPS, momentum=m)
        self.block = BasicBlock(bug)
        self.fc = nn.Linear(A.RES_C, A.N_CLASSES)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(img.permute(0, 3, 1, 2))))
        return self.fc(self.block(x).mean(dim=(2, 3)))


class Conv1DNet(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(A.CONV_C, A.CONV_H, 3, padding=1)
        self.conv2 = nn.Conv1d(A.CONV_H, A.CONV_H, 3, padding=1, bias=bug != "bias_missing")
        self.head = nn.Linear(A.CONV_H, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x.transpose(1, 2)))))
        return self.head(h.mean(dim=2))


class RNN(nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        setattr(self, cell, rnn(A.RNN_IN, A.RNN_H, batch_first=True))
        self.cell = cell
        self.head = nn.Linear(A.RNN_H, A.N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, _ = getattr(self, self.cell)(x)
        return self.head(seq[:, -1])


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(A.D, A.FF), nn.Linear(A.FF, A.D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-2 of 4 experts, gates renormalised over the chosen two (Mixtral), computed
    densely (every expert on every token, weighted by its gate, 0 if not chosen)."""

    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.inp = nn.Linear(A.MOE_IN, A.D)
        self.router = nn.Linear(A.D, A.MOE_EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(A.MOE_EXPERTS))
        self.head = nn.Linear(A.D, 2)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        probs = torch.softmax(self.router(h), dim=-1)
        top, idx = torch.topk(probs, A.MOE_TOPK, dim=-1)
        if self.bug != "moe_gates_not_renormalised":
            top = top / top.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, idx, top)
        outs = torch.stack([e(h) for e in self.experts], dim=-1)  # (B, T, D, E)
        h = h + (outs * gates[..., None, :]).sum(dim=-1)
        return self.head(h.mean(dim=1))


class MLP(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        p = 0.1 if bug == "dropout_left_on" else 0.0  # the config's hidden_dropout
        self.fc1 = nn.Linear(A.MLP_IN, A.MLP_HIDDEN)
        self.drop1 = nn.Dropout(p)
        self.fc2 = nn.Linear(A.MLP_HIDDEN, A.MLP_HIDDEN)
        self.drop2 = nn.Dropout(p)
        self.head = nn.Linear(A.MLP_HIDDEN, A.N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop1(F.relu(self.fc1(x)))
        return self.head(self.drop2(F.relu(self.fc2(h))))


def build(arch: str, bug: str | None = None) -> nn.Module:
    if arch in ("gpt", "gpt_tied"):
        return GPT(arch == "gpt_tied", bug)
    if arch in ("lstm", "gru"):
        return RNN(arch)
    cls = {"bert": BERT, "llama": Llama, "vit": ViT, "resnet": ResNet, "conv1d": Conv1DNet,
           "moe": MoE, "mlp": MLP}[arch]  # fmt: skip
    return cls(bug)


def canonical_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    """Canonical name → shape of every parameter and recorded buffer of the correct port."""
    import traintape.torch as ttt

    return {n: tuple(a.shape) for n, a in ttt.to_canonical(build(arch)).items()}


def loss_fn(arch: str, out: torch.Tensor, y: torch.Tensor, bug: str | None) -> torch.Tensor:
    task = A.TASK[arch]
    if task == "lm":
        if bug == "labels_not_shifted":
            logits, labels = out, y
        else:
            logits, labels = out[:, :-1], y[:, 1:]
        return F.cross_entropy(logits.reshape(-1, A.VOCAB), labels.reshape(-1).long())
    if task.startswith("cls"):
        if bug == "double_softmax":
            out = torch.softmax(out, dim=-1)
        smoothing = 0.1 if bug == "label_smoothing" else 0.0
        return F.cross_entropy(out, y.long(), label_smoothing=smoothing)
    return F.mse_loss(out, y)


def _optimizer(model: nn.Module, recipe: A.Recipe, bug: str | None) -> torch.optim.Optimizer:
    import traintape.torch as ttt

    if recipe.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=A.MOMENTUM,
                               nesterov=bug == "nesterov")  # fmt: skip
    if recipe.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=recipe.lr, betas=A.ADAM_BETAS,
                                eps=A.ADAM_EPS)  # fmt: skip
    # AdamW with the usual no-decay group (biases, norm scales), by canonical name
    names = {id(t): n for n, t in _canonical_tensors(model).items()}
    decay, rest = [], []
    for p in model.parameters():
        if bug == "wd_on_norms_and_biases" or not A.no_decay(names[id(p)]):
            decay.append(p)
        else:
            rest.append(p)
    del ttt
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": A.WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
        lr=recipe.lr, betas=A.ADAM_BETAS, eps=A.ADAM_EPS,
    )  # fmt: skip


def _canonical_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name → the torch parameter it is read from."""
    from traintape.adapters.torch.names import model_layout

    return {e.name: e.tensor() for e in model_layout(model, None, warn=False).entries}


def train(
    arch: str, url: str, dtype: str, recipe_name: str, bug: str | None = None,
    steps: int = A.STEPS, micro_batches: int = 1, bf16: bool = False,
) -> None:  # fmt: skip
    """Train the torch port of ``arch`` from the canonical initial weights, recording
    into ``url`` with ``traintape.torch.watch(model, rec, optimizer=opt)``.

    ``micro_batches``: gradient accumulation, each micro-batch's loss divided by their
    number. ``bf16``: forward and loss under ``torch.autocast('cpu', bfloat16)``.
    """
    import traintape
    import traintape.torch as ttt

    recipe = A.RECIPES[recipe_name]
    torch.manual_seed(0)
    tdt = getattr(torch, dtype)
    model = build(arch, bug).to(tdt)
    shapes = canonical_shapes(arch)
    w = A.initial_weights(arch, shapes, dtype)
    if bug == "bias_missing":
        w.pop("conv2/bias")
    if bug == "tie_lost":  # the head copied from the embedding instead of tied to it
        w["head/kernel"] = w["wte/embedding"].T.copy()
    ttt.from_canonical(model, w, strict=True)
    if bug == "transposed_q_kernel":  # weights ported by hand: W copied, not W.T
        with torch.no_grad():
            q = model.blocks[0].attn.q.weight
            q.copy_(q.T.clone())
    if bug == "init_scale_x2":
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight.mul_(2.0)
    opt = _optimizer(model, recipe, bug)
    sched = None
    if recipe.schedule:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: float(A.lr_factor(t)))
    x, y = A.batches(arch, dtype, steps)
    kinds = ["param", "grad", "update", "activation"]
    if recipe.records_opt_state:
        kinds.append("opt_state")
    policy = traintape.CapturePolicy(every=1, full_every=A.FULL_EVERY, kinds=tuple(kinds),
                                     snapshot_kinds=("param", "grad", "update"))  # fmt: skip
    with traintape.Recorder(url, policy=policy) as rec, ttt.watch(model, rec, optimizer=opt):
        model.train()
        for t in range(steps):
            opt.zero_grad()
            total = 0.0
            parts = zip(np.array_split(x[t], micro_batches), np.array_split(y[t], micro_batches),
                        strict=True)  # fmt: skip
            for xb, yb in parts:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(torch.from_numpy(xb))
                    loss = loss_fn(arch, out.float() if bf16 else out, torch.from_numpy(yb), bug)
                if bug != "grad_accum_sum":
                    loss = loss / micro_batches
                loss.backward()
                total += float(loss.detach())
            if recipe.clip is not None:
                clip = 1.0 if bug == "clip_threshold_1" else recipe.clip
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if sched is not None and bug == "schedule_off_by_one":
                sched.step()  # before opt.step(): step t runs at the factor of t + 1
            opt.step()
            if sched is not None and bug != "schedule_off_by_one":
                sched.step()
            rec.log(t, {"train/loss": total})
