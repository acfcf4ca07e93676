"""Migrations of manifest documents written by older readable schema versions.

:func:`migrate` is applied to every manifest document before validation (the
:class:`~traintape.schema.Manifest` model calls it), so readers always see the current
model; a store resumed by this build is rewritten in the current version.

==========  ===============================================================
1.0.0       ``forward_order`` lived in the free-form ``user`` dict
1.1.0       ``forward_order`` is a typed manifest field; ``layer_kind`` is the closed
            set of :data:`~traintape.schema.roles.LayerKind`; canonical name segments
            are at most 200 characters
1.2.0       ``producer.stats_backend`` (optional; older stores read it as None)
1.3.0       layer kind ``lora`` (LoRA/DoRA adapters; older stores never use it);
            ``Event.type`` is a closed set (``EventType``) or ``user/<name>``: an
            older store's other event types become ``user/<type>`` (``user/event``
            with ``data.original_type`` when the type is not a valid name segment)
1.4.0       the stat vector gains ``sig`` (layout signature; raw field ``sig``). An
            older store keeps the ``stat_names`` it was written with (its stats arrays
            have those columns): readers look statistics up by name, ``sig`` is not
            recorded there, and ``compare`` skips it, saying so. A document without
            ``stat_names`` gets the pre-1.4.0 stat vector. This build does not resume
            such a store (its rows would have another width)
==========  ===============================================================
"""

from __future__ import annotations

from typing import Any

from traintape.schema.names import validate_name
from traintape.schema.stats import LEGACY_STAT_NAMES
from traintape.schema.version import SCHEMA_VERSION, parse_version


def migrate(doc: Any) -> Any:
    """Return manifest document ``doc`` (a JSON object) in the current schema version.

    Documents that are not objects, or carry no parseable version, are returned as they
    are (validation then reports what is wrong with them).
    """
    if not isinstance(doc, dict):
        return doc
    version = doc.get("schema_version")
    try:
        v = parse_version(version) if isinstance(version, str) else None
    except ValueError:
        v = None
    if v is None or v >= parse_version(SCHEMA_VERSION):
        return doc
    out = dict(doc)
    if v < (1, 1, 0):
        user = dict(out.get("user") or {})
        order = user.pop("forward_order", None)
        out["user"] = user
        if out.get("forward_order") is None and order is not None:
            out["forward_order"] = [str(x) for x in order]
    if v < (1, 3, 0) and isinstance(out.get("events"), list):
        out["events"] = [_event_1_3(e) for e in out["events"]]
    if v < (1, 4, 0) and "stat_names" not in out:
        out["stat_names"] = list(LEGACY_STAT_NAMES[0])  # the stat vector before sig
    out["schema_version"] = SCHEMA_VERSION
    return out


_OWN_1_3 = ("nan", "inf", "note", "rewind")  # EventType as of 1.3.0 (fixed: a history)


def _event_1_3(ev: Any) -> Any:
    """An event of a store before 1.3.0 with its free-form type made ``user/<type>``."""
    if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
        return ev
    t = ev["type"]
    if t in _OWN_1_3 or t.startswith("user/"):
        return ev
    out = dict(ev)
    try:
        validate_name(t)
        ok = True
    except ValueError:
        ok = False
    if ok:
        out["type"] = f"user/{t}"
    else:
        out["type"] = "user/event"
        out["data"] = {**(ev.get("data") or {}), "original_type": t}
    return out
