"""Deleting a run store: exactly the keys its manifest (and its rewind copies) vouch for.

``traintape rm`` deletes a store's own keys and nothing else: a user's file inside the
store's directories (``stats/MY_NOTES.txt``, ``.traintape/my.cfg``) is listed and left
where it is. A key is the store's when it is

- the root ``zarr.json`` (and its ``.__lock`` temporaries);
- a key of the writer's control area: the claim (``.traintape/writer.json``), progress
  records (``.traintape/progress/<rank>.json``), their ``.__lock`` temporaries;
- a key of an array at a layout path that the manifest declares (metadata, chunks,
  ``.__lock`` temporaries of interrupted chunk writes) or that the writer left there
  uncommitted (a node with its ``zarr.json`` at a layout path), or a group ``zarr.json``
  on the way to one;
- a key of a rewind copy ``abandoned/<k>`` by the same rules (each copy is a store), and
  the ``abandoned`` group itself.

What remains afterwards is only what was not the store's: with nothing foreign left the
location is empty (a new Recorder can use it); otherwise it is listed.
"""

from __future__ import annotations

import re

from traintape.core import layout as L
from traintape.core.kvstore import KvStore
from traintape.core.store import read_manifest
from traintape.schema import Kind, Manifest

_LOCK = re.compile(r"\.(\d+\.)?__lock$")
_CONTROL = re.compile(r"^\.traintape/(writer\.json|progress/\d+\.json)$")


def declared_arrays(m: Manifest) -> set[str]:
    """Every array path the manifest declares (committed or not)."""
    paths = {L.STEPS} | {L.stats_path(k) for k in m.kinds()}
    paths |= {L.metric_path(n) for n in m.metrics}
    for kind in {*m.kinds(), *m.commit.snapshots}:
        paths.add(L.snapshot_steps_path(Kind(kind)))
        paths |= {L.snapshot_path(Kind(kind), s.name) for s in m.specs(Kind(kind))}
    return paths


def split_store_keys(keys: list[str], m: Manifest) -> tuple[list[str], list[str]]:
    """``(ours, foreign)`` among the keys of one store (paths relative to its root)."""
    nodes = {k[: -len("/zarr.json")] for k in keys if k.endswith("/zarr.json")}
    arrays = declared_arrays(m) | {n for n in nodes if L.is_layout_path(n)}
    groups = L.parent_groups(sorted(arrays)) - {""}
    ours: list[str] = []
    foreign: list[str] = []
    for k in keys:
        bare = _LOCK.sub("", k)
        own = (
            bare == "zarr.json"
            or bool(_CONTROL.match(bare))
            or any(bare == f"{g}/zarr.json" for g in groups)
            or _in_array(bare, arrays)
        )
        (ours if own else foreign).append(k)
    return ours, foreign


def _in_array(key: str, arrays: set[str]) -> bool:
    """``key`` is an array's metadata or one of its chunks (``<array>/c/...``)."""
    if key.endswith("/zarr.json") and key[: -len("/zarr.json")] in arrays:
        return True
    i = key.find("/c/")
    while i >= 0:
        if key[:i] in arrays:
            return True
        i = key.find("/c/", i + 1)
    return False


def store_keys_to_delete(kv: KvStore, m: Manifest, url: str) -> tuple[list[str], list[str]]:
    """``(ours, foreign)`` of the store at ``url`` (manifest ``m``), rewind copies
    included: each copy under ``abandoned/<k>`` by its own manifest (a copy without a
    readable manifest — a rewind killed during its copy — by the layout alone)."""
    from traintape.core.rewind import ABANDONED, abandoned_url

    keys = kv.list()
    inside = [k for k in keys if not k.startswith(ABANDONED + "/")]
    ours, foreign = split_store_keys(inside, m)
    copies: dict[str, list[str]] = {}
    for k in keys:
        if k.startswith(ABANDONED + "/"):
            seg = k.split("/")[1]
            if seg.isdigit() and k.count("/") >= 2:
                copies.setdefault(seg, []).append(k)
            elif k == f"{ABANDONED}/zarr.json":
                ours.append(k)
            else:
                foreign.append(k)
    for seg, ck in sorted(copies.items()):
        prefix = f"{ABANDONED}/{seg}/"
        try:
            cm = read_manifest(abandoned_url(url, int(seg)))
        except Exception:  # unfinished copy of this store's arrays
            cm = m
        o, f = split_store_keys([k[len(prefix) :] for k in ck], cm)
        ours += [prefix + k for k in o]
        foreign += [prefix + k for k in f]
    return ours, foreign
