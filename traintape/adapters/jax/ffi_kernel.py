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

The handler (``_ffi_kernel.c``) is compiled on first use against the FFI C header that
ships with the installed jaxlib (``jax.ffi.include_dir()``), together with
``core/_fused_stats.c``, and cached like the host kernel (:mod:`traintape.core.native`). :func:`available` is False
(and callers use XLA reductions) when there is no compiler, the header is missing, the
build fails, or ``TRAINTAPE_NO_FUSED=1``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from traintape.core import native
from traintape.schema.stats import N_RAW

_log = logging.getLogger("traintape")

TARGET = "traintape_raw_stats"
_SRC = Path(__file__).with_name("_ffi_kernel.c")

_lock = threading.Lock()
_state: dict[str, bool] = {}
_lib: ctypes.CDLL | None = None  # kept alive: XLA holds a raw pointer into it


def _register() -> bool:
    global _lib
    if os.environ.get("TRAINTAPE_NO_FUSED"):
        return False
    include = Path(jax.ffi.include_dir())
    header = include / "xla" / "ffi" / "api" / "c_api.h"
    if not header.exists():
        _log.debug("traintape: %s missing; JAX stats use XLA reductions", header)
        return False
    # no OpenMP: the handler runs on XLA's own thread pool (see _ffi_kernel.c)
    path = native.build_shared_object(
        "jaxffi",
        [_SRC, native.SOURCE],
        native.FLAGS_PLAIN,
        include_dirs=[include],
        depends=[header],
    )
    _lib = ctypes.CDLL(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_lib.tt_raw_stats_ffi), platform="cpu")
    _log.debug("traintape: JAX FFI stat kernel loaded from %s", path)
    return True


def available() -> bool:
    """Whether the custom call is registered for the CPU platform (builds it once)."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                try:
                    _state["ok"] = _register()
                except Exception as e:  # no compiler, build or load error: XLA fallback
                    _log.debug("traintape: JAX FFI stat kernel unavailable (%s)", e)
                    _state["ok"] = False
    return _state["ok"]


def _operand(x: jax.Array) -> jax.Array:
    x = jax.lax.stop_gradient(x)
    if x.dtype not in (jnp.float32, jnp.float64):
        x = x.astype(jnp.float32)  # bf16/f16/int/bool: the same promotion as on the host
    return x


def raw_rows(arrays: Sequence[jax.Array]) -> jax.Array:
    """Raw rows of ``arrays`` from inside a computation lowered for the CPU backend.

    Returns ``uint32 [len(arrays), 2 * N_RAW]`` (the bytes of ``[n, N_RAW]`` float64; see
    :func:`decode`). Requires :func:`available`; lowering for another platform fails.
    """
    if not arrays:
        return jnp.zeros((0, 2 * N_RAW), jnp.uint32)
    if not available():
        raise RuntimeError(
            "traintape's JAX FFI stat kernel is unavailable (no C compiler, jaxlib's FFI "
            "header missing, or TRAINTAPE_NO_FUSED set); use stats.stat_matrix instead"
        )
    # one call per leaf, not one for all: a single call reading every leaf keeps all of
    # them alive until the last is produced (e.g. every gradient until the optimizer has
    # made every update), which grows XLA's temp allocation past malloc's mmap threshold:
    # fresh pages and ~20k page faults per step on an 11M-param MLP (+20-40 ms, measured
    # in benchmarks/jax_overhead.py's model); per leaf the step has no extra faults
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((1, 2 * N_RAW), jnp.uint32), vmap_method="sequential"
    )
    return jnp.concatenate([call(_operand(a)) for a in arrays])


def decode(rows: np.ndarray) -> np.ndarray:
    """Host side: ``uint32 [n, 2 * N_RAW]`` from :func:`raw_rows` → raw rows
    ``[n, N_RAW]`` float64."""
    return np.ascontiguousarray(rows, dtype=np.uint32).view(np.float64).reshape(-1, N_RAW)
