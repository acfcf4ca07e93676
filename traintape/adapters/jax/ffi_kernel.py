"""The fused stat kernel as an XLA custom call (CPU backend), via ``jax.ffi``.

:func:`raw_rows` puts traintape's single-pass C kernel (:mod:`traintape.core.stats`)
*inside* the caller's compiled computation: one ``ffi_call`` per captured leaf reads it
once (vectorised, spread over XLA:CPU's own intra-op thread pool, asynchronously: XLA
can run independent work until the result is needed); the rows are concatenated into the
mergeable raw rows ``[n, N_RAW]`` float64 of :mod:`traintape.schema.stats` — carried as
``uint32 [n, 2 * N_RAW]`` so that JAX needs no x64 mode; :func:`decode` views them back
on the host as raw rows (the recorder finalizes them). Measured on 33M
float32 elements (36 leaves), 2 CPU threads: 0.94–1.06x one plain ``jnp.sum`` pass,
against about 12x for six separate XLA:CPU reductions (XLA:CPU emits slow scalar loops
for multi-output reductions).

Where the handler (``_ffi_kernel.c`` with ``core/_fused_stats.c``) comes from, in order
(:func:`origin` says which, :func:`unavailable_reason` why none):

1. prebuilt at install (``setup.py`` → ``_ffi_prebuilt*.so``, built against the XLA FFI
   C header of the jaxlib present then), used if it was built from these C sources
   (:func:`source_hash`, baked in: an editable install keeps an old build next to edited
   sources), its XLA FFI API version is one the running jaxlib accepts
   (:func:`compatible`: the same major version and a minor version not newer than the
   running one, exactly the same before API 0.2 / jaxlib 0.8.1) and XLA registers it;
2. compiled on first use against the FFI header of the installed jaxlib
   (``jax.ffi.include_dir()``) and cached like the host kernel (:mod:`traintape.core.native`);
3. none: :func:`available` is False and callers use XLA reductions (no prebuilt handler
   and no compiler or no header, a failed build, or ``TRAINTAPE_NO_FUSED=1``).
``TRAINTAPE_NO_PREBUILT=1`` skips step 1.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from traintape.core import native
from traintape.schema.stats import N_RAW, IndexMap

_log = logging.getLogger("traintape")

TARGET = "traintape_raw_stats"
_SRC = Path(__file__).with_name("_ffi_kernel.c")
_BUILDINFO = Path(__file__).with_name("_ffi_buildinfo.c")
_HEADER = Path("xla", "ffi", "api", "c_api.h")

_lock = threading.Lock()
_state: dict[str, bool] = {}
_lib: ctypes.CDLL | None = None  # kept alive: XLA holds a raw pointer into it
_origin = ""
_why = ""


def source_hash() -> str:
    """Hash of the handler's C sources; a prebuilt handler carries the one it was built
    from (``setup.py`` hashes the same files in the same order)."""
    h = hashlib.sha256()
    for f in (_SRC, _BUILDINFO, native.SOURCE):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def header_api_version(header: Path) -> tuple[int, int] | None:
    """``(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR)`` defined in an XLA FFI C header."""
    try:
        text = header.read_text(errors="replace")
    except OSError:
        return None
    found = dict(re.findall(r"#define\s+XLA_FFI_API_(MAJOR|MINOR)\s+(\d+)", text))
    if set(found) != {"MAJOR", "MINOR"}:
        return None
    return int(found["MAJOR"]), int(found["MINOR"])


def compatible(built: tuple[int, int], running: tuple[int, int]) -> bool:
    """Whether a jaxlib whose XLA FFI API version is ``running`` registers a handler built
    against API version ``built``.

    Since API 0.2 (jaxlib 0.8.1) XLA accepts the versions from its minimum (0.1 so far) up
    to its own (``xla/ffi/ffi_registry.cc``); before, only its own. Checked by registering
    handlers built against the headers of jaxlib 0.7.2 (API 0.1), 0.8.1 (0.2), 0.10.2 (0.3)
    and a 0.4 one with jaxlib 0.7.2, 0.8.1 and 0.10.2: 0.7.2 took only 0.1, 0.8.1 0.1–0.2,
    0.10.2 0.1–0.3. Registration is the final check (a raised minimum shows there).
    """
    if running < (0, 2):
        return built == running
    return built[0] == running[0] and (0, 1) <= built <= running


def prebuilt_paths() -> list[Path]:
    """Handlers built when the package was installed (``setup.py``), unless
    ``TRAINTAPE_NO_PREBUILT`` is set."""
    if os.environ.get("TRAINTAPE_NO_PREBUILT"):
        return []
    return sorted(_SRC.parent.glob("_ffi_prebuilt*.so"))


def _prebuilt(path: Path, running: tuple[int, int] | None) -> tuple[ctypes.CDLL, str]:
    """The prebuilt handler at ``path`` and its description, if usable here (raises
    ``RuntimeError`` saying why not)."""
    lib = native._checked(ctypes.CDLL(str(path)), path)
    for f in ("tt_ffi_source_hash", "tt_ffi_jaxlib"):
        getattr(lib, f).restype = ctypes.c_char_p
    built = (int(lib.tt_ffi_api_major()), int(lib.tt_ffi_api_minor()))
    jaxlib = lib.tt_ffi_jaxlib().decode()
    if lib.tt_ffi_source_hash().decode() != source_hash():
        raise RuntimeError("built from other C sources than this traintape's (stale build)")
    if running is not None and not compatible(built, running):
        raise RuntimeError(
            f"built against XLA FFI API {built[0]}.{built[1]}"
            + (f" (jaxlib {jaxlib})" if jaxlib else "")
            + f", which the installed jaxlib (API {running[0]}.{running[1]}) does not accept"
        )
    what = f"XLA FFI API {built[0]}.{built[1]}" + (f", jaxlib {jaxlib}" if jaxlib else "")
    return lib, f"prebuilt at install ({path.name}; {what})"


def _register() -> bool:
    global _lib, _origin, _why
    if os.environ.get("TRAINTAPE_NO_FUSED"):
        _why = "disabled by TRAINTAPE_NO_FUSED"
        return False
    include = Path(jax.ffi.include_dir())
    header = include / _HEADER
    running = header_api_version(header)
    skipped = []
    for pre in prebuilt_paths():
        try:
            lib, where = _prebuilt(pre, running)
            jax.ffi.register_ffi_target(
                TARGET, jax.ffi.pycapsule(lib.tt_raw_stats_ffi), platform="cpu"
            )
        except Exception as e:  # stale, foreign or refused by XLA: compile one instead
            _log.debug("traintape: prebuilt JAX FFI kernel %s not usable (%s)", pre, e)
            skipped.append(f"{pre.name}: {e}")
            continue
        _lib, _origin = lib, where
        _log.debug("traintape: JAX FFI stat kernel %s", where)
        return True
    note = f" (prebuilt not used: {'; '.join(skipped)})" if skipped else ""
    if not header.exists():
        _why = f"no usable prebuilt kernel, and jaxlib's FFI header {header} is missing{note}"
        return False
    # no OpenMP: the handler runs on XLA's own thread pool (see _ffi_kernel.c)
    try:
        path = native.build_shared_object(
            "jaxffi",
            [_SRC, native.SOURCE],
            native.FLAGS_PLAIN,
            include_dirs=[include],
            depends=[header],
        )
    except RuntimeError as e:
        _why = f"no usable prebuilt kernel, and compiling it failed: {e}{note}"
        return False
    _lib = ctypes.CDLL(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_lib.tt_raw_stats_ffi), platform="cpu")
    _origin = f"compiled at run time ({path}){note}"
    _log.debug("traintape: JAX FFI stat kernel %s", _origin)
    return True


def available() -> bool:
    """Whether the custom call is registered for the CPU platform (loads or builds it
    once)."""
    global _why
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                try:
                    _state["ok"] = _register()
                except Exception as e:  # load or registration error: XLA fallback
                    _why = f"{type(e).__name__}: {e}"
                    _log.debug("traintape: JAX FFI stat kernel unavailable (%s)", e)
                    _state["ok"] = False
    return _state["ok"]


def origin() -> str:
    """Where the registered handler came from: ``prebuilt at install (...)`` or
    ``compiled at run time (...)``; '' if unavailable."""
    available()
    return _origin


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' if it is True)."""
    available()
    return "" if _state.get("ok") else _why


