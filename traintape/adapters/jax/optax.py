"""``traintape.jax.watch``: an optax ``GradientTransformation`` that records what is applied.

``watch(tx, recorder)`` behaves exactly like ``tx`` (same updates, same inner state, kept
in ``WatchState.inner``) and records at optimizer step ``t`` (``WatchState.count``, on the
device, so full-capture steps are chosen without a host round trip; it starts at the
recorder's ``next_step``, so a recorder opened with ``resume_step=N`` continues at N):

- ``update``: θ_{t+1} − θ_t *as applied* (docs/store-format.md): ``(θ + u) − θ``
  computed in each parameter's storage dtype inside the step, ``u`` the transformed
  updates — exactly what ``optax.apply_updates`` changes the parameter by: 0 where ``u``
  is below half an ulp of θ. It needs θ_t, i.e. ``params`` passed to ``update``
  (``tx.update(grads, state, params)``); called without them, ``update`` is not
  recorded (with a warning once; an error when ``update`` was asked for explicitly);
- optionally ``grad`` (the updates ``tx`` receives: the gradient *before* any clipping
  or other transform inside ``tx``, after accumulation — see ``accumulate``) and
  ``param`` (θ_t, needs ``params`` passed to ``update``);
- ``opt_state`` (when asked, or by default when the recorder's policy records it): every
  leaf of the new inner state shaped like a parameter (Adam/AdamW ``mu``/``nu``, SGD
  momentum ``trace``, ...), named ``<param name>/<state field>``, e.g.
  ``dense/kernel/mu`` — the names the torch adapter gives the same optimizers' state.
  State that is not parameter-shaped (counts, Adafactor's factored ``v_row``/``v_col``)
  is not recorded.

Kinds named in ``kinds=`` (or ``opt_state=True``) are recorded even when the recorder's
policy leaves them out (the explicit request wins; :mod:`traintape.adapters.kinds`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from traintape.adapters.kinds import request_kinds
from traintape.adapters.start import start_step as first_step
from traintape.core import Recorder
from traintape.core.naming import NameMap, canonical_name
from traintape.schema import Kind

from .capture import Group, emit
from .names import Leaf, named_leaves, raw_segments


class WatchState(NamedTuple):
    """State of :func:`watch`: the wrapped transformation's state and the step count."""

    inner: Any
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as in optax's states
    """Optimizer steps completed (int32): the step recorded by the next ``update``."""
    micro: jax.Array
    """Micro-batches accumulated towards the current step (``accumulate > 1``)."""
    acc: Any
    """Sum of the micro-batch gradients of the current step (``accumulate > 1``; else ())."""


def _opt_state_leaves(state: Any, params: Any, name_map: NameMap) -> tuple[list[Leaf], list[Any]]:
    p_leaves = named_leaves(params, name_map)
    by_path = {tuple(lf.source_name.split("/")): lf for lf in p_leaves}
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves: list[Leaf] = []
    arrays: list[Any] = []
    for path, x in flat:
        segs = [str(s) for s in raw_segments(path)]
        for k in range(len(segs)):
            leaf = by_path.get(tuple(segs[k:]))
            if leaf is None or tuple(jnp.shape(x)) != (leaf.source_shape or leaf.shape):
                continue
            fields = [s for s in segs[:k] if not s.isdigit()]
            field = fields[-1] if fields else "state"
            name = canonical_name([leaf.name, field], None, f"{'/'.join(segs)}")
            if any(lf.name == name for lf in leaves):
                name = canonical_name([leaf.name, *[s for s in segs[:k]]], None)
            leaves.append(Leaf(name, "/".join(segs), len(arrays), leaf.shape, jnp.dtype(x.dtype),
                               source_shape=leaf.source_shape, permutation=leaf.permutation))  # fmt: skip
            arrays.append(x)
            break
    return leaves, arrays


