"""Store I/O in one place: what is at a location, the TensorStore spec of every array,
the manifest document.

:func:`inspect_location` says what a location holds (nothing, a file, a store, an empty
directory, leftovers of an interrupted creation, someone else's files) — the one
diagnosis the Recorder, the reader, ``validate`` and the CLI act on. Readers and the
writer open arrays through :func:`open_array` (the one zarr3 spec builder) and read or
write the manifest (the ``"traintape"`` attribute of the root ``zarr.json``) through
:func:`read_manifest` / :func:`write_manifest`; :func:`storage_dtype` says how a tensor
dtype is stored on disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import numpy as np
import tensorstore as ts
from pydantic import ValidationError

from traintape.core import layout as L
from traintape.core.errors import NotAStoreError
from traintape.core.kvstore import CONTEXT, KvStore, kvstore_spec, local_path, normalize_url
from traintape.schema import MANIFEST_ATTR, Manifest, SchemaVersionError, check_readable

# ---------------------------------------------------------------------- locations
_OURS = (".traintape",)
"""Entries of a store location that are the writer claim's, not data."""

FOREIGN_SHOWN = 5
"""How many foreign entries a :class:`Location` names."""


def _leftover(name: str) -> bool:
    """Lock files of a write that never finished (e.g. ``zarr.json.__lock`` of a store
    whose creation was killed)."""
    return name.endswith(".__lock")


class LocationKind(StrEnum):
    """What is at a store location (:func:`inspect_location`)."""

    MISSING = "missing"
    """Local: nothing at the path (creating a store makes the directory)."""
    NOT_A_DIRECTORY = "not_a_directory"
    """Local: the path is a file (or anything else that is not a directory)."""
    STORE = "store"
    """A root ``zarr.json`` is there: a store to open or resume (whether it holds a
    traintape manifest, and one this version reads, is :func:`read_manifest`'s to say)."""
    EMPTY = "empty"
    """No ``zarr.json`` and nothing but the writer claim and lock files of an interrupted
    creation (:attr:`Location.leftovers`): a new store may be created here. A remote
    prefix with no keys at all is EMPTY too."""
    FOREIGN = "foreign"
    """No ``zarr.json`` and other entries (:attr:`Location.foreign`): someone else's
    directory (or prefix), never written into."""


@dataclass(frozen=True)
class Location:
    """What :func:`inspect_location` found at a store location."""

    url: str
    """The normalized kvstore URL (ending in ``/``)."""
    kind: LocationKind
    path: str | None = None
    """The filesystem path of a local location; None for a remote URL."""
    writable: bool | None = None
    """Local: whether the directory can be written (MISSING: whether the directory the
    store would be created in, :attr:`parent`, can); False for NOT_A_DIRECTORY. Remote:
    None — unknown until a write is tried."""
    parent: str | None = None
    """MISSING: the nearest existing ancestor of the path (where creating the store
    writes the first new directory)."""
    parent_is_dir: bool = False
    """MISSING: whether :attr:`parent` is a directory (else no store can be created)."""
    leftovers: tuple[str, ...] = ()
    """EMPTY: lock files of an interrupted creation (entry names, or keys of a remote
    location), which a writer holding the claim removes (:func:`remove_leftovers`)."""
    foreign: tuple[str, ...] = ()
    """FOREIGN: the first :data:`FOREIGN_SHOWN` entries (sorted) that are not a store's."""

    @property
    def exists(self) -> bool:
        """Whether a directory (or, remote, a prefix: always) is there to look into."""
        return self.kind not in (LocationKind.MISSING, LocationKind.NOT_A_DIRECTORY)


def inspect_location(url: str | os.PathLike[str]) -> Location:
    """Diagnose the store location ``url`` (local path or kvstore URL) without changing it.

    Local paths are looked at with the filesystem: a missing path (with the nearest
    existing ancestor and whether a store could be created there), a file, or a directory
    — a store when it has a root ``zarr.json``, else empty (possibly holding the writer
    claim and lock files of an interrupted creation) or foreign. Remote URLs read the root
    ``zarr.json`` and list the keys only when it is absent. Object stores have no
    directories, so a remote location is never MISSING or NOT_A_DIRECTORY: an absent
    prefix and an empty one are the same, EMPTY. A remote read failure (unreachable
    endpoint, no bucket, no credentials) is raised as TensorStore raises it.
    """
    u = normalize_url(url)
    path = local_path(u)
    if path is None:
        return _inspect_remote(u)
    if os.path.exists(path) and not os.path.isdir(path):
        return Location(u, LocationKind.NOT_A_DIRECTORY, path, writable=False)
    if not os.path.isdir(path):
        parent = os.path.dirname(path.rstrip("/")) or "/"
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        is_dir = os.path.isdir(parent)
        writable = is_dir and os.access(parent, os.W_OK)
        return Location(
            u, LocationKind.MISSING, path, writable=writable, parent=parent, parent_is_dir=is_dir
        )
    writable = os.access(path, os.W_OK)
    if os.path.exists(os.path.join(path, "zarr.json")):
        return Location(u, LocationKind.STORE, path, writable=writable)
    entries = [e for e in os.listdir(path) if e not in _OURS]
    return _unstored(u, path, writable, entries)


def _inspect_remote(url: str) -> Location:
    kv = KvStore(url)
    if kv.read_bytes("zarr.json") is not None:
        return Location(url, LocationKind.STORE)
    ours = tuple(o + "/" for o in _OURS)
    return _unstored(url, None, None, [k for k in kv.list() if not k.startswith(ours)])


