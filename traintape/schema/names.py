"""Canonical tensor names: the grammar every adapter must produce.

A canonical name is a ``/``-separated module path followed by a role leaf, e.g.
``encoder/layers/3/attn/q/kernel``. Segments match ``[A-Za-z0-9_-]+`` and are at most
200 characters long; empty, ``.`` and ``..`` segments are refused, so a name can never escape the store directory it
names. Sequence indices are their own (integer) segment: ``layers/0/kernel``.
"""

from __future__ import annotations

import itertools
import re
from typing import Annotated

from pydantic import AfterValidator

SEGMENT_PATTERN = r"[A-Za-z0-9_-]+"
_SEGMENT_RE = re.compile(rf"^{SEGMENT_PATTERN}$")
NAME_PATTERN = rf"^{SEGMENT_PATTERN}(/{SEGMENT_PATTERN})*$"
MAX_SEGMENT_LENGTH = 200
"""Longest segment: each segment is a directory or object-key component of the store
(filesystems refuse components over 255 bytes; some room is left for chunk keys)."""


class InvalidNameError(ValueError):
    """A canonical name breaks the grammar; the message names the offending segment."""


def validate_name(name: str) -> str:
    """Return ``name`` unchanged if it is a valid canonical name, else raise.

    Raises:
        InvalidNameError: naming the first bad segment and its position.
    """
    if not isinstance(name, str):
        raise InvalidNameError(f"canonical name must be a string, got {type(name).__name__}")
    if name == "":
        raise InvalidNameError("canonical name is empty")
    for i, seg in enumerate(name.split("/")):
        if seg == "":
            raise InvalidNameError(f"canonical name {name!r}: segment {i} is empty")
        if seg in (".", ".."):
            raise InvalidNameError(f"canonical name {name!r}: segment {i} is {seg!r}")
        if len(seg) > MAX_SEGMENT_LENGTH:
            raise InvalidNameError(
                f"canonical name {name[:80]!r}...: segment {i} is {len(seg)} characters long, "
                f"more than {MAX_SEGMENT_LENGTH}"
            )
        if not _SEGMENT_RE.match(seg):
            bad = sorted({c for c in seg if not re.match(r"[A-Za-z0-9_-]", c)})
            raise InvalidNameError(
                f"canonical name {name!r}: segment {i} {seg!r} has characters {bad!r} "
                f"outside [A-Za-z0-9_-]"
            )
    return name


def split_name(name: str) -> tuple[str, str]:
    """Split a canonical name into (layer path, role leaf). The layer path may be ''."""
    layer, _, role = name.rpartition("/")
    return layer, role


def check_no_prefix_clash(names: list[str]) -> None:
    """Refuse a set of names where one is a path prefix of another.

    ``a/b`` and ``a/b/c`` cannot both be arrays: ``a/b`` would be a group and an array.
    """
    ordered = sorted(names)
    for a, b in itertools.pairwise(ordered):
        if b.startswith(a + "/"):
            raise InvalidNameError(
                f"canonical names {a!r} and {b!r} clash: {a!r} is a path prefix of {b!r}"
            )


CanonicalName = Annotated[str, AfterValidator(validate_name)]
"""A ``str`` validated against the canonical name grammar (for use in Pydantic models)."""
