"""Where each array lives in a run store, and its Zarr v3 metadata.

::

    RUN/zarr.json                      root group; attributes["traintape"] = manifest
    RUN/steps                          int64 [row]                 global optimizer step
    RUN/stats/<kind>                   float64 [row, tensor, stat] tensor order = manifest
    RUN/metrics/<name>                 float64 [row]               NaN where not logged
    RUN/snapshots/<kind>/<name>        dtype [snapshot, *canonical shape]
    RUN/snapshot_steps/<kind>          int64 [snapshot]            step of each snapshot

Row-axis arrays grow in blocks (``StoreLayout.row_block``) and are trimmed to the
committed size on ``close()``; beyond the commit mark they hold fill values or data
of steps that never committed, which readers ignore. Every chunk carries a crc32c.
Snapshots are sharded: one shard (one file) per snapshot per tensor, split into inner
chunks of about ``snapshot_chunk_bytes`` so one element's trajectory reads only small
pieces.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from traintape.schema import N_STATS, Kind, Manifest, StoreLayout
from traintape.schema.names import split_name

STEPS = "steps"
STATS = "stats"
METRICS = "metrics"
SNAPSHOTS = "snapshots"
SNAPSHOT_STEPS = "snapshot_steps"
SNAPSHOT_BLOCK = 16  # snapshot arrays grow by this many snapshots at a time


def stats_path(kind: Kind | str) -> str:
    return f"{STATS}/{Kind(kind).value}"


def metric_path(name: str) -> str:
    return f"{METRICS}/{name}"


def snapshot_path(kind: Kind | str, name: str) -> str:
    return f"{SNAPSHOTS}/{Kind(kind).value}/{name}"


def snapshot_steps_path(kind: Kind | str) -> str:
    return f"{SNAPSHOT_STEPS}/{Kind(kind).value}"


def committed_paths(m: Manifest) -> set[str]:
    """Arrays the manifest's commit mark vouches for (anything else may be a leftover
    of a write that never committed, and is recreated rather than reused)."""
    paths: set[str] = set()
    if m.commit.rows or m.tensors or m.metrics:
        paths.add(STEPS)
    paths.update(stats_path(k) for k in m.kinds())
    paths.update(metric_path(n) for n in m.metrics)
    for kind, count in m.commit.snapshots.items():
        if count > 0:
            paths.add(snapshot_steps_path(kind))
            paths.update(snapshot_path(kind, s.name) for s in m.specs(kind))
    return paths


def store_keys(keys: list[str]) -> tuple[list[str], list[str]]:
    """Split a store location's keys into the store's own (its manifest, arrays, groups,
    writer claim and lock files of interrupted writes) and foreign ones."""
    ours: list[str] = []
    foreign: list[str] = []
    for k in keys:
        top = k.split("/", 1)[0]
        own = (
            k == "zarr.json"
            or top == ".traintape"
            or (top in (STEPS, STATS, METRICS, SNAPSHOTS, SNAPSHOT_STEPS) and "/" in k)
            or (k.startswith("zarr.json") and k.endswith(".__lock"))
        )
        (ours if own else foreign).append(k)
    return ours, foreign


def is_layout_path(path: str) -> bool:
    """True if ``path`` is where the writer could put an array or group."""
    return path.split("/", 1)[0] in (STEPS, STATS, METRICS, SNAPSHOTS, SNAPSHOT_STEPS)


def parent_groups(paths: list[str]) -> set[str]:
    """All group paths (``''`` = root) needed so that Zarr readers find ``paths``."""
    groups = {""}
    for p in paths:
        parts = p.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    return groups


def group_metadata(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def _codecs(layout: StoreLayout, dtype: np.dtype) -> list[dict[str, Any]]:
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if layout.compression == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
    elif layout.compression == "blosc":
        codecs.append(
            {
                "name": "blosc",
                "configuration": {
                    "cname": "lz4",
                    "clevel": 5,
                    "shuffle": "shuffle",
                    "typesize": dtype.itemsize,
                    "blocksize": 0,
                },
            }
        )
    codecs.append({"name": "crc32c"})
    return codecs


def _fill(dtype: np.dtype) -> Any:
    return (
        "NaN"
        if dtype.kind == "f"
        else (False if dtype.kind == "b" else -1 if dtype.kind == "i" else 0)
    )


def row_array_metadata(
    layout: StoreLayout, rows: int, inner: tuple[int, ...], dtype: str, dims: list[str]
) -> dict[str, Any]:
    """Metadata of a row-axis array (steps, stats, metrics): chunks of ``row_chunk`` rows."""
    dt = np.dtype(dtype)
    return {
        "shape": [rows, *inner],
        "data_type": dt.name,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [layout.row_chunk, *inner]},
        },
        "chunk_key_encoding": {"name": "default"},
        "codecs": _codecs(layout, dt),
        "fill_value": _fill(dt),
        "dimension_names": dims,
    }


def stats_metadata(
    layout: StoreLayout, kind: str, rows: int, n_tensors: int, n_stats: int = N_STATS
) -> dict[str, Any]:
    """Metadata of a kind's stat array ``[rows, n_tensors, n_stats]`` (``n_stats``: the
    store's own stat vector, ``len(manifest.stat_names)``)."""
    return row_array_metadata(
        layout, rows, (n_tensors, n_stats), "float64", ["row", f"tensor_{kind}", "stat"]
    )


def _largest_divisor_at_most(n: int, k: int) -> int:
    """The largest divisor of ``n`` that is at most ``k`` (inner chunks tile a shard)."""
    for d in range(min(n, k), 0, -1):
        if n % d == 0:
            return d
    return 1


def inner_chunk(shape: tuple[int, ...], itemsize: int, target_bytes: int) -> list[int]:
    """Inner chunk of one snapshot: whole trailing axes, leading axes split to fit target."""
    inner = list(shape)
    for i in range(len(shape)):
        trailing = math.prod(shape[i + 1 :]) * itemsize
        if trailing > target_bytes:
            inner[i] = 1
            continue
        inner[i] = max(1, min(shape[i], target_bytes // max(trailing, 1)))
        break
    return [max(1, d) for d in inner]


def snapshot_metadata(
    layout: StoreLayout,
    name: str,
    count: int,
    shape: tuple[int, ...],
    dtype: str,
    block: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Metadata of a snapshot array ``[snapshot, *shape]``: one shard per snapshot, or,
    with ``block`` (the part each process of a multi-process job writes, see
    :class:`traintape.core.writer.Part`), one shard per block per snapshot — so no two
    processes ever write the same shard (file/object).

    Dimension names are unique among siblings (``<leaf>_<axis>``) so that xarray's
    DataTree can open a layer group whose kernel and bias differ in shape.
    """
    dt = np.dtype(dtype)
    leaf = split_name(name)[1]
    if block is not None:
        shard = [max(1, b) for b in block]
        inner = inner_chunk(tuple(shard), dt.itemsize, layout.snapshot_chunk_bytes)
        inner = [_largest_divisor_at_most(b, c) for b, c in zip(shard, inner, strict=True)]
    else:
        inner = inner_chunk(shape, dt.itemsize, layout.snapshot_chunk_bytes)
        shard = [math.ceil(max(s, 1) / c) * c for s, c in zip(shape, inner, strict=True)]
    return {
        "shape": [count, *shape],
        "data_type": dt.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *shard]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [1, *inner],
                    "codecs": _codecs(layout, dt),
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_location": "end",
                },
            }
        ],
        "fill_value": _fill(dt),
        "dimension_names": ["snapshot", *[f"{leaf}_{i}" for i in range(len(shape))]],
    }
