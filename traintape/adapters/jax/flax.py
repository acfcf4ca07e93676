"""Activation capture for Flax: Linen via ``nn.intercept_methods``, NNX via ``nnx.capture``.

An activation is the output of a *parametrised* module's ``__call__`` (a module that owns
``params`` leaves itself: Dense, Conv, Embed, LayerNorm, BatchNorm, ...), named
``<module path>/output`` (Linen ``layers_0`` → ``layers/0``). Outputs that are not a single
array (e.g. recurrent cells returning ``(carry, y)``) are skipped. A module called twice
in one step keeps its first output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from traintape.core.naming import NameMap, canonical_name, split_indexed

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
    """Trace-time collection of activations: name → (array, layer kind, source name)."""

    def __init__(self, name_map: NameMap = None) -> None:
        self.name_map = name_map
        self.items: dict[str, tuple[jax.Array, str | None, str]] = {}

    def add(self, path: tuple[Any, ...], out: Any, kind: str | None) -> None:
        if not isinstance(out, jax.Array) or out.ndim == 0:
            return
        source = "/".join(str(p) for p in (*path, "output"))
        name = canonical_name([*_segments(path), "output"], self.name_map, source)
        self.items.setdefault(name, (out, kind, source))


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
        out = next_fun(*args, **kwargs)
        if ctx.method_name == "__call__" and _owns_params(ctx.module):
            sink.add(tuple(ctx.module.path), out, layer_kind_of(ctx.module))
        return out

    with nn.intercept_methods(interceptor):
        yield


def nnx_capture(fn: Callable[..., Any], sink: Activations) -> Callable[..., Any]:
    """Wrap ``fn(model, *args)`` so outputs of parametrised NNX submodules land in ``sink``.

    Uses ``nnx.capture(..., method_outputs=nnx.Intermediate)`` and keeps the ``__call__``
    outputs of modules that own ``nnx.Param`` leaves directly.
    """
    from flax import nnx

    def wrapped(model: Any, *args: Any, **kwargs: Any) -> Any:
        owners: dict[tuple[Any, ...], str | None] = {}
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module) and any(
                isinstance(v, nnx.Param) for v in vars(node).values()
            ):
                owners[tuple(path)] = layer_kind_of(node)
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
