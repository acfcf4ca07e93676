"""Host copies of torch tensors, in canonical layout, as numpy arrays."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from traintape.adapters.torch.names import ParamEntry

_BLOCK = 64  # elements of the last axis per block of a strided host copy


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A contiguous host copy of ``t`` as numpy (bfloat16 via ml_dtypes), never a view.

    A CPU tensor whose last axis is strided (a transposed view: the canonical layouts of
    Linear and convolution weights) is copied by numpy in blocks of that axis, so each
    block reads a few source rows: cache-friendly and single-threaded (torch's copy of
    such a view, a slice of it above all, is several times slower)."""
    t = t.detach()
    bf16 = t.dtype == torch.bfloat16
    if t.device.type == "cpu" and t.dim() >= 2 and t.shape[-1] > 2 * _BLOCK and t.stride(-1) != 1:
        try:
            src = (t.view(torch.int16) if bf16 else t).numpy()
        except (TypeError, RuntimeError):  # a dtype or view numpy cannot share
            src = None
        if src is not None:
            out = np.empty(src.shape, src.dtype)
            for j in range(0, src.shape[-1], _BLOCK):
                out[..., j : j + _BLOCK] = src[..., j : j + _BLOCK]
            return _bf16(out) if bf16 else out
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    host.copy_(t)
    return _bf16(host.view(torch.int16).numpy()) if bf16 else host.numpy()


def _bf16(a: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return a.view(ml_dtypes.bfloat16)


def numpy_dtype_name(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return "bfloat16"
    return str(torch.empty((), dtype=dtype).numpy().dtype)


def canonical_host_copy(e: ParamEntry, part: torch.Tensor | None, dtype: torch.dtype) -> np.ndarray:
    """Host copy of ``part`` (``e``'s row block, source layout) in canonical layout;
    None (no gradient / no optimizer state yet) → zeros of the canonical shape."""
    if part is None:
        return np.zeros(e.shape, dtype=numpy_dtype_name(dtype))
    return host_copy(part if e.permutation is None else part.permute(e.permutation))


def canonical_reader(
    e: ParamEntry, part: torch.Tensor | None, dtype: torch.dtype
) -> tuple[tuple[int, ...], str, Callable[[int, int], np.ndarray]]:
    """``(shape, dtype name, read)`` of ``part`` (``e``'s row block, source layout) in
    canonical layout, for a streamed snapshot: ``read(start, stop)`` is a host copy of
    rows ``[start, stop)`` of the canonical tensor only (None → zeros), so a tensor
    reaches the host one piece at a time, never whole."""
    shape = tuple(int(d) for d in e.shape)
    name = numpy_dtype_name(dtype)
    if part is None:
        return shape, name, lambda a, b: np.zeros((b - a, *shape[1:]) if shape else (), name)
    view = part.detach() if e.permutation is None else part.detach().permute(e.permutation)
    if view.dim() == 0:
        return shape, name, lambda a, b: host_copy(view)
    return shape, name, lambda a, b: host_copy(view[a:b])
