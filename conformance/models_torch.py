"""The conformance models in PyTorch (module attribute names = canonical layer names).

Inputs arrive channels-last (canonical); the CNN permutes to NCHW itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conformance import spec as S


class BiasedBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose running variance is updated with the *biased* batch variance.

    torch's BatchNorm updates ``running_var`` with the unbiased variance (n/(n-1)),
    Keras and Flax with the biased one (the one used to normalise). This is a genuine
    difference of the frameworks' BatchNorm, not of the adapters; the conformance CNN
    uses Keras/Flax's convention in torch so the running statistics can be compared.
    """

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


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation, with the conformance constants (see spec.GELU_C)."""
    return 0.5 * x * (1.0 + torch.tanh(S.GELU_C * (x + S.GELU_A * x * x * x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(S.MLP_IN, S.MLP_HIDDEN)
        self.head = nn.Linear(S.MLP_HIDDEN, S.MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(S.CNN_C, S.CNN_F1, 3, padding=1, bias=False)  # explicit padding 1
        self.bn1 = BiasedBatchNorm2d(S.CNN_F1, eps=S.BN_EPS, momentum=S.BN_MOMENTUM_TORCH)
        self.head = nn.Linear(S.CNN_F1, S.CNN_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x.permute(0, 3, 1, 2))  # NHWC -> NCHW
        h = F.avg_pool2d(F.relu(self.bn1(h)), 2)
        return self.head(h.mean(dim=(2, 3)))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(S.TF_VOCAB, S.TF_D)
        self.ln1 = nn.LayerNorm(S.TF_D, eps=S.LN_EPS)
        self.attn = nn.MultiheadAttention(S.TF_D, S.TF_HEADS, bias=False, batch_first=True)
        self.ln2 = nn.LayerNorm(S.TF_D, eps=S.LN_EPS)
        self.fc1 = nn.Linear(S.TF_D, S.TF_FF)
        self.fc2 = nn.Linear(S.TF_FF, S.TF_D)
        self.head = nn.Linear(S.TF_D, S.TF_OUT)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens.long())
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h = self.ln2(x)
        x = x + self.fc2(gelu(self.fc1(h)))
        return self.head(x.mean(dim=1))


class GRUModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(S.GRU_IN, S.GRU_H, batch_first=True)
        self.head = nn.Linear(S.GRU_H, S.GRU_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, _ = self.gru(x)
        return self.head(seq[:, -1])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal scaled dot-product attention over (B, T, D) projections with rotary
    embeddings on q and k (``spec.rope_tables``), written out (head h = features
    h*dh:(h+1)*dh; masked logits -inf)."""
    b, t, d = q.shape
    dh = d // heads

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(b, t, heads, dh)

    cos, sin = (torch.from_numpy(a)[:, None, :] for a in S.rope_tables(str(q.dtype)[6:]))

    def rope(x: torch.Tensor) -> torch.Tensor:  # Llama's rotate_half convention
        h = dh // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin

    logits = torch.einsum("bqhd,bkhd->bhqk", rope(split(q)) / math.sqrt(dh), rope(split(k)))
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    w = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", w, split(v)).reshape(b, t, d)


