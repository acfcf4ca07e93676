"""Pytree key paths → canonical names and tensor specs (JAX / Flax).

Rules (docs/store-format.md, "Canonical names"):

- dict keys and attribute names are segments; sequence indices are integer segments;
- a trailing ``value`` attribute (Flax NNX ``Variable`` / Linen boxed values) is dropped;
- a leading Flax Linen collection (``params``, ``batch_stats``) is dropped;
- Linen list submodules ``layers_0`` become ``layers/0`` (:func:`split_indexed`);
- the leaf becomes its canonical role (``embeddings`` → ``embedding``, ``mean`` →
  ``running_mean``, ``gamma`` → ``scale`` ...);
- Flax attention (Linen ``MultiHeadDotProductAttention``, NNX ``MultiHeadAttention``):
  a layer whose sub-layers are exactly ``query``, ``key``, ``value``, ``out`` with
  ``DenseGeneral`` kernels becomes the canonical ``q``, ``k``, ``v``, ``o`` dense
  sub-layers, kernels reshaped to (in, heads * head_dim) / (heads * head_dim, out) and
  q/k/v biases to (heads * head_dim,) (row-major reshapes; ``source_shape`` keeps
  Flax's) — the layout PyTorch's ``in_proj_weight`` and Keras's attention kernels map to;
- the user's ``name_map`` (mapping or callable) is applied last, by the shared
  :func:`traintape.core.naming.apply_name_map`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from traintape.core.naming import NameMap, apply_name_map, join, split_indexed
from traintape.schema import Kind, TensorSpec, split_name
from traintape.schema.roles import canonical_role

COLLECTIONS = ("params", "batch_stats")
"""Flax Linen variable collections stripped from the front of a path."""


def _key_segment(k: Any) -> str | int:
    if isinstance(k, jax.tree_util.DictKey):
        return k.key if isinstance(k.key, int) else str(k.key)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return k.key
    return str(k)


def raw_segments(path: Sequence[Any]) -> list[str | int]:
    """The segments of a key path as written by the framework (no renaming)."""
    segs = [_key_segment(k) for k in path]
    if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and segs[-1] == "value":
        segs = segs[:-1]
    return segs


def default_segments(raw: Sequence[str | int], *, strip_collections: bool = True) -> list[str]:
    """Canonical segments from raw ones (collections stripped, indices split, role leaf)."""
    segs = list(raw)
    if strip_collections and len(segs) > 1 and segs[0] in COLLECTIONS:
        segs = segs[1:]
    out: list[str] = []
    for s in segs:
        if isinstance(s, int):
            out.append(str(s))
        else:
            out.extend(split_indexed(s))
    if out:
        out[-1] = canonical_role(out[-1])
    return out


@dataclass(frozen=True)
class Leaf:
    """One named array leaf of a pytree (trace-time description)."""

    name: str
    source_name: str
    index: int
    """Position among the tree's flattened leaves."""
    shape: tuple[int, ...]
    """Canonical shape."""
    dtype: np.dtype
    source_shape: tuple[int, ...] | None = None
    """The framework's shape when it differs (a row-major reshape or a transpose), else None."""
    permutation: tuple[int, ...] | None = None
    """canonical = source.transpose(permutation) (equinox's PyTorch-like layouts); None:
    identity (then a differing ``source_shape`` means a row-major reshape)."""
    layer_kind: str | None = None
    """Layer kind known from the owning module (equinox), else None (inferred)."""

    def canonical(self, x: Any) -> Any:
        """``x`` (this leaf's array as the framework holds it) in canonical layout."""
        if self.permutation is not None:
            return x.transpose(self.permutation)
        return x if self.source_shape is None else x.reshape(self.shape)


_FLAX_ATTENTION = {"query": "q", "key": "k", "value": "v", "out": "o"}


def _attention_layout(
    names: list[list[str]], shapes: list[tuple[int, ...]]
) -> list[tuple[list[str], tuple[int, ...] | None]]:
    """Rename Flax attention sub-layers to q/k/v/o and flatten their head axes (see the
    module docstring). Returns (segments, canonical shape or None) per leaf."""
    by_name = {join(n): shape for n, shape in zip(names, shapes, strict=True)}
    layers = {
        join(n[:-2])
        for n in names
        if len(n) >= 2 and n[-1] == "kernel" and n[-2] == "query"
        and all(len(by_name.get(join([*n[:-2], sub, "kernel"]), ())) == 3
                for sub in _FLAX_ATTENTION)
    }  # fmt: skip
    out: list[tuple[list[str], tuple[int, ...] | None]] = []
    for n, shape in zip(names, shapes, strict=True):
        if len(n) < 2 or join(n[:-2]) not in layers or n[-2] not in _FLAX_ATTENTION:
            out.append((n, None))
            continue
        sub, role = n[-2], n[-1]
        new: tuple[int, ...] | None = None
        if role == "kernel":
            new = (
                (shape[0] * shape[1], shape[2]) if sub == "out" else (shape[0], shape[1] * shape[2])
            )
        elif role == "bias" and sub != "out" and len(shape) == 2:
            new = (shape[0] * shape[1],)
        out.append(([*n[:-2], _FLAX_ATTENTION[sub], role], new))
    return out


