"""Small real PyTorch trainings for the health corpus, recorded with ``traintape.torch.watch``.

:func:`train` is the one training loop of the torch cases (``zero_grad`` → forward →
``backward`` → optional ``clip_grad_norm_`` → ``step``, loss logged as the metric ``loss``
at the step it was computed on); the data helpers make synthetic tasks a small net can
learn to a low loss in a few hundred steps on CPU (a fixed pool of examples labelled by
a random teacher, drawn in shuffled batches).
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import traintape
import traintape.torch as tt

Batch = tuple[Any, torch.Tensor]


def fresh(path: Path) -> str:
    """``path`` emptied (a previous store of the same case is replaced), as a string."""
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread (the recorded numbers do not depend on the machine's
    core count), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def policy(full_every: int | None = 25) -> traintape.CapturePolicy:
    """Stats every step, snapshots every ``full_every`` steps (the head and gate checks
    of ``health`` read snapshots)."""
    return traintape.CapturePolicy(full_every=full_every)


def train(
    url: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Callable[[int], Batch],
    loss_fn: Callable[[nn.Module, Any, torch.Tensor], torch.Tensor],
    steps: int,
    *,
    clip: float | None = None,
    zero_grad: bool = True,
    train_mode: bool = True,
    full_every: int | None = 25,
    user: dict[str, Any] | None = None,
    before_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Train ``model`` for ``steps`` optimizer steps, recording into ``url``; the losses.

    ``zero_grad=False`` plants the forgotten ``opt.zero_grad()``; ``train_mode=False``
    trains a model left in ``eval()`` mode; ``before_step(t)`` runs before batch ``t``.
    """
    model.train(train_mode)
    losses: list[float] = []
    with (
        one_thread(),
        traintape.Recorder(url, policy(full_every), user=user) as rec,
        tt.watch(model, rec, optimizer=opt),
    ):
        for t in range(steps):
            if before_step is not None:
                before_step(t)
            x, y = batch(t)
            if zero_grad:
                opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, x, y)
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(float(loss.detach()))
            rec.log(t, loss=losses[-1])
    return losses


def ce(model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``model(x)`` (logits ``[batch, classes]``) against labels ``y``."""
    return nn.functional.cross_entropy(model(x), y)


def mse(model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def teacher_task(
    n_in: int, n_cls: int, *, pool: int = 2048, seed: int = 0, hidden: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of Gaussian inputs ``[pool, n_in]`` labelled by a random tanh teacher MLP
    (``argmax``); a small MLP fits it to a low training loss."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pool, n_in, generator=g)
    w1 = torch.randn(n_in, hidden, generator=g) / n_in**0.5
    w2 = torch.randn(hidden, n_cls, generator=g) / hidden**0.5
    y = (torch.tanh(x @ w1) @ w2).argmax(-1)
    return x, y


def teacher_regression(
    n_in: int, n_out: int, *, pool: int = 2048, seed: int = 0, hidden: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of Gaussian inputs ``[pool, n_in]`` and targets ``[pool, n_out]`` of a random
    tanh teacher MLP (outputs of unit scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pool, n_in, generator=g)
    w1 = torch.randn(n_in, hidden, generator=g) / n_in**0.5
    w2 = torch.randn(hidden, n_out, generator=g) / hidden**0.5
    return x, torch.tanh(x @ w1) @ w2


def shuffled(x: Any, y: torch.Tensor, batch: int, seed: int = 1) -> Callable[[int], Batch]:
    """Batch ``t`` of an epoch-wise shuffled pass over the pool ``(x, y)``; ``x`` a tensor
    or a tuple of tensors with the pool on axis 0."""
    n = len(y)
    per_epoch = n // batch
    rng = np.random.default_rng(seed)
    perms: list[np.ndarray] = []

    def get(t: int) -> Batch:
        e, i = divmod(t, per_epoch)
        while len(perms) <= e:
            perms.append(rng.permutation(n))
        idx = torch.as_tensor(perms[e][i * batch : (i + 1) * batch])
        xs = tuple(a[idx] for a in x) if isinstance(x, tuple) else x[idx]
        return xs, y[idx]

    return get


def in_order(x: torch.Tensor, y: torch.Tensor, batch: int) -> Callable[[int], Batch]:
    """Batch ``t`` of the pool sorted by label and never shuffled (``shuffle=False`` on a
    dataset stored class by class): consecutive batches hold one class."""
    order = torch.argsort(y, stable=True)
    x, y = x[order], y[order]
    per_epoch = len(y) // batch

    def get(t: int) -> Batch:
        i = t % per_epoch
        return x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]

    return get


def mlp(sizes: list[int], act: type[nn.Module] = nn.ReLU, seed: int = 0) -> nn.Sequential:
    """``nn.Sequential`` of Linear layers with ``act`` between them (layers ``0``, ``2``, ...)."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        mods.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            mods.append(act())
    return nn.Sequential(*mods)
