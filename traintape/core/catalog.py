"""Finding the runs under a location: a local directory or an object-store prefix.

A run is a Zarr group whose root ``zarr.json`` carries ``attributes["traintape"]`` (the
manifest). Runs are not searched for inside runs.
"""

from __future__ import annotations

import json
import os

from traintape.core.kvstore import KvStore, Location, local_path, normalize_url


def _is_run(meta: object) -> bool:
    return (
        isinstance(meta, dict)
        and isinstance(meta.get("attributes"), dict)
        and ("traintape" in meta["attributes"])
    )


def find_stores(root: Location, depth: int = 3) -> list[str]:
    """Runs under ``root`` at most ``depth`` levels down, sorted.

    Local directories (a path or ``file://``) are walked and return paths; other URLs
    (``s3://bucket/prefix``, ``gs://...``, ``memory://...``) list the keys under the
    prefix — reading only the ``zarr.json`` of candidate groups, never a chunk — and
    return URLs (``<root>/<sub>/``).
    """
    path = local_path(normalize_url(root))
    if path is not None:
        return _find_local(path, depth)
    return _find_remote(normalize_url(root), depth)


def _find_local(root: str, depth: int) -> list[str]:
    out = []
    root = os.path.abspath(root)
    base = root.rstrip(os.sep).count(os.sep)
    for d, dirs, files in os.walk(root):
        if "zarr.json" in files:
            try:
                with open(os.path.join(d, "zarr.json"), encoding="utf-8") as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                meta = {}
            if _is_run(meta):
                out.append(d)
                dirs[:] = []
                continue
        if d.count(os.sep) - base >= depth:
            dirs[:] = []
        dirs.sort()
    return out


def _find_remote(url: str, depth: int) -> list[str]:
    kv = KvStore(url)
    groups = sorted(
        k[: -len("zarr.json")]
        for k in kv.list()
        if (k == "zarr.json" or k.endswith("/zarr.json")) and k.count("/") <= depth
    )
    runs: list[str] = []
    for g in groups:  # shallow first: a group inside a run is skipped unread
        if any(g.startswith(r) for r in runs):
            continue
        try:
            meta = json.loads(kv.read_bytes(g + "zarr.json") or b"{}")
        except ValueError:
            continue
        if _is_run(meta):
            runs.append(g)
    return [url + g for g in runs]