def _operand(x: jax.Array) -> jax.Array:
    x = jax.lax.stop_gradient(x)
    if x.dtype not in (jnp.float32, jnp.float64):
        x = x.astype(jnp.float32)  # bf16/f16/int/bool: the same promotion as on the host
    return x


def _map_operand(imap: IndexMap | None, shape: Sequence[int]) -> jax.Array | None:
    """The int32 index-map operand of one leaf (None: the identity, or a map the kernel
    cannot take: more than 8 axes after merging, which :func:`raw_rows` refuses)."""
    from traintape.core.stats import map_words

    if imap is None:
        return None
    w = map_words(imap, shape)
    if w is None:
        raise ValueError(f"index map {imap} has too many axes for the FFI kernel")
    return jnp.asarray(np.array(w, dtype=np.int64).astype(np.uint32).view(np.int32))


def raw_rows(
    arrays: Sequence[jax.Array], maps: Sequence[IndexMap | None] | None = None
) -> jax.Array:
    """Raw rows of ``arrays`` from inside a computation lowered for the CPU backend.

    ``maps``: each array's :class:`~traintape.schema.stats.IndexMap` (the canonical
    index of its elements, for the ``sig`` field; None: the identity), passed to the
    kernel as a small int32 operand. Returns ``uint32 [len(arrays), 2 * N_RAW]`` (the bytes of ``[n, N_RAW]`` float64; see
    :func:`decode`). Requires :func:`available`; lowering for another platform fails.
    """
    if not arrays:
        return jnp.zeros((0, 2 * N_RAW), jnp.uint32)
    if not available():
        raise RuntimeError(
            f"traintape's JAX FFI stat kernel is unavailable ({unavailable_reason()}); "
            "use stats.stat_matrix instead"
        )
    # one call per leaf, not one for all: a single call reading every leaf keeps all of
    # them alive until the last is produced (e.g. every gradient until the optimizer has
    # made every update), which grows XLA's temp allocation past malloc's mmap threshold:
    # fresh pages and ~20k page faults per step on an 11M-param MLP (+20-40 ms, measured
    # in benchmarks/jax_overhead.py's model); per leaf the step has no extra faults
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((1, 2 * N_RAW), jnp.uint32), vmap_method="sequential"
    )
    maps = [None] * len(arrays) if maps is None else list(maps)
    rows = []
    for a, m in zip(arrays, maps, strict=True):
        table = _map_operand(m, jnp.shape(a))
        rows.append(call(_operand(a)) if table is None else call(_operand(a), table))
    return jnp.concatenate(rows)


