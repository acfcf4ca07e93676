"""Planted pathologies of the health corpus: the trainings of :mod:`.healthy` (or their
like) with one mistake people make. Each case says which issue concept(s) of
:data:`~verdict_corpus.health_case.ISSUE_TYPES` must be found, and on which layer(s).

Every ``record_*`` function trains for real, records with a traintape adapter into
``workdir/<case name>`` and returns that path.
"""

from __future__ import annotations

from pathlib import Path

from .health_case import HealthCase

# ---------------------------------------------------------------- torch MLPs


def record_vanishing_deep_sigmoid(workdir: Path) -> Path:
    """A 10-layer sigmoid MLP (default init), SGD lr 0.1: the gradient reaching the first
    layers is orders of magnitude below the last one's (sigmoid' <= 1/4 per layer)."""
    import torch
    from torch import nn

    from . import torch_training as T

    out = workdir / "vanishing_deep_sigmoid"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16] + [32] * 9 + [4], act=nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 120)
    return out


def record_exploding_lr(workdir: Path) -> Path:
    """The healthy ``mlp_regression_sgd`` run with lr 5.0 (100x its 0.05): the weights
    and gradients grow geometrically until they overflow."""
    import torch
    from torch import nn

    from . import torch_training as T

    out = workdir / "exploding_lr"
    x, y = T.teacher_regression(16, 4)
    model = T.mlp([16, 64, 64, 4], act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=5.0, momentum=0.9)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.mse, 80)
    return out


def record_dead_relu(workdir: Path) -> Path:
    """The ``mlp_adam`` MLP whose second hidden layer's bias starts at -10 (a bad bias
    init): its ReLUs never fire, layer ``2`` gets exactly zero gradient and so does
    everything before it; only the head learns (the bias)."""
    import torch

    from . import torch_training as T

    out = workdir / "dead_relu"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    with torch.no_grad():
        model[2].bias.fill_(-10.0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 150)
    return out


def record_zero_grad_forgotten(workdir: Path) -> Path:
    """The ``mlp_adam`` MLP trained with SGD lr 0.02 momentum 0.9 and no
    ``opt.zero_grad()``: ``p.grad`` is the sum of every gradient so far, so the step
    grows with t (issue 24: health said "healthy")."""
    import torch

    from . import torch_training as T

    out = workdir / "zero_grad_forgotten"
    x, y = T.teacher_task(16, 4)
    model = T.mlp([16, 64, 64, 4])
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    T.train(T.fresh(out), model, opt, T.shuffled(x, y, 64), T.ce, 150, zero_grad=False)
    return out


CASES: list[HealthCase] = [
    HealthCase("vanishing_deep_sigmoid", "pathology", "torch", record_vanishing_deep_sigmoid,
               "10-layer sigmoid MLP", expect=("vanishing",), layers=("0", "2", "4"),
               quick=True),
    HealthCase("exploding_lr", "pathology", "torch", record_exploding_lr,
               "SGD lr 100x too large", expect=("exploding",), quick=True),
    HealthCase("dead_relu", "pathology", "torch", record_dead_relu,
               "hidden bias init -10: ReLUs never fire", expect=("dead",), layers=("2",)),
    HealthCase("zero_grad_forgotten", "pathology", "torch", record_zero_grad_forgotten,
               "opt.zero_grad() forgotten", expect=("accumulating_grad",), quick=True),
]  # fmt: skip
