"""Name mapping shared by every adapter: the ``name_map`` option and path joining.

Each adapter turns its framework's paths into a list of segments (framework-specific,
in the adapter), then calls :func:`canonical_name`, which applies the user's
``name_map`` and validates the result against the schema grammar.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping

from traintape.schema import validate_name
from traintape.schema.roles import LAYER_KINDS

NameMap = Mapping[str, str] | Callable[[str], str] | None
"""User option: a mapping from a default canonical name (or the framework's own
source name) to the wanted canonical name, or a callable doing the same."""

LayerKinds = Mapping[str, str] | None
"""User option: canonical layer path, or an ``fnmatch`` pattern such as ``blocks/*/attn``
→ canonical layer kind (``dense``, ``attention``, ``gru``, ... see
:mod:`traintape.schema.roles`). For layers an adapter cannot classify by itself (a
custom module); overrides what the adapter infers."""


def check_layer_kinds(layer_kinds: LayerKinds) -> dict[str, str]:
    """Validate the ``layer_kinds`` option; raises ``ValueError`` naming a bad entry."""
    out = dict(layer_kinds or {})
    for path, kind in out.items():
        if kind not in LAYER_KINDS:
            raise ValueError(
                f"layer_kinds[{path!r}] = {kind!r} is not a layer kind; "
                f"use one of {sorted(LAYER_KINDS)}"
            )
    return out


def lookup_layer_kind(layer: str, layer_kinds: Mapping[str, str]) -> str | None:
    """The kind ``layer_kinds`` gives canonical layer path ``layer`` (exact match first,
    then the first matching pattern), or None."""
    if layer in layer_kinds:
        return layer_kinds[layer]
    for pattern, kind in layer_kinds.items():
        if fnmatch.fnmatchcase(layer, pattern):
            return kind
    return None


_INDEXED = re.compile(r"^(?P<base>[A-Za-z][A-Za-z0-9_-]*?)_(?P<index>\d+)$")


def split_indexed(segment: str) -> list[str]:
    """``layers_0`` → ``['layers', '0']`` (Flax Linen list submodules); else unchanged."""
    m = _INDEXED.match(segment)
    return [m["base"], m["index"]] if m else [segment]


def join(segments: Iterable[str | int]) -> str:
    return "/".join(str(s) for s in segments)


def apply_name_map(name: str, name_map: NameMap, source_name: str | None = None) -> str:
    """Apply ``name_map`` to a default canonical ``name`` and validate the result.

    A mapping is looked up by the canonical name first, then by ``source_name``;
    names not in it are kept. A callable receives the canonical name.
    """
    if name_map is None:
        out = name
    elif callable(name_map):
        out = name_map(name)
    else:
        out = name_map.get(name, name_map.get(source_name, name) if source_name else name)
    return validate_name(out)


def canonical_name(
    segments: Iterable[str | int], name_map: NameMap = None, source_name: str | None = None
) -> str:
    """Join segments with ``/``, apply ``name_map``, validate (raises InvalidNameError)."""
    return apply_name_map(join(segments), name_map, source_name)
