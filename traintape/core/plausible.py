"""Plausibility checks of store metadata, before anything is allocated or iterated.

``zarr.json`` carries no checksum: a crafted or bit-rotted manifest or array metadata can
declare ``commit.rows`` of 10^12 or a tensor of ``[10^6, 10^6]``. Reading that blindly
makes TensorStore allocate terabytes (``std::bad_alloc`` aborts the interpreter: no
message, and one bad store hides every run from ``ls``) or makes a chunk scan endless.
Tools that read a store check here first and raise :class:`StoreError` naming the array:

- :func:`check_rows`: the commit mark against what exists — the ``steps`` array must
  hold the committed rows, and (stores with ``layout.all_chunks_stored``) the chunks the
  committed rows need must exist on disk (one key listing);
- :func:`check_read`: a read allocates at most the memory available;
- :func:`chunk_count`: how many chunks a scan would visit, computed, not enumerated
  (``validate`` compares it with what is stored before it iterates).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from traintape.core import layout as L
from traintape.core.errors import StoreError
from traintape.core.kvstore import KvStore
from traintape.schema import Manifest


def available_bytes() -> int:
    """Memory a read may allocate: what the host has available now."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # pragma: no cover - psutil is a dependency
        return 1 << 34


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"  # pragma: no cover


def check_read(path: str, shape: Sequence[int], dtype: np.dtype | str) -> None:
    """Raise :class:`StoreError` if reading ``shape`` of ``dtype`` from array ``path``
    needs more memory than is available (implausible metadata, or a read too large)."""
    nbytes = math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
    avail = available_bytes()
    if nbytes > avail:
        raise StoreError(
            f"array {path}: reading {list(shape)} {np.dtype(dtype).name} needs "
            f"{_human(nbytes)}, more than the {_human(avail)} of memory available "
            f"(crafted or damaged metadata, or read it in parts)"
        )


def read(path: str, view: ts.TensorStore) -> np.ndarray:
    """Read ``view`` (a selection of array ``path``) after :func:`check_read`."""
    check_read(path, view.shape, view.dtype.numpy_dtype)
    return np.asarray(view.read().result())


def chunk_count(shape: Sequence[int], chunk: Sequence[int]) -> int:
    """Chunks of a grid ``chunk`` over ``shape`` (0-size chunk axes count as one)."""
    return math.prod(-(-int(s) // max(int(c), 1)) for s, c in zip(shape, chunk, strict=True))


def stored_chunks(kv: KvStore, path: str) -> int:
    """Chunk keys stored under array ``path``."""
    return len(kv.list(f"{path}/c/"))


def check_rows(url: str, m: Manifest, steps: ts.TensorStore, kv: KvStore | None = None) -> None:
    """The commit mark is plausible: ``steps`` (the store's steps array) holds the
    committed rows and, in a store that stores every chunk, the chunks of the committed
    rows exist. Raises :class:`StoreError` naming the array and both numbers."""
    rows = m.commit.rows
    if rows <= 0:
        return
    if steps.shape[0] < rows:
        raise StoreError(
            f"{url}: commit.rows is {rows} but array {L.STEPS} holds {steps.shape[0]} rows "
            f"(crafted or damaged manifest)"
        )
    if m.layout.all_chunks_stored:
        chunk = int((steps.chunk_layout.write_chunk.shape or (1,))[0] or 1)
        need = chunk_count([rows], [chunk])
        have = stored_chunks(kv or KvStore(url), L.STEPS)
        if have < need:
            raise StoreError(
                f"{url}: commit.rows {rows} needs {need} chunks of array {L.STEPS}, "
                f"{have} are stored (crafted or damaged metadata)"
            )
    check_read(L.STEPS, [rows], "int64")
