"""Tiny real trainings (JAX, plain SGD) recorded with the core Recorder, for analysis tests.

Each model is an MLP ``layers/<i>`` (Dense kernel (in, out) + bias) trained on a fixed
synthetic regression/classification task with ``jax.grad`` and plain SGD. Recorded per
step t: param θ_t, grad ∇L(θ_t), update θ_{t+1} − θ_t, activation (post-nonlinearity output
of each layer on batch t, as ``layers/<i>/output``) and the loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import traintape
from traintape import CapturePolicy

ACTS: dict[str, Callable] = {
    "sigmoid": jax.nn.sigmoid,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
}


def init_mlp(sizes: list[int], seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Canonical-name params: ``layers/<i>/kernel`` (in, out) Glorot-normal, ``bias`` 0."""
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        std = scale * np.sqrt(2.0 / (a + b))
        params[f"layers/{i}/kernel"] = (rng.standard_normal((a, b)) * std).astype(np.float32)
        params[f"layers/{i}/bias"] = np.zeros(b, np.float32)
    return params


def mlp_forward(params, x, act: str = "relu", n_layers: int | None = None):
    """Forward pass; returns ``(output, [post-activation output of each hidden layer])``."""
    n = n_layers or len([k for k in params if k.endswith("/kernel")])
    f = ACTS[act]
    outs = []
    h = x
    for i in range(n):
        h = h @ params[f"layers/{i}/kernel"] + params[f"layers/{i}/bias"]
        if i < n - 1:
            h = f(h)
        outs.append(h)
    return h, outs


def train_mlp(
    url: str,
    sizes: list[int],
    *,
    act: str = "relu",
    steps: int = 30,
    lr: float = 0.05,
    seed: int = 0,
    init_scale: float = 1.0,
    bias_init: dict[int, float] | None = None,
    nan_at: tuple[int, str] | None = None,
    full_every: int | None = None,
    batch: int = 32,
    perturb: tuple[int, str, float] | None = None,
    input_scale: float = 1.0,
) -> dict[str, np.ndarray]:
    """Train an MLP for real and record it into ``url``; returns the final params.

    ``nan_at=(k, name)`` writes a NaN into parameter ``name`` before step ``k``;
    ``perturb=(k, name, eps)`` adds ``eps`` to element 0 of ``name`` before step ``k``.
    """
    params = init_mlp(sizes, seed, init_scale)
    for i, b in (bias_init or {}).items():
        params[f"layers/{i}/bias"] = np.full_like(params[f"layers/{i}/bias"], b)
    n = len(sizes) - 1
    rng = np.random.default_rng(seed + 1)
    w_true = rng.standard_normal((sizes[0], sizes[-1])).astype(np.float32)
    xs = rng.standard_normal((steps, batch, sizes[0])).astype(np.float32)
    ys = np.tanh(xs @ w_true).astype(np.float32)
    xs *= np.float32(input_scale)

    def loss_fn(p, x, y):
        out, acts = mlp_forward(p, x, act, n)
        return jnp.mean((out - y) ** 2), acts

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    policy = CapturePolicy(full_every=full_every)
    with traintape.Recorder(url, policy, flush_every_steps=16) as rec:
        rec.set_producer(framework="jax", framework_version=jax.__version__, adapter="tests")
        for t in range(steps):
            if nan_at is not None and t == nan_at[0]:
                params[nan_at[1]] = params[nan_at[1]].copy()
                params[nan_at[1]].flat[0] = np.nan
            if perturb is not None and t == perturb[0]:
                params[perturb[1]] = params[perturb[1]].copy()
                params[perturb[1]].flat[0] += perturb[2]
            (loss, acts), grads = grad_fn(params, xs[t], ys[t])
            grads = {k: np.asarray(v) for k, v in grads.items()}
            new = {k: (params[k] - lr * grads[k]).astype(np.float32) for k in params}
            rec.record(t, "param", params)
            rec.record(
                t, "activation", {f"layers/{i}/output": np.asarray(a) for i, a in enumerate(acts)}
            )
            rec.record(t, "grad", grads)
            rec.record(t, "update", {k: new[k] - params[k] for k in params})
            rec.log(t, loss=float(loss), lr=lr)
            params = new
    return params