def _unstored(url: str, path: str | None, writable: bool | None, entries: list[str]) -> Location:
    """A location without ``zarr.json`` holding ``entries`` (the claim's left out)."""
    foreign = sorted(e for e in entries if not _leftover(e))
    if foreign:
        return Location(
            url, LocationKind.FOREIGN, path, writable, foreign=tuple(foreign[:FOREIGN_SHOWN])
        )
    leftovers = tuple(sorted(entries))
    return Location(url, LocationKind.EMPTY, path, writable, leftovers=leftovers)


def remove_leftovers(loc: Location) -> None:
    """Delete the lock files of an interrupted creation at an EMPTY location (only while
    holding the writer claim: another writer's creation is in progress otherwise)."""
    if loc.path is not None:
        for e in loc.leftovers:
            os.unlink(os.path.join(loc.path, e))
        return
    if loc.leftovers:
        kv = KvStore(loc.url)
        for k in loc.leftovers:
            kv.delete(k)


# ---------------------------------------------------------------------- arrays
def array_spec(url: str, path: str, **extra: Any) -> dict[str, Any]:
    """The TensorStore spec of the zarr3 array at ``path`` of the store at ``url``."""
    return {"driver": "zarr3", "kvstore": kvstore_spec(url, path), **extra}


def open_array(
    url: str,
    path: str,
    *,
    metadata: dict[str, Any] | None = None,
    read_only: bool = False,
    **extra: Any,
) -> ts.TensorStore:
    """Open the array at ``path`` (``metadata``: create it, replacing what is there).

    ``extra`` goes into the spec (e.g. ``recheck_cached_metadata`` for readers of a live
    store, ``store_data_equal_to_fill_value`` for the writer).
    """
    if metadata is not None:
        spec = array_spec(url, path, metadata=metadata, **extra)
        return ts.open(spec, create=True, delete_existing=True, context=CONTEXT).result()
    spec = array_spec(url, path, **extra)
    if read_only:
        return ts.open(spec, open=True, read=True, context=CONTEXT).result()
    return ts.open(spec, open=True, context=CONTEXT).result()


def storage_dtype(dtype: np.dtype | str) -> np.dtype:
    """How a dtype (or dtype name) is stored: bfloat16 is widened to float32 (zarr-python
    lacks bf16; a name needs no ml_dtypes import)."""
    name = dtype if isinstance(dtype, str) else dtype.name
    return np.dtype(np.float32) if name == "bfloat16" else np.dtype(dtype)


def read_manifest(url: str) -> Manifest:
    """Read and validate the manifest of the store at ``url`` (raises NotAStoreError)."""
    kv = KvStore(url)
    try:
        doc = kv.read_json("zarr.json")
    except Exception as e:
        raise NotAStoreError(f"{url}: cannot read zarr.json: {e}") from e
    if not isinstance(doc, dict) or MANIFEST_ATTR not in doc.get("attributes", {}):
        raise NotAStoreError(f"{url} is not a traintape store (no traintape manifest in zarr.json)")
    raw = doc["attributes"][MANIFEST_ATTR]
    if not isinstance(raw, dict):
        raise NotAStoreError(
            f"{url}: the traintape manifest in zarr.json is a {type(raw).__name__}, not an object"
        )
    version = raw.get("schema_version")
    if not isinstance(version, str):
        raise NotAStoreError(f"{url}: manifest schema_version {version!r} is not a string")
    try:
        check_readable(version)
    except SchemaVersionError:
        raise
    except ValueError as e:
        raise NotAStoreError(f"{url}: {e}") from e
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        raise NotAStoreError(f"{url}: manifest does not match schema: {e}") from e


def write_manifest(kv: KvStore, m: Manifest) -> None:
    """Rewrite the root ``zarr.json`` with manifest ``m`` (one atomic kvstore write;
    ``updated_at`` is set to now)."""
    m.updated_at = datetime.now(UTC)
    doc = L.group_metadata({MANIFEST_ATTR: m.model_dump(mode="json")})
    kv.write_json("zarr.json", doc)


LOCK_SUFFIX = ".__lock"
"""Temporary files of TensorStore's file kvstore (and of the direct shard writer): a
write goes to ``<key>.__lock`` (or ``<key>.<n>.__lock``) and is renamed into place; a
process killed mid-write leaves one behind. Never data."""


def stale_lock_files(url: str) -> list[str]:
    """The temporary ``*.__lock`` files inside the local store at ``url`` (paths relative
    to it; [] for a remote store, which has none)."""
    root = local_path(url)
    if root is None:
        return []
    out = []
    for d, _dirs, files in os.walk(root):
        for f in files:
            if f.endswith(LOCK_SUFFIX):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out)


def remove_lock_files(url: str, keep: tuple[str, ...] = ()) -> int:
    """Remove the temporary ``*.__lock`` files of the local store at ``url`` (only while
    holding the writer claim, or with no writer: a live writer's in-flight writes are
    such files); ``keep``: relative paths to leave. Returns how many were removed."""
    root = local_path(url)
    n = 0
    for rel in stale_lock_files(url):
        if rel in keep or root is None:
            continue
        try:
            os.remove(os.path.join(root, rel))
            n += 1
        except FileNotFoundError:
            pass
    return n
