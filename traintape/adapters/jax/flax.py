"""Activation capture for Flax: Linen via ``nn.intercept_methods``, NNX via ``nnx.capture``.

An activation is the output of a *layer*'s ``__call__``, named ``<module path>/output``
(Linen ``layers_0`` → ``layers/0``). A layer is a module that owns ``params`` leaves
itself (Dense, Conv, Embed, LayerNorm, BatchNorm, ...), a Flax attention module, or a
module given a kind by the user's ``layer_kinds`` option (e.g. ``{"attn": "attention"}``
for a custom attention block, ``{"gru": "gru"}`` for a hand-written recurrent layer).
An *attention* layer is one layer, as in PyTorch and Keras: its own output is recorded
and the outputs of its sub-modules (q/k/v/o projections) are not. Outputs that are not
a single array (e.g. recurrent cells returning ``(carry, y)``) are skipped. A module
called twice in one step keeps its first output.

Linen also yields the ``batch_stats`` of BatchNorm-like modules as read *before* the
call (θ_t; the call updates them), recorded as ``param`` ``running_mean``/``running_var``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from traintape.core.naming import (
    LayerKinds,
    NameMap,
    canonical_name,
    check_layer_kinds,
    lookup_layer_kind,
    split_indexed,
)
from traintape.schema.names import split_name
from traintape.schema.roles import ATTENTION, canonical_role

from .names import raw_segments

_LINEN_KINDS = {
    "Dense": "dense",
    "DenseGeneral": "dense",
    "Conv": "conv",
    "ConvTranspose": "conv",
    "Embed": "embedding",
    "LayerNorm": "layer_norm",
    "RMSNorm": "rms_norm",
    "GroupNorm": "group_norm",
    "BatchNorm": "batch_norm",
    "Linear": "dense",
    "LinearGeneral": "dense",
    "MultiHeadDotProductAttention": "attention",
    "MultiHeadAttention": "attention",
    "SelfAttention": "attention",
}
"""Flax (Linen and NNX) module class → canonical layer kind."""


def layer_kind_of(module: Any) -> str | None:
    for cls in type(module).__mro__:
        if cls.__name__ in _LINEN_KINDS:
            return _LINEN_KINDS[cls.__name__]
    return None


def _segments(path: tuple[Any, ...]) -> list[str]:
    out: list[str] = []
    for p in path:
        out.extend([str(p)] if isinstance(p, int) else split_indexed(str(p)))
    return out


class Activations:
    """Trace-time collection for one forward pass.

    ``items``: activation name → (array, layer kind, source name), in call-completion
    (forward) order; ``state``: non-trainable ``param`` leaves (BatchNorm statistics)
    name → (array, layer kind, source name).
    """

    def __init__(self, name_map: NameMap = None, layer_kinds: LayerKinds = None) -> None:
        self.name_map = name_map
        self.layer_kinds = check_layer_kinds(layer_kinds)
        self.items: dict[str, tuple[jax.Array, str | None, str]] = {}
        self.state: dict[str, tuple[jax.Array, str | None, str]] = {}

    def clear(self) -> None:
        self.items.clear()
        self.state.clear()

    def layer(self, path: tuple[Any, ...]) -> tuple[str, str]:
        """(canonical layer path, source name) of a module path."""
        source = "/".join(str(p) for p in (*path, "output"))
        name = canonical_name([*_segments(path), "output"], self.name_map, source)
        return split_name(name)[0], source

    def kind(self, path: tuple[Any, ...], module: Any) -> tuple[str | None, bool]:
        """(layer kind, whether the user named it) of the module at ``path``."""
        given = lookup_layer_kind(self.layer(path)[0], self.layer_kinds)
        return (given, True) if given is not None else (layer_kind_of(module), False)

    def add(self, path: tuple[Any, ...], out: Any, kind: str | None) -> None:
        if not isinstance(out, jax.Array) or out.ndim == 0:
            return
        layer, source = self.layer(path)
        self.items.setdefault(f"{layer}/output" if layer else "output", (out, kind, source))

    def add_state(self, path: tuple[Any, ...], leaves: Any, kind: str | None) -> None:
        """Record a module's own non-trainable variables (dict leaf name → array)."""
        for leaf, value in leaves.items():
            if not isinstance(value, jax.Array):
                continue
            source = "/".join(str(p) for p in (*path, leaf))
            segs = [*_segments(path), canonical_role(str(leaf))]
            self.state.setdefault(canonical_name(segs, self.name_map, source),
                                  (value, kind, source))  # fmt: skip

    def layers_kinds(self) -> dict[str, str | None]:
        """Layer path → kind of every layer seen (activations and state)."""
        out = {split_name(n)[0]: k for n, (_, k, _) in self.items.items()}
        for n, (_, k, _) in self.state.items():
            out.setdefault(split_name(n)[0], k)
        out.update({k: v for k, v in self.layer_kinds.items() if "*" not in k and "?" not in k})
        return out

    def finish(self) -> dict[str, jax.Array]:
        """Drop outputs of sub-modules of attention layers; name → array, forward order."""
        attn = [n[: -len("output")] for n, (_, k, _) in self.items.items() if k == ATTENTION]
        for name in list(self.items):
            if any(name.startswith(p) and name != p + "output" for p in attn):
                del self.items[name]
        return {n: a for n, (a, _, _) in self.items.items()}


