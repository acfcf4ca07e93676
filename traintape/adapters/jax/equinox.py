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
                       weight_hh (3H, H)     ``kernel_hh`` (H, 3H); bias → ``bias_ih``,
                                             bias_n → ``bias_hn`` (see below)
``BatchNorm``          weight, bias          ``scale``, ``bias`` (kind ``batch_norm``)
                       State (mean, var)     ``running_mean``, ``running_var``, read from
                                             the ``eqx.nn.State`` argument (below)
=====================  ====================  =======================================

Recurrent biases. PyTorch's (canonical) cells have two biases, ``bias_ih`` and
``bias_hh``; equinox's have fewer, and a bias that only ever appears in a sum is one
parameter, not two:

* ``LSTMCell.bias`` (4H) is ``b_ih + b_hh`` (every gate adds both): recorded as
  ``bias_ih``; no ``bias_hh`` is recorded.
* ``GRUCell.bias`` (3H) is added to the input projection of every gate: for r and z it
  is ``b_ir + b_hr`` / ``b_iz + b_hz``, for n it is ``b_in``; ``GRUCell.bias_n`` (H) is
  ``b_hn`` (inside ``r ⊙ (h W_hn + b_hn)``). ``bias`` is recorded as ``bias_ih`` and
  ``bias_n`` as ``bias_hn`` (role ``bias_hn``: canonical ``bias_hh[2H:3H]``; the r/z
  blocks of ``bias_hh`` have no equinox parameter). PyTorch GRU weights load into an
  equinox GRUCell as ``bias = bias_ih + [bias_hh_r, bias_hh_z, 0]``, ``bias_n =
  bias_hh_n`` — one rounding for the r/z blocks, and from then on the two models train
  differently (torch moves b_ir and b_hr by the same gradient each, equinox their sum
  once). Equivalent, comparable stores need torch's two biases, which equinox's cells do
  not have; the conformance suite therefore writes its equinox GRU out with torch's
  four parameters (``conformance/models_equinox.py``), as it does for Flax's GRUCell.

``MLP`` and ``Sequential`` need nothing of their own (their ``layers`` are the modules above).

