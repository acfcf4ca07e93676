"""Equinox modules → canonical names, layouts and layer kinds; ``filter_value_and_grad``.

Equinox stores PyTorch-like layouts; the recorded tensors are canonical (roles.py):

=====================  ====================  =======================================
equinox module         leaf                  canonical (canonical = source.transpose(p))
=====================  ====================  =======================================
``Linear``             weight (out, in)      ``kernel`` (in, out), p = (1, 0); ``bias``
``Conv1d/2d/3d``       weight (O, I/g, *K)   ``kernel`` (*K, I/g, O), p = (2.., 1, 0)
                       bias (O, 1, ..., 1)   ``bias`` (O,) (row-major reshape)
``Embedding``          weight (vocab, dim)   ``embedding``
``LayerNorm/RMSNorm``  weight, bias          ``scale``, ``bias``
``MultiheadAttention`` query/key/value/       ``q``/``k``/``v``/``o`` dense sub-layers
                       output_proj
``LSTMCell``           weight_ih (4H, in)    ``kernel_ih`` (in, 4H), gates i, f, g, o
                       weight_hh (4H, H)     ``kernel_hh`` (H, 4H); bias → ``bias_ih``
``GRUCell``            weight_ih (3H, in)    ``kernel_ih`` (in, 3H), gates r, z, n
                       weight_hh (3H, H)     ``kernel_hh`` (H, 3H); bias → ``bias_ih``
=====================  ====================  =======================================

Not yet canonical: equinox's single recurrent bias has no ``bias_hh`` counterpart
recorded (no zero ``bias_hh`` is synthesised), and ``GRUCell.bias_n`` (the ``h``-side
bias of the n gate, canonical ``bias_hh[2H:3H]``) is recorded under its own name
``bias_n``. ``MLP`` needs nothing of its own (its ``layers`` are ``Linear``).

Equinox is imported only when it is already loaded (a tree holding equinox modules
implies it is), so ``import traintape.jax`` works without equinox installed.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from traintape.core import Recorder
from traintape.core.naming import LayerKinds, NameMap
from traintape.schema.roles import (
    ATTENTION,
    BIAS,
    BIAS_IH,
    CONV,
    DENSE,
    EMBED,
    EMBEDDING,
    GRU,
    KERNEL,
    KERNEL_HH,
    KERNEL_IH,
    LAYER_NORM,
    LSTM,
    RMS_NORM,
    SCALE,
)


@dataclass(frozen=True)
class EqxLayout:
    """Canonical description of one leaf owned by an equinox module."""

    segments: list[str | int]
    """Path segments with the canonical role as the last one."""
    shape: tuple[int, ...]
    """Canonical shape."""
    permutation: tuple[int, ...] | None
    """canonical = source.transpose(permutation); None: a row-major reshape (or identity)."""
    layer_kind: str | None


_MHA = {"query_proj": "q", "key_proj": "k", "value_proj": "v", "output_proj": "o"}


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    raise LookupError(key)


def _role(eqx: Any, owner: Any, attr: str, shape: tuple[int, ...]) -> EqxLayout | None:
    """(role, canonical shape, permutation, layer kind) of ``owner.attr``; None: unknown."""
    nn = eqx.nn
    n = len(shape)
    t2 = (1, 0)
    if isinstance(owner, nn.Linear):
        if attr == "weight" and n == 2:
            return EqxLayout([KERNEL], (shape[1], shape[0]), t2, DENSE)
        if attr == "bias":
            return EqxLayout([BIAS], shape, None, DENSE)
    elif isinstance(owner, nn.Conv) and not isinstance(owner, nn.ConvTranspose):
        if attr == "weight":
            perm = (*range(2, n), 1, 0)
            return EqxLayout([KERNEL], tuple(shape[i] for i in perm), perm, CONV)
        if attr == "bias":
            return EqxLayout([BIAS], (shape[0],), None, CONV)
    elif isinstance(owner, nn.Embedding) and attr == "weight":
        return EqxLayout([EMBEDDING], shape, None, EMBED)
    elif isinstance(owner, (nn.LayerNorm, nn.RMSNorm)):
        kind = LAYER_NORM if isinstance(owner, nn.LayerNorm) else RMS_NORM
        role = {"weight": SCALE, "bias": BIAS}.get(attr)
        if role is not None:
            return EqxLayout([role], shape, None, kind)
    elif isinstance(owner, (nn.LSTMCell, nn.GRUCell)):
        kind = LSTM if isinstance(owner, nn.LSTMCell) else GRU
        if attr in ("weight_ih", "weight_hh") and n == 2:
            role = KERNEL_IH if attr == "weight_ih" else KERNEL_HH
            return EqxLayout([role], (shape[1], shape[0]), t2, kind)
        if attr == "bias":
            return EqxLayout([BIAS_IH], shape, None, kind)
        return EqxLayout([attr], shape, None, kind)
    return None


def equinox_layouts(tree: Any) -> dict[int, EqxLayout]:
    """Leaf index (in ``tree``'s flattening) → canonical layout, for every array leaf owned
    by a known equinox module. Empty when equinox is not loaded or the tree holds none."""
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return {}
    if not any(
        isinstance(x, eqx.Module)
        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, eqx.Module))
    ):
        return {}
    out: dict[int, EqxLayout] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    for i, (path, x) in enumerate(flat):
        if not hasattr(x, "shape") or not path:
            continue
        node, segs, owner = tree, [], None
        try:
            for j, key in enumerate(path):
                seg: str | int = _segment(key)
                if isinstance(node, eqx.nn.MultiheadAttention) and seg in _MHA:
                    seg = _MHA[str(seg)]
                if j == len(path) - 1 and isinstance(node, eqx.Module):
                    owner = node
                else:
                    segs.append(seg)
                node = _child(node, key)
        except (LookupError, AttributeError, TypeError):
            continue
        last = path[-1]
        if owner is None or not isinstance(last, jax.tree_util.GetAttrKey):
            continue
        lay = _role(eqx, owner, last.name, tuple(x.shape))
        if lay is not None:
            out[i] = EqxLayout([*segs, *lay.segments], lay.shape, lay.permutation, lay.layer_kind)
    return out


def _segment(key: Any) -> str | int:
    from .names import raw_segments

    return raw_segments([key])[0]


def equinox_layer_kinds(tree: Any) -> dict[str, str | None]:
    """Canonical layer path → layer kind for the equinox modules of ``tree`` (attention
    layers included: a ``MultiheadAttention``'s path is an ``attention`` layer)."""
    from traintape.core.naming import join

    kinds: dict[str, str | None] = {}
    for lay in equinox_layouts(tree).values():
        layer = [str(s) for s in lay.segments[:-1]]
        kinds[join(layer)] = lay.layer_kind
        if len(layer) >= 2 and layer[-1] in ("q", "k", "v", "o"):
            kinds.setdefault(join(layer[:-1]), ATTENTION)
    return kinds


def filter_value_and_grad(
    fun: Callable[..., Any],
    *,
    recorder: Recorder,
    has_aux: bool = False,
    name_map: NameMap = None,
    step_kwarg: str | None = None,
    start_step: int = 0,
    layer_kinds: LayerKinds = None,
) -> Callable[..., Any]:
    """Drop-in for ``equinox.filter_value_and_grad`` that records ``param`` and ``grad``.

    Differentiates the inexact-array leaves of the first argument (an equinox module or
    any pytree), exactly as equinox does, and returns exactly what
    ``eqx.filter_value_and_grad`` returns: ``(value, grads)`` or ``((value, aux), grads)``
    with ``grads`` shaped like the model (``None`` where not differentiated). For each
    executed call at step ``t`` it records ``param`` = θ_t and ``grad`` = ∇L(θ_t) under
    canonical names (``layers/0/kernel``) in canonical layout: ``Linear.weight`` (out, in)
    is recorded transposed as ``kernel`` (in, out), conv kernels as (*K, in/g, out), conv
    biases (O, 1, ..) as (O,); the specs carry ``permutation``/``source_shape``. Works
    under ``eqx.filter_jit`` and ``jax.jit``. Step accounting (``step_kwarg``,
    ``start_step``) as in :func:`traintape.jax.value_and_grad`. Activations are not
    recorded (equinox has no module interceptor).

    Example::

        loss_and_grad = traintape.jax.filter_value_and_grad(loss, recorder=rec)
        loss, grads = eqx.filter_jit(loss_and_grad)(model, x, y)
    """
    import equinox as eqx

    from .capture import StepCounter
    from .flax import Activations
    from .grad import _record, _set_producer

    _set_producer(recorder)
    counter = StepCounter(start_step)
    sink = Activations(name_map, layer_kinds)
    vg = eqx.filter_value_and_grad(fun, has_aux=has_aux)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        step = kwargs.pop(step_kwarg, None) if step_kwarg else None
        if step_kwarg and step is None:
            raise TypeError(f"missing the step keyword argument {step_kwarg!r}")
        if not args:
            raise TypeError("filter_value_and_grad: the differentiated first argument is missing")
        out, grads = vg(*args, **kwargs)
        params = eqx.filter(args[0], eqx.is_inexact_array)
        kinds = {**equinox_layer_kinds(params), **(dict(layer_kinds) if layer_kinds else {})}
        _record(
            recorder, params, grads, {}, {}, sink,
            argnums=0, name_map=name_map, step=step, counter=counter, layer_kinds=kinds,
        )  # fmt: skip
        return out, grads

    return wrapped
