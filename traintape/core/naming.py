"""Name mapping shared by every adapter: the ``name_map`` option and path joining.

Each adapter turns its framework's paths into a list of segments (framework-specific,
in the adapter), then calls :func:`canonical_name`, which applies the user's
``name_map`` and validates the result against the schema grammar.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from traintape.schema import validate_name

NameMap = Mapping[str, str] | Callable[[str], str] | None
"""User option: a mapping from a default canonical name (or the framework's own
source name) to the wanted canonical name, or a callable doing the same."""

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
