"""Store I/O in one place: the TensorStore spec of every array, the manifest document.

Readers and the writer open arrays through :func:`open_array` (the one zarr3 spec
builder) and read or write the manifest (the ``"traintape"`` attribute of the root
``zarr.json``) through :func:`read_manifest` / :func:`write_manifest`;
:func:`storage_dtype` says how a tensor dtype is stored on disk.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import numpy as np
import tensorstore as ts
from pydantic import ValidationError

from traintape.core import layout as L
from traintape.core.errors import NotAStoreError
from traintape.core.kvstore import CONTEXT, KvStore, kvstore_spec
from traintape.schema import MANIFEST_ATTR, Manifest, SchemaVersionError, check_readable


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
