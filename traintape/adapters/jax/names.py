"""Pytree key paths → canonical names and tensor specs (JAX / Flax).

Rules (DESIGN "Canonical names"):

- dict keys and attribute names are segments; sequence indices are integer segments;
- a trailing ``value`` attribute (Flax NNX ``Variable`` / Linen boxed values) is dropped;
- a leading Flax Linen collection (``params``, ``batch_stats``) is dropped;
- Linen list submodules ``layers_0`` become ``layers/0`` (:func:`split_indexed`);
- the leaf becomes its canonical role (``embeddings`` → ``embedding``, ``mean`` →
  ``running_mean``, ``gamma`` → ``scale`` ...);
- the user's ``name_map`` (mapping or callable) is applied last, by the shared
  :func:`traintape.core.naming.canonical_name`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from traintape.core.naming import NameMap, canonical_name, split_indexed
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
    dtype: np.dtype


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

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    leaves: list[Leaf] = []
    seen: dict[str, str] = {}
    for i, (path, x) in enumerate(flat):
        dtype = np.dtype(getattr(x, "dtype", np.float32))
        if dtype.kind not in "fc" and dtype.name != "bfloat16":
            continue
        raw = [*prefix, *raw_segments(path)] or [root]
        source = "/".join(str(s) for s in raw)
        name = canonical_name(default_segments(raw), name_map, source)
        if name in seen:
            raise RecordError(
                f"leaves {seen[name]!r} and {source!r} both map to canonical name {name!r}; "
                f"pass a name_map to tell them apart"
            )
        seen[name] = source
        leaves.append(Leaf(name, source, i, tuple(np.shape(x)), dtype))
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
    """Tensor specs of ``leaves`` for ``kind`` (JAX layouts are canonical: no permutation).

    For activations the leading (batch) axis of ``shape`` is ``None``.
    """
    lk = dict(infer_layer_kinds(leaves))
    if layer_kinds:
        lk.update({k: v for k, v in layer_kinds.items() if v is not None})
    specs = []
    for leaf in leaves:
        layer, role = split_name(leaf.name)
        shape: list[int | None] = list(leaf.shape)
        if kind == Kind.ACTIVATION and shape:
            shape[0] = None
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
                source_shape=shape,
            )
        )
    return specs
