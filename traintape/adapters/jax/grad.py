"""``traintape.jax.value_and_grad`` and ``nnx_value_and_grad``: drop-in gradient wrappers.

Step accounting (docs/store-format.md: step t counts completed optimizer steps from 0):

- **automatic** (default): every *executed* call is one step, numbered on the host in
  callback order from ``start_step`` (default: the recorder's ``next_step``, so a
  recorder opened with ``resume_step=N`` continues at N) (also per iteration inside ``lax.scan``/``fori_loop``:
  one executed call = one step). On full-capture policies the step is fetched from the
  host with one tiny ordered callback so the device can decide whether to ship tensors.
- **explicit**: ``step_kwarg="step"`` makes the wrapped function take ``step=`` (a Python
  int or an integer array, e.g. ``state.step``); it is removed before calling ``fun``.
  Steps must not go backwards.
- **gradient accumulation** (k calls per optimizer step): record where the accumulated
  gradient exists — ``traintape.jax.watch(tx, rec, kinds=("param", "grad", "update"),
  accumulate=k)`` applies ``tx`` once per k calls to the mean of the k micro-batch
  gradients and records it as ``grad`` of that optimizer step. Use plain
  ``jax.value_and_grad`` for the micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax

from traintape.adapters.start import start_step as first_step
from traintape.core import Recorder
from traintape.core.naming import LayerKinds, NameMap, join
from traintape.schema import Kind

from .capture import Group, StepCounter, emit
from .flax import Activations, linen_activations, nnx_capture
from .names import Leaf, named_leaves


def _set_producer(recorder: Recorder) -> None:
    from .stats import stats_backend

    recorder.set_producer(
        framework="jax",
        framework_version=jax.__version__,
        adapter="traintape.jax",
        stats_backend=stats_backend(),
    )


def _wrap_for_activations(
    fun: Callable[..., Any], has_aux: bool, sink: Activations, linen: bool
) -> Callable[..., Any]:
    """fun → fun2 returning (value, (aux, (activations, state))): activations and module
    state (Linen ``batch_stats`` as read before the call) leave the AD trace as aux."""

    def fun2(*args: Any, **kwargs: Any) -> Any:
        sink.clear()
        if linen:
            with linen_activations(sink):
                out = fun(*args, **kwargs)
        else:
            out = fun(*args, **kwargs)
        value, aux = out if has_aux else (out, None)
        state = {n: a for n, (a, _, _) in sink.state.items()}
        return value, (aux, (sink.finish(), state))

    return fun2


def _record(
    recorder: Recorder,
    params: Any,
    grads: Any,
    acts: dict[str, jax.Array],
    state: dict[str, jax.Array],
    sink: Activations,
    *,
    argnums: int | Sequence[int],
    name_map: NameMap,
    step: Any,
    counter: StepCounter,
    layer_kinds: dict[str, str | None] | None = None,
    probe: Callable[[], dict[str, jax.Array]] | None = None,
    acts_in_forward_order: bool = True,
) -> None:
    """Emit ``param`` (θ_t: the differentiated leaves plus non-trainable ``state``),
    ``grad`` and ``activation`` groups for one call."""
    if isinstance(argnums, int):
        p_leaves = named_leaves(params, name_map, root=f"arg{argnums}")
    else:
        p_leaves = named_leaves(tuple(params), name_map)
    # layer kinds known from the modules seen by the activation capture (Linen/NNX)
    layer_kinds = {**sink.layers_kinds(), **(layer_kinds or {})}
    g_flat = jax.tree_util.tree_leaves(grads)
    p_flat = jax.tree_util.tree_leaves(params)
    taken = {lf.name for lf in p_leaves}
    state_names = [n for n in sink.state if n in state and n not in taken]
    s_leaves = [
        Leaf(n, sink.state[n][2], len(p_flat) + i, tuple(state[n].shape), state[n].dtype)
        for i, n in enumerate(state_names)
    ]
    groups = [
        Group(Kind.PARAM, p_leaves + s_leaves, p_flat + [state[n] for n in state_names],
              layer_kinds),
        Group(Kind.GRAD, p_leaves, g_flat, layer_kinds),
    ]  # fmt: skip
    if acts:
        names = [n for n in sink.items if n in acts]  # forward order
        a_leaves = [
            Leaf(n, sink.items[n][2], i, tuple(acts[n].shape), acts[n].dtype)
            for i, n in enumerate(names)
        ]
        groups.append(
            Group(
                Kind.ACTIVATION,
                a_leaves,
                [acts[n] for n in names],
                layer_kinds,
                snapshots=probe if probe is not None else False,
                in_forward_order=acts_in_forward_order,
            )
        )
    emit(recorder, groups, step=step, counter=counter)


def _substitute(
    args: Sequence[Any], kwargs: Mapping[str, Any], probe: Mapping[int | str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """The call's arguments with the probe batch substituted (position or keyword)."""
    a, kw = list(args), dict(kwargs)
    for key, value in probe.items():
        if isinstance(key, int):
            a[key] = value
        else:
            kw[key] = value
    return a, kw


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    recorder: Recorder,
    name_map: NameMap = None,
    step_kwarg: str | None = None,
    start_step: int | None = None,
    activations: bool = True,
    probe: Mapping[int | str, Any] | None = None,
    layer_kinds: LayerKinds = None,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> Callable[..., Any]:
    """Drop-in for :func:`jax.value_and_grad` that records ``param`` and ``grad``.

    Same arguments and return values as ``jax.value_and_grad``; works under ``jax.jit``,
    with any pytree for the differentiated argument(s) (dicts, lists, tuples, registered
    dataclasses, Flax ``FrozenDict``). For each executed call at step ``t`` it records
    ``param`` = θ_t (the differentiated argument's leaves) and ``grad`` = ∇L(θ_t), both in
    the argument's layout; with several ``argnums`` the argument position is the first
    name segment. If the policy records activations and ``fun`` applies Flax Linen
    modules, outputs of parametrised modules are recorded as ``activation``
    (``<module path>/output``, stats over the batch).

    Stats are one ``[n, 9]`` float32 matrix computed in the caller's computation and sent
    to the host by one ordered callback per step; full tensors are shipped only on
    full-capture steps.

    Args:
        recorder: where to record.
        name_map: mapping or callable from default canonical names to wanted ones.
        step_kwarg: name of an extra keyword argument carrying the optimizer step
            (explicit mode, removed before ``fun`` is called); ``None``: automatic mode.
        start_step: first step number of the automatic mode; None (default): the
            recorder's :attr:`~traintape.Recorder.next_step` (0 for a new run, ``N``
            after ``Recorder(url, resume_step=N)``). A value that disagrees with a
            recorder continuing a run is a ``RecordError`` naming both steps.
        activations: record Flax Linen activations (and BatchNorm ``batch_stats`` as
            ``param`` ``running_mean``/``running_var``, read before the call) when the
            policy asks for them.
        layer_kinds: canonical layer path (or ``fnmatch`` pattern) → layer kind, for
            custom modules: ``{"blocks/*/attn": "attention"}`` makes each such module one
            attention layer (its output recorded, its q/k/v/o sub-layer outputs not),
            ``{"gru": "gru"}`` marks a hand-written recurrent layer.
        probe: a fixed probe batch for activation snapshots: argument position (or
            keyword name) → value substituted into the call, e.g. ``{1: x_probe}``. On
            full-capture steps (only) ``fun`` is run forward on it with the current
            parameters and its activations are written in full. Without it activations
            are recorded as stats only (a training batch changes every step).
    """
    _set_producer(recorder)
    counter = StepCounter(first_step(recorder, start_step, "traintape.jax.value_and_grad"))
    sink = Activations(name_map, layer_kinds)
    inner = _wrap_for_activations(fun, has_aux, sink, linen=activations)
    vg = jax.value_and_grad(
        inner, argnums, has_aux=True, holomorphic=holomorphic, allow_int=allow_int
    )

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        step = kwargs.pop(step_kwarg, None) if step_kwarg else None
        if step_kwarg and step is None:
            raise TypeError(f"missing the step keyword argument {step_kwarg!r}")
        (value, (aux, (acts, state))), grads = vg(*args, **kwargs)
        params = args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in argnums)
        if not recorder.policy.records_kind(Kind.ACTIVATION):
            acts = {}
        probe_fn = None
        if probe is not None and acts:

            def probe_fn() -> dict[str, jax.Array]:
                a, kw = _substitute(args, kwargs, probe)
                _, (_, (probe_acts, _)) = inner(*a, **kw)
                return probe_acts

        _record(
            recorder, params, grads, acts, state, sink,
            argnums=argnums, name_map=name_map, step=step, counter=counter, probe=probe_fn,
        )  # fmt: skip
        return ((value, aux), grads) if has_aux else (value, grads)

    return wrapped