def watch(
    tx: optax.GradientTransformation,
    recorder: Recorder,
    *,
    kinds: Sequence[Kind | str] | None = None,
    opt_state: bool | None = None,
    name_map: NameMap = None,
    start_step: int | None = None,
    accumulate: int = 1,
) -> optax.GradientTransformation:
    """Wrap ``tx`` so that each ``update`` records the kinds asked for at its step.

    Args:
        tx: any optax transformation.
        kinds: among ``update``, ``grad``, ``param``, ``opt_state`` (see the module
            docstring); None: ``update``, plus ``opt_state`` when the recorder's policy
            records that kind. Kinds named here are recorded even when the policy
            leaves them out.
        opt_state: shorthand for adding ``opt_state`` to ``kinds`` (True: recorded
            whatever the policy says) or leaving it out (False).
        name_map: the same name map as given to ``value_and_grad`` (names must agree).
        start_step: the step the first ``update`` records; None (default): the
            recorder's :attr:`~traintape.Recorder.next_step`. Read by ``init`` (a state
            restored from a checkpoint carries its own ``count``); one that disagrees
            with a recorder continuing a run is a ``RecordError`` naming both steps.
        accumulate: gradient accumulation, k calls per optimizer step (like
            ``optax.MultiSteps``, which cannot be watched from inside because it runs
            its inner update on every call): ``tx`` is applied on every k-th call to
            the mean of the k gradients, zero updates are returned on the others, and
            the step, ``grad`` (the accumulated mean), ``param`` and ``update`` are
            recorded once per optimizer step.
    """
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")
    if kinds is None:
        want = {Kind.UPDATE}
        explicit: set[Kind] = set()
        if opt_state is None and recorder.policy.records_kind(Kind.OPT_STATE):
            want.add(Kind.OPT_STATE)
    else:
        want = {Kind(k) for k in kinds}
        explicit = set(want)
    if opt_state is not None:
        want = want | {Kind.OPT_STATE} if opt_state else want - {Kind.OPT_STATE}
        explicit = explicit | {Kind.OPT_STATE} if opt_state else explicit - {Kind.OPT_STATE}
    bad = want - {Kind.UPDATE, Kind.GRAD, Kind.PARAM, Kind.OPT_STATE}
    if bad:
        raise ValueError(
            f"watch records update, grad, param and opt_state, not {sorted(k.value for k in bad)}"
        )
    request_kinds(recorder, explicit)  # asked for by name: recorded whatever the policy
    warned: list[bool] = []

    def init(params: Any) -> WatchState:
        acc = jax.tree_util.tree_map(jnp.zeros_like, params) if accumulate > 1 else ()
        first = first_step(recorder, start_step, "traintape.jax.watch")
        return WatchState(
            tx.init(params), jnp.asarray(first, jnp.int32), jnp.zeros((), jnp.int32), acc
        )

    def applied(params: Any, new_updates: Any) -> list[Any]:
        """θ_{t+1} − θ_t as ``optax.apply_updates`` applies ``new_updates``: ``(θ + u)``
        rounded to θ's storage dtype, minus θ, in that dtype (0 where u < ulp(θ)/2)."""

        def one(p: Any, u: Any) -> Any:
            if u is None:
                return None
            p = jnp.asarray(p)
            return jnp.asarray(p + u).astype(p.dtype) - p

        return jax.tree_util.tree_leaves(
            jax.tree_util.tree_map(one, params, new_updates, is_leaf=lambda x: x is None)
        )

    def step(updates: Any, inner: Any, count: Any, params: Any, extra: Any) -> tuple[Any, Any]:
        new_updates, inner = tx.update(updates, inner, params, **extra)
        leaves = named_leaves(updates, name_map)
        groups = []
        if Kind.PARAM in want:
            if params is None:
                raise ValueError("watch(kinds=[..., 'param']) needs params passed to update")
            groups.append(Group(Kind.PARAM, leaves, jax.tree_util.tree_leaves(params)))
        if Kind.GRAD in want:
            groups.append(Group(Kind.GRAD, leaves, jax.tree_util.tree_leaves(updates)))
        if Kind.UPDATE in want:
            if params is not None:
                groups.append(Group(Kind.UPDATE, leaves, applied(params, new_updates)))
            elif Kind.UPDATE in explicit:
                raise ValueError(
                    "traintape.jax.watch(kinds=[..., 'update']): update is θ_{t+1} − θ_t as "
                    "applied, (θ + u) − θ in θ's dtype, which needs θ_t: call "
                    "tx.update(grads, state, params)"
                )
            elif not warned:
                warned.append(True)
                warnings.warn(
                    "traintape.jax.watch: `update` is not recorded because tx.update was "
                    "called without params; update is θ_{t+1} − θ_t as applied, which needs "
                    "θ_t: call tx.update(grads, state, params)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if Kind.OPT_STATE in want:
            o_leaves, o_arrays = _opt_state_leaves(inner, updates, name_map)
            if o_leaves:
                groups.append(Group(Kind.OPT_STATE, o_leaves, o_arrays))
        emit(recorder, groups, step=count)
        return new_updates, inner

    def update(
        updates: Any, state: WatchState, params: Any = None, **extra: Any
    ) -> tuple[Any, WatchState]:
        if accumulate == 1:
            new_updates, inner = step(updates, state.inner, state.count, params, extra)
            return new_updates, WatchState(inner, state.count + 1, state.micro, state.acc)
        acc = jax.tree_util.tree_map(jnp.add, state.acc, updates)
        done = state.micro == accumulate - 1

        def do(acc: Any, inner: Any, params: Any) -> tuple[Any, Any]:
            mean = jax.tree_util.tree_map(lambda a: a / accumulate, acc)
            return step(mean, inner, state.count, params, extra)

        def skip(acc: Any, inner: Any, params: Any) -> tuple[Any, Any]:
            shapes = jax.eval_shape(lambda: tx.update(acc, inner, params, **extra)[0])
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, inner

        new_updates, inner = jax.lax.cond(done, do, skip, acc, state.inner, params)
        acc = jax.tree_util.tree_map(lambda a: jnp.where(done, jnp.zeros_like(a), a), acc)
        return new_updates, WatchState(
            inner,
            state.count + done.astype(jnp.int32),
            (state.micro + 1) % accumulate,
            acc,
        )

    return optax.GradientTransformation(init, update)