Activations: :func:`filter_value_and_grad` records the output of each *layer* (a module
owning one of the leaves above, a ``MultiheadAttention`` — one ``attention`` layer whose
projections' outputs are not recorded —, or a module named in ``layer_kinds``) as
``<layer>/output`` (``BatchNorm``: its output, not the state). Equinox layers see one
example (``jax.vmap(model)(x)``): the output is taken from inside the ``vmap`` calls the
differentiated function makes, with the mapped axes brought to the front (outermost
``vmap`` first: a per-token layer under ``vmap(batch)`` ∘ ``vmap(tokens)`` records
(B, T, ...), as PyTorch does). Conv, BatchNorm and GroupNorm outputs are channel-first
per example, (C, *spatial); they are recorded channels-last (canonical). A module called
several times in one step keeps its first output (a cell stepped by a Python loop); an
output computed inside ``lax.scan``/``cond``/``checkpoint`` bodies cannot leave them and
is not recorded. The capture swaps the ``__call__`` of the layers' classes while the
differentiated function is traced (and puts them back).

BatchNorm running statistics: when an ``eqx.nn.State`` is among the arguments of the
call, each ``BatchNorm``'s statistics in it are recorded as ``param``
``<layer>/running_mean``/``running_var`` as passed in (θ_t, before the call updates
them), like Flax's ``batch_stats``. ``mode="batch"`` holds an EMA started from whatever
the state was initialised with (zeros by default; debiased only at inference), so a
state loaded with PyTorch's running statistics continues them exactly (Keras momentum
convention: ``momentum`` = 1 − torch's); ``mode="ema"`` normalises training batches with
the running statistics, not the batch's, which no other framework does.

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
from traintape.schema import Kind
from traintape.schema.roles import (
    ATTENTION,
    BATCH_NORM,
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


BIAS_HN = "bias_hn"
"""Role of ``GRUCell.bias_n``: the n-gate block of the canonical ``bias_hh`` (module doc)."""

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
    elif isinstance(owner, nn.BatchNorm):
        role = {"weight": SCALE, "bias": BIAS}.get(attr)
        if role is not None:
            return EqxLayout([role], shape, None, BATCH_NORM)
    elif isinstance(owner, (nn.LSTMCell, nn.GRUCell)):
        kind = LSTM if isinstance(owner, nn.LSTMCell) else GRU
        if attr in ("weight_ih", "weight_hh") and n == 2:
            role = KERNEL_IH if attr == "weight_ih" else KERNEL_HH
            return EqxLayout([role], (shape[1], shape[0]), t2, kind)
        if attr == "bias":  # LSTM: b_ih + b_hh; GRU: b_i + [b_hr, b_hz, 0] (module doc)
            return EqxLayout([BIAS_IH], shape, None, kind)
        if attr == "bias_n":  # GRU: b_hn = bias_hh[2H:3H]
            return EqxLayout([BIAS_HN], shape, None, kind)
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


# ----------------------------------------------------------------------------- activations
def _layer_modules(eqx: Any, model: Any) -> list[tuple[tuple[str | int, ...], Any]]:
    """(path, module) of every equinox module in ``model``, parents first; paths use the
    parameter names' segments (``MultiheadAttention`` children as q/k/v/o)."""
    import dataclasses

    out: list[tuple[tuple[str | int, ...], Any]] = []

    def walk(node: Any, path: tuple[str | int, ...]) -> None:
        if isinstance(node, eqx.Module):
            out.append((path, node))
            for f in dataclasses.fields(node):
                seg: str | int = f.name
                if isinstance(node, eqx.nn.MultiheadAttention) and seg in _MHA:
                    seg = _MHA[str(seg)]
                walk(getattr(node, f.name, None), (*path, seg))
        elif isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                walk(child, (*path, i))
        elif isinstance(node, dict):
            for k, child in node.items():
                walk(child, (*path, str(k)))

    walk(model, ())
    return out


def _own_kind(eqx: Any, module: Any) -> str | None:
    """The layer kind of an equinox module that is a layer by itself, else None."""
    import dataclasses

    if isinstance(module, eqx.nn.MultiheadAttention):
        return ATTENTION
    for f in dataclasses.fields(module):
        x: Any = getattr(module, f.name, None)
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            lay = _role(eqx, module, f.name, tuple(x.shape))
            if lay is not None:
                return lay.layer_kind
    return None


def _current_trace() -> Any:
    try:
        from jax._src import core as jcore

        return jcore.trace_ctx.trace
    except Exception:  # pragma: no cover - a JAX without the stackless trace context
        return None


def _traces(level: Any) -> list[Any]:
    """``level`` and the traces it is nested in (where values outlive ``level``)."""
    out = []
    while level is not None:
        out.append(level)
        level = getattr(level, "parent_trace", None)
    return out


def _unbatch(out: Any, level: Any) -> tuple[Any, list[int]] | None:
    """``out`` as a value of the trace ``level`` (the differentiated function's): the
    ``vmap`` tracers between are unwrapped, innermost first. Returns (value, batch axes
    innermost first), or None when ``out`` cannot leave where it was computed (an
    unmapped axis, or a value of an inner trace: a ``lax.scan``/``cond``/``checkpoint``
    body — recording it would leak a tracer)."""
    batch_tracer: Any
    try:
        from jax._src.interpreters.batching import BatchTracer as batch_tracer
    except Exception:  # pragma: no cover - a JAX without it: record unmapped values only
        batch_tracer = ()
    dims: list[int] = []
    while isinstance(out, batch_tracer) and out._trace is not level:
        if not isinstance(out.batch_dim, int):
            return None
        dims.append(out.batch_dim)
        out = out.val
    if isinstance(out, jax.core.Tracer) and not any(
        getattr(out, "_trace", None) is t for t in _traces(level)
    ):
        return None
    return out, dims


def _rebatch(value: Any, dims: list[int]) -> Any:
    """Bring the mapped axes (innermost first) to the front, outermost vmap first."""
    for i, d in enumerate(reversed(dims)):
        value = jax.numpy.moveaxis(value, i + d, i)
    return value


class _Capture:
    """Within the block, record the outputs of the layers of ``model`` (module doc)."""

    def __init__(self, eqx: Any, model: Any, sink: Any) -> None:
        self.eqx, self.sink = eqx, sink
        self.level = _current_trace()
        self.layers: dict[int, tuple[tuple[str | int, ...], str | None]] = {}
        for path, mod in _layer_modules(eqx, model):
            given, named = sink.kind(path, mod)
            kind = given if named else _own_kind(eqx, mod)
            if named or kind is not None:
                self.layers.setdefault(id(mod), (path, kind))
        self.mods = {id(m): m for _, m in _layer_modules(eqx, model)}
        self.pending: list[tuple[tuple[str | int, ...], str | None, Any, list[int], bool]] = []
        self.seen: set[int] = set()
        self.channel_first = (eqx.nn.Conv, eqx.nn.ConvTranspose, eqx.nn.BatchNorm,
                              eqx.nn.GroupNorm)  # fmt: skip

    def __enter__(self) -> _Capture:
        classes = {type(self.mods[i]) for i in self.layers}
        self.saved = [(c, c.__dict__.get("__call__")) for c in classes]
        for cls in classes:
            cls.__call__ = self._patched(cls.__call__)
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, orig in self.saved:
            if orig is None:
                del cls.__call__
            else:
                cls.__call__ = orig

    def _patched(self, call: Callable[..., Any]) -> Callable[..., Any]:
        cap = self

        @functools.wraps(call)
        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:
            out = call(module, *args, **kwargs)
            at = cap.layers.get(id(module))
            y = out
            if isinstance(module, cap.eqx.nn.BatchNorm) and isinstance(out, tuple):
                y = out[0]  # (output, state)
            if at is not None and id(module) not in cap.seen and isinstance(y, jax.Array):
                cap.seen.add(id(module))
                got = _unbatch(y, cap.level)
                if got is not None:
                    cf = isinstance(module, cap.channel_first)
                    cap.pending.append((at[0], at[1], got[0], got[1], cf))
            return out

        return __call__

    def finish(self) -> None:
        """Hand the outputs to the sink (at the differentiated function's level)."""
        for path, kind, value, dims, channel_first in self.pending:
            value = _rebatch(value, dims)
            if channel_first and value.ndim > len(dims) + 1:  # (C, *spatial) → channels-last
                value = jax.numpy.moveaxis(value, len(dims), -1)
            self.sink.add(path, value, kind)


def _batch_norm_state(eqx: Any, model: Any, args: list[Any], sink: Any) -> dict[str, Any]:
    """The running statistics of the model's ``BatchNorm`` layers, read from the first
    ``eqx.nn.State`` among the call's arguments as they were passed (θ_t), into
    ``sink.state`` as ``<layer>/running_mean``, ``<layer>/running_var``. ``mode="batch"``
    keeps them as ``(hidden_mean, hidden_var)`` (an EMA, debiased only at inference),
    ``mode="ema"`` as ``(mean, var)``; either is recorded as held."""
    sink.state.clear()
    state = next((a for a in args if isinstance(a, eqx.nn.State)), None)
    if state is None:
        return {}
    for path, mod in _layer_modules(eqx, model):
        if not isinstance(mod, eqx.nn.BatchNorm):
            continue
        index = mod.batch_state_index if mod.mode == "batch" else mod.ema_state_index
        try:
            mean, var = state.get(index)
        except Exception:  # a State of another model
            continue
        sink.add_state(path, {"running_mean": mean, "running_var": var}, BATCH_NORM)
    return {n: a for n, (a, _, _) in sink.state.items()}


def filter_value_and_grad(
    fun: Callable[..., Any],
    *,
    recorder: Recorder,
    has_aux: bool = False,
    name_map: NameMap = None,
    step_kwarg: str | None = None,
    start_step: int | None = None,
    layer_kinds: LayerKinds = None,
    activations: bool = True,
) -> Callable[..., Any]:
    """Drop-in for ``equinox.filter_value_and_grad`` that records ``param``, ``grad`` and
    (when the policy asks and ``activations``) ``activation``.

    Differentiates the inexact-array leaves of the first argument (an equinox module or
    any pytree), exactly as equinox does, and returns exactly what
    ``eqx.filter_value_and_grad`` returns: ``(value, grads)`` or ``((value, aux), grads)``
    with ``grads`` shaped like the model (``None`` where not differentiated). For each
    executed call at step ``t`` it records ``param`` = θ_t and ``grad`` = ∇L(θ_t) under
    canonical names (``layers/0/kernel``) in canonical layout: ``Linear.weight`` (out, in)
    is recorded transposed as ``kernel`` (in, out), conv kernels as (*K, in/g, out), conv
    biases (O, 1, ..) as (O,); the specs carry ``permutation``/``source_shape``. Works
    under ``eqx.filter_jit`` and ``jax.jit``. Step accounting (``step_kwarg``,
    ``start_step``) as in :func:`traintape.jax.value_and_grad`. Activations: the output
    of every layer of the first argument as it runs inside ``fun`` (``<layer>/output``,
    stats over the batch; the module docstring says what a layer is and how outputs under
    ``jax.vmap`` are taken); ``layer_kinds`` names custom layers (``{"blocks/*/attn":
    "attention"}``) as in :func:`traintape.jax.value_and_grad`. No activation snapshots
    (no probe batch).

    Example::

        loss_and_grad = traintape.jax.filter_value_and_grad(loss, recorder=rec)
        loss, grads = eqx.filter_jit(loss_and_grad)(model, x, y)
    """
    import equinox as eqx

    from traintape.adapters.start import start_step as first_step

    from .capture import StepCounter
    from .flax import Activations
    from .grad import _record, _set_producer

    _set_producer(recorder)
    counter = StepCounter(first_step(recorder, start_step, "traintape.jax.filter_value_and_grad"))
    sink = Activations(name_map, layer_kinds)
    want_acts = activations and recorder.policy.records_kind(Kind.ACTIVATION)

    def inner(model: Any, *args: Any, **kwargs: Any) -> Any:
        sink.clear()
        if want_acts:
            with _Capture(eqx, model, sink) as cap:
                out = fun(model, *args, **kwargs)
            cap.finish()
        else:
            out = fun(model, *args, **kwargs)
        value, aux = out if has_aux else (out, None)
        return value, (aux, sink.finish())

    vg = eqx.filter_value_and_grad(inner, has_aux=True)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        step = kwargs.pop(step_kwarg, None) if step_kwarg else None
        if step_kwarg and step is None:
            raise TypeError(f"missing the step keyword argument {step_kwarg!r}")
        if not args:
            raise TypeError("filter_value_and_grad: the differentiated first argument is missing")
        (value, (aux, acts)), grads = vg(*args, **kwargs)
        params = eqx.filter(args[0], eqx.is_inexact_array)
        kinds = {**equinox_layer_kinds(params), **(dict(layer_kinds) if layer_kinds else {})}
        state = _batch_norm_state(eqx, args[0], [*args[1:], *kwargs.values()], sink)
        _record(
            recorder, params, grads, acts, state, sink,
            argnums=0, name_map=name_map, step=step, counter=counter, layer_kinds=kinds,
        )  # fmt: skip
        return ((value, aux), grads) if has_aux else (value, grads)

    return wrapped