def spread_raw_rows(
    arrays: Sequence[jax.Array],
    maps: Sequence[IndexMap | None],
    splits: Sequence[Any],
) -> tuple[Any, Callable[[Any], np.ndarray]]:
    """:func:`raw_rows` of arrays of a multi-device computation, each device reducing
    one slab (``splits``: a :class:`~traintape.adapters.jax.blocks.Split` per array, or
    None for an array reduced whole as by :func:`raw_rows`).

    A custom call has no partitioning rule: under XLA's partitioner its operands are
    gathered whole onto every device. Spread arrays are therefore reduced inside one
    ``shard_map`` over every device (no replicas: each element once), each device's
    slab with its index map moved to where the slab starts (for ``sig``; the offset is
    the device's ``axis_index`` times the slab's extent, computed on the device), and
    the per-device rows are gathered (tiny) and merged exactly on the host.
    Returns ``(payload, decode)`` as :func:`traintape.adapters.jax.stats.device_stats`.
    """
    from traintape.core.stats import map_words
    from traintape.schema.stats import empty_raw, merge_all

    from .blocks import mesh_like, program_mesh, shard_map_all

    if not available():
        raise RuntimeError(
            f"traintape's JAX FFI stat kernel is unavailable ({unavailable_reason()})"
        )
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((1, 2 * N_RAW), jnp.uint32), vmap_method="sequential"
    )
    spread = [i for i, sp in enumerate(splits) if sp is not None]
    first = splits[spread[0]]
    count = first.devices.count
    mesh = mesh_like(program_mesh(arrays[spread[0]]), first.devices)
    axes = tuple(mesh.axis_names)
    tables, steps = [], []
    for i in spread:
        sp, a, m = splits[i], arrays[i], maps[i]
        shape = tuple(jnp.shape(a))
        if m is None:  # the identity: row-major strides of the array itself
            m = IndexMap(
                tuple(int(np.prod(shape[k + 1 :], dtype=np.int64)) for k in range(len(shape)))
            )
        slab = tuple(sp.rows if k == sp.axis else n for k, n in enumerate(shape))
        w = map_words(m, slab)
        if w is None:
            raise ValueError(f"index map {m} has too many axes for the FFI kernel")
        tables.append(np.array(w, dtype=np.int64).astype(np.uint32))
        steps.append(np.uint32((sp.rows * m.strides[sp.axis]) % 2**32))

    def per_device(*slabs: jax.Array) -> jax.Array:
        idx = jax.lax.axis_index(axes).astype(jnp.uint32)
        rows = []
        for slab, table, step in zip(slabs, tables, steps, strict=True):
            t = jnp.asarray(table).at[1].add(step * idx)  # uint32: wraps mod 2**32
            rows.append(call(_operand(slab), jax.lax.bitcast_convert_type(t, jnp.int32)))
        return jax.lax.all_gather(jnp.concatenate(rows), axes)  # [count, n, 2 N_RAW]

    specs = tuple(splits[i].spec(mesh) for i in spread)
    gathered = shard_map_all(per_device, mesh, specs, P())(*(arrays[i] for i in spread))
    whole = [i for i, sp in enumerate(splits) if sp is None]
    rest = raw_rows([arrays[i] for i in whole], [maps[i] for i in whole]) if whole else None
    payload = (gathered, rest)
    n = len(arrays)

    def decode_spread(got: Any) -> np.ndarray:
        parts, others = got
        parts = np.ascontiguousarray(parts, dtype=np.uint32).view(np.float64)
        merged = merge_all(parts.reshape(count, len(spread), N_RAW))
        out = empty_raw(n)
        out[spread] = merged
        if whole:
            out[whole] = decode(others)
        return out

    return payload, decode_spread


def decode(rows: np.ndarray) -> np.ndarray:
    """Host side: ``uint32 [n, 2 * N_RAW]`` from :func:`raw_rows` → raw rows
    ``[n, N_RAW]`` float64."""
    return np.ascontiguousarray(rows, dtype=np.uint32).view(np.float64).reshape(-1, N_RAW)
