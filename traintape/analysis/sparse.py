"""Sparse-update quality: would a sparse update have done the same as the full one?

Given a forward function, old parameters ``θ_old`` and an update ``Δ`` (e.g. from two
param snapshots of a run), compare the outputs of ``θ_old + Δ`` (the reference) with

- ``θ_old + Δ ⊙ [|Δ| > thr]`` for each threshold (the *magnitude* mask), and
- ``θ_old + Δ ⊙ R`` with ``R`` a random mask keeping the same number of entries per
  tensor (the *random* control).

Metrics per variant: ``kl`` = mean KL(softmax(ref) ‖ softmax(variant)) over the last axis
(nats), ``cosine`` of the flattened outputs, ``mse``, ``top1`` agreement of argmax over the
last axis, and ``kept`` = fraction of Δ entries kept.

``forward`` may be any Python callable ``(params, inputs) -> outputs`` where ``params`` has
the same structure as ``params_old`` (a dict of numpy/JAX arrays or nested dicts/lists
thereof). For a torch module pass ``traintape.torch.as_forward(module)``: a forward in the
module's own names and layouts (``params_old``/``delta`` keyed by ``named_parameters()``),
called with ``torch.func.functional_call``. This module imports no framework.

From a recorded run, :func:`sparse_update_from_run` takes ``θ_old`` and ``Δ`` from two
param snapshots (``CapturePolicy(full_every=N)`` records them); the command line is
``traintape sparse-update RUN --forward MODULE:ATTR --inputs MODULE:ATTR``.

Example (a numpy forward on canonical names; a JAX function works the same)::

    import numpy as np
    import traintape
    from traintape.analysis import sparse_update_from_run, sparse_update_quality

    def forward(params, x):                      # params: {canonical name: array}
        h = np.tanh(x @ params["layers/0/kernel"] + params["layers/0/bias"])
        return h @ params["layers/1/kernel"] + params["layers/1/bias"]

    x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    run = traintape.open_run("runs/mlp")
    q = sparse_update_from_run(run, forward, x)   # first → last param snapshot
    for r in q.results:
        print(r.variant, r.threshold, f"kept {r.kept:.1%}", f"KL {r.kl:.2g}", f"top1 {r.top1:.3f}")

    # or with explicit θ_old and Δ (any pytree of arrays the forward understands):
    q = sparse_update_quality(forward, params_old, delta, x, thresholds=(1e-6, 1e-4))

With ``traintape.torch.as_forward(module)``, :func:`sparse_update_from_run` converts the
canonical snapshots to the module's names and layouts through its ``native_params``
(:func:`traintape.torch.from_canonical`; the module's weights are restored afterwards).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from traintape.analysis._common import ProgressCallback, Tracker
from traintape.analysis.change import DEFAULT_THRESHOLDS
from traintape.schema import Kind

if TYPE_CHECKING:
    from traintape.core.reader import Run


class OutputAgreement(BaseModel):
    """Agreement of the outputs of one update variant with those of the full update."""

    variant: str = Field(description="'magnitude', 'random' or 'none' (the baseline)")
    threshold: float | None = Field(description="|Δ| threshold (None for the baseline)")
    kept: float
    kl: float
    cosine: float
    mse: float
    top1: float


class SparseUpdateQuality(BaseModel):
    """Result of :func:`sparse_update_quality`: per threshold a magnitude and a random row."""

    thresholds: list[float]
    results: list[OutputAgreement]
    baseline: OutputAgreement = Field(description="θ_old alone (no update) vs θ_old + Δ")
    url: str | None = Field(None, description="the run (from sparse_update_from_run)")
    step_old: int | None = Field(None, description="step of θ_old (from a run)")
    step_new: int | None = Field(None, description="step of θ_old + Δ (from a run)")
    tensors: int | None = Field(None, description="param tensors in θ (from a run)")

    def result(self, variant: str, threshold: float) -> OutputAgreement:
        """The row of ``variant`` ('magnitude' or 'random') at ``threshold``."""
        for r in self.results:
            if r.variant == variant and r.threshold == threshold:
                return r
        raise KeyError((variant, threshold))


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
    ref: np.ndarray, out: np.ndarray, variant: str, thr: float | None, kept: float
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


def is_torch_module(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.nn.Module`` (without importing torch)."""
    return any(
        c.__module__.startswith("torch.nn") and c.__name__ == "Module" for c in type(obj).__mro__
    )


def _make_forward(forward: Any, inputs: Any) -> Callable[[Any], np.ndarray]:
    _refuse_module(forward)

    def run_fn(params: Any) -> np.ndarray:
        return _to_numpy(forward(params, inputs))

    return run_fn


