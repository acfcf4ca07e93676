"""Sparse-update quality: would a sparse update have done the same as the full one?

Given a forward function, old parameters ``θ_old`` and an update ``Δ`` (e.g. from two
param snapshots of a run), compare the outputs of ``θ_old + Δ`` (the reference) with

- ``θ_old + Δ ⊙ [|Δ| > thr]`` for each threshold (the *magnitude* mask), and
- ``θ_old + Δ ⊙ R`` with ``R`` a random mask keeping the same number of entries per
  tensor (the *random* control).

Metrics per variant: ``kl`` = mean KL(softmax(ref) ‖ softmax(variant)) over the last axis
(nats), ``cosine`` of the flattened outputs, ``mse``, ``top1`` agreement of argmax over the
last axis, and ``kept`` = fraction of Δ entries kept.

``forward`` may be any Python callable ``params -> outputs`` where ``params`` has the same
structure as ``params_old`` (a dict of numpy/JAX arrays or nested dicts/lists thereof), or a
``torch.nn.Module``: then ``params_old``/``delta`` map its ``named_parameters()`` names to
arrays and the module is called with ``torch.func.functional_call``. No framework is
imported unless a torch module is passed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis.change import DEFAULT_THRESHOLDS


class OutputAgreement(BaseModel):
    variant: str = Field(description="'magnitude' or 'random'")
    threshold: float
    kept: float
    kl: float
    cosine: float
    mse: float
    top1: float


class SparseUpdateQuality(BaseModel):
    thresholds: list[float]
    results: list[OutputAgreement]
    baseline: OutputAgreement = Field(description="θ_old alone (no update) vs θ_old + Δ")


def _tree_map(f: Callable[..., Any], *trees: Any) -> Any:
    t0 = trees[0]
    if isinstance(t0, Mapping):
        return {k: _tree_map(f, *(t[k] for t in trees)) for k in t0}
    if isinstance(t0, list | tuple):
        return type(t0)(_tree_map(f, *xs) for xs in zip(*trees, strict=True))
    return f(*trees)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _agree(
    ref: np.ndarray, out: np.ndarray, variant: str, thr: float, kept: float
) -> OutputAgreement:
    p, q = _softmax(ref), _softmax(out)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = float(np.mean(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30)), axis=-1)))
    a, b = ref.ravel(), out.ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    cos = float(a @ b / (na * nb)) if na > 0 and nb > 0 else float(na == nb)
    top1 = float(np.mean(ref.argmax(axis=-1) == out.argmax(axis=-1))) if ref.ndim else 1.0
    return OutputAgreement(variant=variant, threshold=thr, kept=kept, kl=max(kl, 0.0), cosine=cos,
                           mse=float(np.mean((a - b) ** 2)), top1=top1)  # fmt: skip


def _make_forward(forward: Any, inputs: Any) -> Callable[[Any], np.ndarray]:
    mod = type(forward).__module__
    if mod.startswith("torch") or any(
        c.__module__.startswith("torch.nn") for c in type(forward).__mro__
    ):
        import torch
        from torch.func import functional_call

        ref = next(forward.parameters())

        def run_torch(params: Mapping[str, np.ndarray]) -> np.ndarray:
            tp = {
                k: torch.as_tensor(np.asarray(v), dtype=ref.dtype, device=ref.device)
                for k, v in params.items()
            }
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            with torch.no_grad():
                return _to_numpy(functional_call(forward, tp, args))

        return run_torch

    def run_fn(params: Any) -> np.ndarray:
        return _to_numpy(forward(params, inputs))

    return run_fn


def sparse_update_quality(
    forward: Any,
    params_old: Any,
    delta: Any,
    inputs: Any,
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS,
    *,
    seed: int = 0,
) -> SparseUpdateQuality:
    """Compare the full update with magnitude- and random-masked sparse updates.

    Args:
        forward: ``callable(params, inputs) -> outputs`` (numpy or JAX), or a torch Module.
        params_old: θ_old, a pytree (dict/list) of arrays in the layout ``forward`` expects.
        delta: Δ with the same structure (e.g. θ_new − θ_old).
        inputs: the probe batch passed to ``forward``.
    """
    f = _make_forward(forward, inputs)
    dtype_of = _tree_map(lambda x: np.asarray(x).dtype, params_old)
    old = _tree_map(lambda x: np.asarray(x), params_old)
    d = _tree_map(lambda x: np.asarray(x), delta)

    def with_delta(
        mask_fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    ) -> tuple[np.ndarray, float]:
        kept = [0, 0]

        def apply(o: np.ndarray, dd: np.ndarray, dt: np.dtype) -> np.ndarray:
            m = mask_fn(dd, o)
            kept[0] += int(m.sum())
            kept[1] += m.size
            return (o + np.where(m, dd, 0)).astype(dt)

        p = _tree_map(apply, old, d, dtype_of)
        return f(p), kept[0] / max(kept[1], 1)

    ref, _ = with_delta(lambda dd, o: np.ones(dd.shape, bool))
    base, _ = with_delta(lambda dd, o: np.zeros(dd.shape, bool))
    rng = np.random.default_rng(seed)
    results = []
    for thr in thresholds:
        out, kept = with_delta(lambda dd, o, t=thr: np.abs(dd) > t)
        results.append(_agree(ref, out, "magnitude", thr, kept))

        def rand_mask(dd: np.ndarray, o: np.ndarray, t: float = thr) -> np.ndarray:
            k = int((np.abs(dd) > t).sum())
            m = np.zeros(dd.size, bool)
            m[rng.choice(dd.size, size=k, replace=False)] = True
            return m.reshape(dd.shape)

        out_r, kept_r = with_delta(rand_mask)
        results.append(_agree(ref, out_r, "random", thr, kept_r))
    return SparseUpdateQuality(
        thresholds=list(thresholds),
        results=results,
        baseline=_agree(ref, base, "none", float("inf"), 0.0),
    )