def nnx_value_and_grad(
    fun: Callable[..., Any],
    argnums: int = 0,
    has_aux: bool = False,
    *,
    recorder: Recorder,
    name_map: NameMap = None,
    step_kwarg: str | None = None,
    start_step: int | None = None,
    activations: bool = True,
    probe: Mapping[int | str, Any] | None = None,
    layer_kinds: LayerKinds = None,
) -> Callable[..., Any]:
    """Drop-in for :func:`flax.nnx.value_and_grad` (differentiates the ``nnx.Param``
    state of the module at ``argnums``) that records ``param``, ``grad`` and, when the
    policy asks, ``activation`` (``__call__`` outputs of layers, captured with
    ``nnx.capture``). ``nnx.BatchStat`` variables (BatchNorm ``mean``/``var``) are
    recorded as ``param`` ``running_mean``/``running_var``, read before the call (θ_t).
    Returns exactly what ``nnx.value_and_grad`` returns (grads as an ``nnx.State``).
    Names: the module's attribute path, list indices as segments (``layers/0/kernel``) —
    the same names a Linen model with submodules ``layers_0`` gets. ``layer_kinds``,
    ``probe`` and step accounting as in :func:`value_and_grad`; the probe's forward pass
    runs on a copy of the module (``nnx.split``/``nnx.merge``), so whatever it updates
    (BatchNorm statistics, RNG counts) never reaches the trained model. Use it inside
    ``nnx.jit`` or ``jax.jit`` as you would ``nnx.value_and_grad``.

    Forward order is not known here (``nnx.capture`` returns outputs by path), so the
    store's ``forward_order`` is left to the user (``Recorder(user={"forward_order":
    [...]})``).
    """
    from flax import nnx

    from .flax import layer_kind_of
    from .names import default_segments

    _set_producer(recorder)
    counter = StepCounter(first_step(recorder, start_step, "traintape.jax.nnx_value_and_grad"))
    sink = Activations(name_map, layer_kinds)
    want_acts = activations and recorder.policy.records_kind(Kind.ACTIVATION)

    def inner(*args: Any, **kwargs: Any) -> Any:
        sink.items.clear()
        if want_acts:
            out = nnx_capture(lambda m, *a, **k: fun(*args[:argnums], m, *a, **k), sink)(
                args[argnums], *args[argnums + 1 :], **kwargs
            )
        else:
            out = fun(*args, **kwargs)
        value, aux = out if has_aux else (out, None)
        return value, (aux, sink.finish())

    vg = nnx.value_and_grad(inner, argnums=argnums, has_aux=True)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        step = kwargs.pop(step_kwarg, None) if step_kwarg else None
        if step_kwarg and step is None:
            raise TypeError(f"missing the step keyword argument {step_kwarg!r}")
        model = args[argnums]
        kinds: dict[str, str | None] = {}
        sink.state.clear()
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module):
                layer = join(default_segments([*cast(tuple[str | int, ...], path), "x"])[:-1])
                kinds[layer] = sink.kind(tuple(path), node)[0] or layer_kind_of(node)
                stats = {k: v[...] for k, v in vars(node).items() if isinstance(v, nnx.BatchStat)}
                if stats:  # before the call: θ_t
                    sink.add_state(tuple(path), stats, kinds[layer])
        state = {n: a for n, (a, _, _) in sink.state.items()}
        # θ_t as called, for the probe (only when activations are recorded at all)
        before = nnx.split(model) if probe is not None and want_acts else None
        (value, (aux, acts)), grads = vg(*args, **kwargs)
        params = nnx.state(model, nnx.Param)
        probe_fn = None
        if before is not None and probe is not None and acts:

            def probe_fn() -> dict[str, jax.Array]:
                a, kw = _substitute(args, kwargs, probe)
                # a copy whose variables belong to this trace (NNX refuses to mutate the
                # outer ones): what the probe updates (BatchNorm stats, RNG counts) is dropped
                graph, st = before
                a[argnums] = nnx.merge(graph, jax.tree_util.tree_map(lambda v: v, st))
                return inner(*a, **kw)[1][1]

        _record(
            recorder, params, grads, acts, state, sink,
            argnums=0, name_map=name_map, step=step, counter=counter, layer_kinds=kinds,
            probe=probe_fn, acts_in_forward_order=False,
        )  # fmt: skip
        return ((value, aux), grads) if has_aux else (value, grads)

    return wrapped
