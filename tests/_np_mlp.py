"""A tiny numpy MLP trained for real (manual backprop, SGD) and recorded with traintape,
with knobs to plant a defect in one layer at chosen steps (for the health tests; a
planted divergence overflows quietly).

The model: ``layers/<i>`` Dense (kernel (in, out) + bias), tanh between layers, linear
output, mean-squared error on a fixed random regression task. Recorded per step t:
param θ_t, grad ∇L(θ_t), update θ_{t+1} − θ_t, the activation ``layers/<i>/output`` and
the loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

import traintape


def train(
    url: str,
    sizes: Sequence[int] = (8, 32, 32, 4),
    *,
    steps: int = 120,
    lr: float = 0.05,
    seed: int = 0,
    batch: int = 32,
    lr_mult: Callable[[int, int], float] | None = None,
    frozen: Sequence[int] = (),
    batch_scale: Callable[[int], float] | None = None,
    prefix: str = "layers",
) -> list[float]:
    """Train and record into ``url``; returns the losses.

    ``lr_mult(step, layer)`` scales layer ``layer``'s learning rate at ``step``;
    ``frozen`` layers get zero gradients (a stop-gradient left on them) and never move;
    ``batch_scale(step)`` scales that step's inputs (an outlier batch); ``prefix``
    replaces ``layers`` in the tensor names.
    """
    rng = np.random.default_rng(seed)
    n = len(sizes) - 1
    params: dict[str, np.ndarray] = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        params[f"{i}/kernel"] = rng.standard_normal((a, b)) * np.sqrt(2.0 / (a + b))
        params[f"{i}/bias"] = np.zeros(b)
    w_true = rng.standard_normal((sizes[0], sizes[-1]))
    losses = []
    with traintape.Recorder(url, flush_every_steps=64) as rec, np.errstate(all="ignore"):
        for t in range(steps):
            x = rng.standard_normal((batch, sizes[0]))
            y = np.tanh(x @ w_true)
            if batch_scale is not None:
                x = x * batch_scale(t)
            hs = [x]
            for i in range(n):
                z = hs[-1] @ params[f"{i}/kernel"] + params[f"{i}/bias"]
                hs.append(np.tanh(z) if i < n - 1 else z)
            diff = hs[-1] - y
            losses.append(float(np.mean(diff**2)))
            grads: dict[str, np.ndarray] = {}
            d = 2 * diff / diff.size
            for i in reversed(range(n)):
                grads[f"{i}/kernel"] = hs[i].T @ d
                grads[f"{i}/bias"] = d.sum(axis=0)
                if i:
                    d = (d @ params[f"{i}/kernel"].T) * (1 - hs[i] ** 2)
            for i in frozen:
                grads[f"{i}/kernel"] = np.zeros_like(grads[f"{i}/kernel"])
                grads[f"{i}/bias"] = np.zeros_like(grads[f"{i}/bias"])
            new = {}
            for k, v in params.items():
                i = int(k.split("/")[0])
                new[k] = v - lr * (lr_mult(t, i) if lr_mult else 1.0) * grads[k]

            def named(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                return {f"{prefix}/{k}": np.asarray(v, np.float32) for k, v in d.items()}

            rec.record(t, "param", named(params))
            rec.record(t, "activation", named({f"{i}/output": hs[i + 1] for i in range(n)}))
            rec.record(t, "grad", named(grads))
            rec.record(t, "update", named({k: new[k] - params[k] for k in params}))
            rec.log(t, loss=losses[-1])
            params = new
    return losses