def named_leaves(
    tree: Any,
    name_map: NameMap = None,
    *,
    prefix: Sequence[str | int] = (),
    root: str = "arg0",
) -> list[Leaf]:
    """Name every array leaf of ``tree`` (non-float leaves such as ``float0`` are skipped).

    A tree that is a single bare array is named ``root``.

    Raises ``RecordError`` when two leaves map to the same canonical name.
    """
    from traintape.core.errors import RecordError

    from .equinox import EqxLayout, equinox_layouts

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    eqx = equinox_layouts(tree)  # {} unless the tree holds equinox modules
    found: list[tuple[int, str, list[str], tuple[int, ...], np.dtype]] = []
    eqx_of: dict[int, EqxLayout] = {}
    for i, (path, x) in enumerate(flat):
        dtype = np.dtype(getattr(x, "dtype", np.float32))
        if dtype.kind not in "fc" and dtype.name != "bfloat16":
            continue
        raw = [*prefix, *raw_segments(path)] or [root]
        source = "/".join(str(s) for s in raw)
        segs = default_segments(raw)
        if i in eqx:
            eqx_of[i] = eqx[i]
            segs = default_segments([*prefix, *eqx[i].segments], strip_collections=False)
        found.append((i, source, segs, tuple(np.shape(x)), dtype))
    layouts = _attention_layout([f[2] for f in found], [f[3] for f in found])
    leaves: list[Leaf] = []
    seen: dict[str, str] = {}
    for (i, source, _, shape, dtype), (segs, new_shape) in zip(found, layouts, strict=True):
        name = apply_name_map(join(segs), name_map, source)
        if name in seen:
            raise RecordError(
                f"leaves {seen[name]!r} and {source!r} both map to canonical name {name!r}; "
                f"pass a name_map to tell them apart"
            )
        seen[name] = source
        if i in eqx_of:
            lay = eqx_of[i]
            leaves.append(Leaf(name, source, i, lay.shape, dtype, source_shape=shape,
                               permutation=lay.permutation, layer_kind=lay.layer_kind))  # fmt: skip
        elif new_shape is None:
            leaves.append(Leaf(name, source, i, shape, dtype))
        else:
            leaves.append(Leaf(name, source, i, new_shape, dtype, source_shape=shape))
    return leaves


def infer_layer_kinds(leaves: Sequence[Leaf]) -> dict[str, str | None]:
    """Best-effort canonical layer kind per layer path, from roles and shapes.

    ``kernel`` of rank 2 → dense, rank >= 3 → conv (a Flax ``DenseGeneral`` attention
    kernel ``(in, heads, head_dim)`` is reported as conv: name it with ``layer_kinds``);
    ``embedding`` → embedding; ``scale`` with running statistics → batch_norm; other
    norms are left ``None`` unless known from the module (NNX graph / Linen interceptor).
    """
    roles: dict[str, dict[str, int]] = {}
    for leaf in leaves:
        layer, role = split_name(leaf.name)
        roles.setdefault(layer, {})[role] = len(leaf.shape)
    kinds: dict[str, str | None] = {}
    for layer, rs in roles.items():
        kind: str | None = None
        if "kernel" in rs:
            kind = "dense" if rs["kernel"] == 2 else "conv" if rs["kernel"] > 2 else None
        elif "embedding" in rs:
            kind = "embedding"
        elif "running_mean" in rs or "running_var" in rs:
            kind = "batch_norm"
        kinds[layer] = kind
    return kinds


def specs_for(
    leaves: Sequence[Leaf],
    kind: Kind,
    layer_kinds: dict[str, str | None] | None = None,
) -> list[TensorSpec]:
    """Tensor specs of ``leaves`` for ``kind`` (Flax layouts are canonical; equinox leaves
    carry their ``permutation`` / reshape ``source_shape``).

    For activations the leading (batch) axis of ``shape`` is ``None``.
    """
    lk = dict(infer_layer_kinds(leaves))
    lk.update({split_name(lf.name)[0]: lf.layer_kind for lf in leaves if lf.layer_kind})
    if layer_kinds:
        lk.update({k: v for k, v in layer_kinds.items() if v is not None})
    specs = []
    for leaf in leaves:
        layer, role = split_name(leaf.name)
        shape: list[int | None] = list(leaf.shape)
        if kind == Kind.ACTIVATION and shape:
            shape[0] = None
        source_shape = shape if leaf.source_shape is None else list(leaf.source_shape)
        specs.append(
            TensorSpec(
                name=leaf.name,
                kind=kind,
                role=role,
                layer=layer,
                layer_kind=lk.get(layer),
                dtype=leaf.dtype.name,
                shape=shape,
                source_name=leaf.source_name,
                source_shape=source_shape,
                permutation=None if leaf.permutation is None else list(leaf.permutation),
            )
        )
    return specs