class CausalSelfAttention(nn.Module):
    """Llama-style attention: separate bias-free q/k/v/o projections, rotary q and k."""

    def __init__(self) -> None:
        super().__init__()
        d = S.LLM_D
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(causal_attention(self.q(x), self.k(x), self.v(x), S.LLM_HEADS))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(S.LLM_D, S.LLM_FF, bias=False)
        self.up = nn.Linear(S.LLM_D, S.LLM_FF, bias=False)
        self.down = nn.Linear(S.LLM_FF, S.LLM_D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        return self.down(g * torch.sigmoid(g) * self.up(x))


class LLMBlock(nn.Module):
    """The ``llm`` model: one pre-norm decoder block between an embedding and lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(S.LLM_VOCAB, S.LLM_D)
        self.attn_norm = nn.RMSNorm(S.LLM_D, eps=S.RMS_EPS)
        self.attn = CausalSelfAttention()
        self.mlp_norm = nn.RMSNorm(S.LLM_D, eps=S.RMS_EPS)
        self.mlp = SwiGLU()
        self.norm = nn.RMSNorm(S.LLM_D, eps=S.RMS_EPS)
        self.lm_head = nn.Linear(S.LLM_D, S.LLM_VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.long())
        x = x + self.attn(self.attn_norm(x))
        x = x + self.mlp(self.mlp_norm(x))
        return self.lm_head(self.norm(x))


BUILDERS = {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "gru": GRUModel,
            "llm": LLMBlock}  # fmt: skip


def train(
    model_name: str,
    url: str,
    dtype: str,
    steps: int = S.STEPS,
    *,
    weights: dict[str, Any] | None = None,
    mutate: Callable[[nn.Module], None] | None = None,
    boundaries: str | None = None,
    optimizer: str = "sgd",
    parallel: str | None = None,
    before_step: Callable[[nn.Module, int], None] | None = None,
) -> None:
    """Train ``model_name`` for ``steps`` SGD-momentum steps, recording into ``url``.

    ``boundaries``: ``'step'`` watches without the optimizer and calls
    ``handle.step()`` after each update; ``'optimizer'`` uses the optimizer's step hooks
    (and records ``opt_state``, which needs the optimizer). Both take step t's ``param``
    — BatchNorm running statistics included — before batch t's forward pass, as Keras
    and JAX record it (a test checks the two stores agree). Default: ``'optimizer'`` for
    Adam (whose ``opt_state`` the Adam cells compare), ``'step'`` for SGD.
    ``weights`` (default :func:`conformance.spec.initial_weights`), ``mutate`` (called
    on the loaded model) and ``before_step`` (called with the model and t between
    ``backward`` and ``opt.step``) exist for the negative controls.
    ``parallel`` (``'ddp'`` or ``'fsdp2'``, in an initialised process group): the model is
    wrapped and each rank trains on its rows of every batch (:func:`parallelize`).
    """
    import traintape.torch as ttt
    from conformance.policy import recorder

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    tdt = getattr(torch, dtype)
    model = BUILDERS[model_name]().to(tdt)
    w = S.initial_weights(model_name, dtype) if weights is None else weights
    ttt.from_canonical(model, w, strict=True)
    if mutate is not None:
        mutate(model)
    x, y = S.batches(model_name, dtype)
    rows = slice(None)
    if parallel is not None:
        model, rows = parallelize(model, parallel)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=S.LR, momentum=S.MOMENTUM)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=S.ADAM_LR, betas=(S.ADAM_B1, S.ADAM_B2),
                               eps=S.ADAM_EPS)  # fmt: skip
    else:
        raise ValueError(optimizer)
    probe = torch.from_numpy(S.probe(model_name, dtype))
    if boundaries is None:
        boundaries = "optimizer" if optimizer == "adam" else "step"
    if boundaries not in ("step", "optimizer"):
        raise ValueError(boundaries)
    hooked = opt if boundaries == "optimizer" else None
    with (
        recorder(url, model_name, optimizer) as rec,
        ttt.watch(model, rec, optimizer=hooked, probe=probe) as handle,
    ):
        model.train()
        for t in range(steps):
            opt.zero_grad()
            out = model(torch.from_numpy(x[t][rows]))
            loss = F.mse_loss(out, torch.from_numpy(y[t][rows]))
            loss.backward()
            if before_step is not None:
                before_step(model, t)
            opt.step()
            if hooked is None:
                handle.step()


def parallelize(model: nn.Module, how: str) -> tuple[nn.Module, slice]:
    """Wrap ``model`` for the initialised process group (``'ddp'``:
    ``DistributedDataParallel``; ``'fsdp2'``: ``fully_shard`` on every child with
    parameters, then the root) and return it with this rank's rows of a batch (the mean
    loss over them, averaged over ranks, is the global batch's)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    per = S.BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model), rows
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, rows
    raise ValueError(f"parallel: {how!r} (use 'ddp' or 'fsdp2')")
