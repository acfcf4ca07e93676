"""Host copies of torch tensors, in canonical layout, as numpy arrays."""

from __future__ import annotations

import numpy as np
import torch

from traintape.adapters.torch.names import ParamEntry


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A contiguous host copy of ``t`` as numpy (bfloat16 via ml_dtypes), never a view."""
    t = t.detach()
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t)
    if out.dtype == torch.bfloat16:
        import ml_dtypes

        return out.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return out.numpy()


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