def _batch_stats(module: Any) -> dict[str, Any]:
    """The module's own ``batch_stats`` leaves (Linen), {} if none."""
    try:
        own = module.variables.get("batch_stats", {})
    except Exception:
        return {}
    return {k: v for k, v in own.items() if not hasattr(v, "keys")}


def _owns_params(module: Any) -> bool:
    try:
        params = module.variables.get("params", {})
    except Exception:
        return False
    return any(not hasattr(v, "keys") for v in params.values())


@contextlib.contextmanager
def linen_activations(sink: Activations) -> Iterator[None]:
    """Within the block, record outputs of parametrised Linen modules into ``sink``."""
    import flax.linen as nn

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, ctx: Any) -> Any:
        if ctx.method_name != "__call__":
            return next_fun(*args, **kwargs)
        module, path = ctx.module, tuple(ctx.module.path)
        kind, named = sink.kind(path, module)
        stats = _batch_stats(module)
        if stats:  # before the call: θ_t (a training-mode call updates them)
            sink.add_state(path, stats, kind)
        out = next_fun(*args, **kwargs)
        if named or kind == ATTENTION or _owns_params(module):
            sink.add(path, out, kind)
        return out

    with nn.intercept_methods(interceptor):
        yield


def nnx_capture(fn: Callable[..., Any], sink: Activations) -> Callable[..., Any]:
    """Wrap ``fn(model, *args)`` so outputs of parametrised NNX submodules land in ``sink``.

    Uses ``nnx.capture(..., method_outputs=nnx.Intermediate)`` and keeps the ``__call__``
    outputs of layers (modules owning ``nnx.Param`` leaves directly, attention modules,
    modules named in ``layer_kinds``).
    """
    from flax import nnx

    def wrapped(model: Any, *args: Any, **kwargs: Any) -> Any:
        owners: dict[tuple[Any, ...], str | None] = {}
        for path, node in nnx.iter_graph(model):
            if not isinstance(node, nnx.Module):
                continue
            kind, named = sink.kind(tuple(path), node)
            if (
                named
                or kind == ATTENTION
                or any(isinstance(v, nnx.Param) for v in vars(node).values())
            ):
                owners[tuple(path)] = kind
        out, inter = nnx.capture(fn, nnx.Intermediate, method_outputs=nnx.Intermediate)(
            model, *args, **kwargs
        )
        for kp, value in jax.tree_util.tree_flatten_with_path(inter)[0]:
            segs = raw_segments(kp)
            # [..module path.., '__call__', 'value', 0]
            if "__call__" not in segs:
                continue
            at = segs.index("__call__")
            mpath = tuple(segs[:at])
            if mpath in owners and segs[at + 1 :] in ([0], ["value", 0]):
                sink.add(mpath, value, owners[mpath])
        return out

    return wrapped
