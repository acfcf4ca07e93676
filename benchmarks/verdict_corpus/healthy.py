"""Healthy trainings of the health corpus: real models trained the way users train them,
each reaching a low loss. The right verdict: no critical, no warning (info is fine).

Every ``record_*`` function trains for real, records with a traintape adapter into
``workdir/<case name>`` and returns that path.
"""

from __future__ import annotations

import os
from pathlib import Path

from .health_case import HealthCase

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("USE_TF", "0")  # transformers: torch only (Keras 3 is installed)
os.environ.setdefault("WANDB_MODE", "offline")


# ---------------------------------------------------------------- torch: small nets


def record_mlp_adam(workdir: Path) -> Path:
    """A 3-layer ReLU MLP on a teacher classification task, Adam 3e-3, 300 steps."""
    import torch

    from . import torch_training as T

    out = workdir / "mlp_adam"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 300)
    return out


def record_mlp_regression_sgd(workdir: Path) -> Path:
    """A 3-layer tanh MLP regressing a teacher's outputs (MSE), SGD lr 0.05 momentum 0.9,
    300 steps."""
    import torch
    from torch import nn

    from . import torch_training as T

    out = workdir / "mlp_regression_sgd"
    x, y = T.teacher_regression(16, 4)
    model = T.mlp([16, 64, 64, 4], act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.mse, 300)
    return out


def _images(n: int = 1024, seed: int = 0, size: int = 12, classes: int = 4):
    """``[n, 1, size, size]`` images: one of ``classes`` random ±1 templates, rolled by up
    to 2 pixels each way, plus Gaussian noise (std 0.5); labels ``[n]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    templates = torch.sign(torch.randn(classes, size, size, generator=g))
    y = torch.randint(0, classes, (n,), generator=g)
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    x = torch.stack(
        [
            torch.roll(templates[c], (int(s[0]), int(s[1])), (0, 1))
            for c, s in zip(y, shifts, strict=True)
        ]
    )
    x = x + 0.5 * torch.randn(x.shape, generator=g)
    return x[:, None], y


def cnn(seed: int = 0):
    """Conv-BN-ReLU ×2, global average pool, linear head (layers ``0``, ``1``, ``4``,
    ``5``, ``9``)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip


def record_cnn_bn_sgd(workdir: Path) -> Path:
    """A small CNN with BatchNorm, SGD momentum 0.9 lr 0.05, 200 steps of 64 images."""
    import torch

    from . import torch_training as T

    out = workdir / "cnn_bn_sgd"
    x, y = _images()
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 200)
    return out


def _sign_sequences(n: int = 2048, length: int = 10, feat: int = 4, seed: int = 0):
    """``[n, length, feat]`` Gaussian sequences; label 1 when the sum over time of feature
    0 is positive (the net must integrate over the whole sequence)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, feat, generator=g)
    return x, (x[:, :, 0].sum(1) > 0).long()


class _LSTMClassifier:  # built lazily (torch imported inside the case)
    @staticmethod
    def build(seed: int = 0, forget_bias: float | None = None):
        import torch
        from torch import nn

        class LSTMClassifier(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lstm = nn.LSTM(4, 32, batch_first=True)
                self.head = nn.Linear(32, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h, _ = self.lstm(x)
                return self.head(h[:, -1])

        torch.manual_seed(seed)
        m = LSTMClassifier()
        if forget_bias is not None:  # gate order i, f, g, o; bias_ih + bias_hh
            with torch.no_grad():
                for b in (m.lstm.bias_ih_l0, m.lstm.bias_hh_l0):
                    b[32:64] = forget_bias / 2
        return m


def record_lstm(workdir: Path) -> Path:
    """An LSTM classifier (sum of a feature over 10 steps > 0), Adam 1e-2, 250 steps."""
    import torch

    from . import torch_training as T

    out = workdir / "lstm"
    x, y = _sign_sequences()
    model = _LSTMClassifier.build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 250)
    return out


# ---------------------------------------------------------------- transformers


def _token_task(n: int = 2048, length: int = 12, vocab: int = 32, token: int = 5, seed: int = 0):
    """``[n, length]`` token ids (position 0 is the ``[CLS]`` id 1, the rest uniform over
    ``2..vocab-1``); label 1 when ``token`` occurs (attention must find it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, length), generator=g)
    ids[:, 0] = 1
    return ids, (ids[:, 1:] == token).any(1).long()


def tiny_bert(seed: int = 0, num_labels: int = 2):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=num_labels,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg)


def _logits_ce(model, x, y):
    import torch

    return torch.nn.functional.cross_entropy(model(input_ids=x).logits, y)


def record_bert_from_init(workdir: Path) -> Path:
    """HF ``BertForSequenceClassification`` from a tiny config (2 layers, 2 heads, hidden
    32), AdamW 1e-3 (weight decay 0.01) with ``clip_grad_norm_(1.0)``, 200 steps: the run
    issue 24 found called critical (VANISHING on every q/k/LayerNorm)."""
    import torch

    from . import torch_training as T

    out = workdir / "bert_from_init"
    x, y = _token_task()
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 32), _logits_ce, 200, clip=1.0,
            user={"attention_heads": 2})  # fmt: skip
    return out


CASES: list[HealthCase] = [
    HealthCase("mlp_adam", "healthy", "torch", record_mlp_adam,
               "ReLU MLP, Adam, teacher task", max_final_loss=0.3, quick=True),
    HealthCase("mlp_regression_sgd", "healthy", "torch", record_mlp_regression_sgd,
               "tanh MLP regression, SGD momentum", max_final_loss=0.05),
    HealthCase("cnn_bn_sgd", "healthy", "torch", record_cnn_bn_sgd,
               "CNN with BatchNorm, SGD momentum", max_final_loss=0.3),
    HealthCase("lstm", "healthy", "torch", record_lstm,
               "LSTM classifier, Adam", max_final_loss=0.3),
    HealthCase("bert_from_init", "healthy", "torch+transformers", record_bert_from_init,
               "tiny BERT from init, AdamW + clip_grad_norm_(1.0)", max_final_loss=0.3,
               quick=True),
]  # fmt: skip