def sparse_update_quality(
    forward: Any,
    params_old: Any,
    delta: Any,
    inputs: Any,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    *,
    seed: int = 0,
    progress: ProgressCallback | None = None,
) -> SparseUpdateQuality:
    """Compare the full update with magnitude- and random-masked sparse updates.

    Args:
        forward: ``callable(params, inputs) -> outputs`` (numpy, JAX, or
            ``traintape.torch.as_forward(module)``: then ``params_old``/``delta`` are keyed
            by its ``named_parameters()`` names).
        params_old: θ_old, a pytree (dict/list) of arrays in the layout ``forward`` expects.
        delta: Δ with the same structure (e.g. θ_new − θ_old).
        inputs: the probe batch passed to ``forward`` (a tuple is unpacked for torch).
        thresholds: keep the entries with ``|Δ| > threshold``; one result pair each.
        seed: of the random masks.
        progress: ``callback(stage, done, total)``; a unit is one forward pass.

    Example::

        def forward(p, x):
            return x @ p["w"]

        old = {"w": np.eye(4)}
        q = sparse_update_quality(forward, old, {"w": np.full((4, 4), 1e-3)}, np.eye(4))
        q.result("magnitude", 1e-4).kept   # 1.0: every |Δ| is above 1e-4
    """
    tracker = Tracker(progress)
    tracker.add(2 + 2 * len(thresholds))
    tracker.stage("forward passes")
    f0 = _make_forward(forward, inputs)

    def f(params: Any) -> np.ndarray:
        out = f0(params)
        tracker.advance()
        return out

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

        def magnitude_mask(dd: np.ndarray, o: np.ndarray, t: float = thr) -> np.ndarray:
            return np.abs(dd) > t

        out, kept = with_delta(magnitude_mask)
        results.append(_agree(ref, out, "magnitude", thr, kept))

        def rand_mask(dd: np.ndarray, o: np.ndarray, t: float = thr) -> np.ndarray:
            k = int((np.abs(dd) > t).sum())
            m = np.zeros(dd.size, bool)
            m[rng.choice(dd.size, size=k, replace=False)] = True
            return m.reshape(dd.shape)

        out_r, kept_r = with_delta(rand_mask)
        results.append(_agree(ref, out_r, "random", thr, kept_r))
    tracker.finish()
    return SparseUpdateQuality(
        thresholds=list(thresholds),
        results=results,
        baseline=_agree(ref, base, "none", None, 0.0),
    )


def snapshot_pair_steps(run: Run) -> list[int]:
    """Steps at which the run has full param snapshots (ascending)."""
    if not run.manifest.commit.snapshots.get(Kind.PARAM):
        return []
    names = run.tensor_names(Kind.PARAM)
    return [int(s) for s in run.snapshot_steps(names[0], Kind.PARAM)] if names else []


def sparse_update_from_run(
    run: Run,
    forward: Any,
    inputs: Any,
    step_old: int | None = None,
    step_new: int | None = None,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    *,
    seed: int = 0,
    progress: ProgressCallback | None = None,
) -> SparseUpdateQuality:
    """:func:`sparse_update_quality` with ``θ_old`` and ``Δ`` from two param snapshots.

    Args:
        run: an open run with param snapshots (``CapturePolicy(full_every=N)``).
        forward: ``callable(params, inputs)`` taking ``{canonical name: array}`` in
            canonical layout (e.g. a Dense ``kernel`` is (in, out)), or a framework's
            forward with ``native_params`` such as ``traintape.torch.as_forward(module,
            name_map)`` (the snapshots are converted to its names and layouts).
        inputs: the probe batch passed to ``forward``.
        step_old, step_new: snapshot steps (default: the first and the last).
        thresholds, seed: as in :func:`sparse_update_quality`.
        progress: ``callback(stage, done, total)``; a unit is one snapshot tensor read or
            one forward pass.

    Raises:
        ValueError: fewer than two param snapshots, or a step that has none.
    """
    steps = snapshot_pair_steps(run)
    if len(steps) < 2:
        raise ValueError(
            f"{run.url}: sparse-update quality needs param snapshots at two steps, found "
            f"{len(steps)}; record with CapturePolicy(full_every=N)"
        )
    s0 = steps[0] if step_old is None else int(step_old)
    s1 = steps[-1] if step_new is None else int(step_new)
    for s in (s0, s1):
        if s not in steps:
            shown = ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")
            raise ValueError(f"{run.url}: no param snapshot at step {s}; snapshot steps: {shown}")
    if s0 == s1:
        raise ValueError(f"step_old and step_new are both {s0}: choose two different steps")
    names = run.tensor_names(Kind.PARAM)
    tracker = Tracker(progress)
    tracker.add(2 * len(names))
    tracker.stage("reading param snapshots")
    old: dict[str, np.ndarray] = {}
    new: dict[str, np.ndarray] = {}
    for n in names:
        old[n] = run.snapshot(n, Kind.PARAM, s0)
        tracker.advance()
        new[n] = run.snapshot(n, Kind.PARAM, s1)
        tracker.advance()
    _refuse_module(forward)
    native = getattr(forward, "native_params", None)
    if native is not None:  # a framework's forward (traintape.torch.as_forward)
        old, new = native(old), native(new)
    delta = {k: new[k].astype(np.float64) - old[k].astype(np.float64) for k in old}
    q = sparse_update_quality(
        forward, old, delta, inputs, thresholds, seed=seed, progress=tracker.child()
    )
    tracker.finish()
    return q.model_copy(update={"url": run.url, "step_old": s0, "step_new": s1,
                                "tensors": len(names)})  # fmt: skip


def _refuse_module(forward: Any) -> None:
    if is_torch_module(forward):
        raise TypeError(
            "sparse update: got a torch.nn.Module; pass traintape.torch.as_forward(module) "
            "(traintape.analysis imports no framework)"
        )
