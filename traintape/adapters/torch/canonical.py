"""Canonical tensors ↔ torch models: :func:`to_canonical` and :func:`from_canonical`.

The mapping is the one :mod:`traintape.adapters.torch.names` defines (the same names and
layouts ``watch`` records): ``canonical = source[rows].permute(permutation)``; loading
applies the inverse permutation and writes the row block in place, so a round trip is
exact (bit for bit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from traintape.adapters.torch.names import model_layout
from traintape.core.naming import NameMap


def to_canonical(model: nn.Module, name_map: NameMap = None) -> dict[str, np.ndarray]:
    """Every parameter and recorded buffer of ``model`` as ``{canonical name: array}``.

    Arrays are host copies in canonical layout (e.g. a Linear's ``kernel`` is (in, out)).
    Tied parameters appear once, under their first name.
    """
    from traintape.adapters.torch.host import host_copy

    layout = model_layout(model, name_map, warn=False)
    return {e.name: host_copy(e.canonical(e.tensor())) for e in layout.entries}


def from_canonical(
    model: nn.Module,
    tensors: Mapping[str, Any],
    *,
    name_map: NameMap = None,
    strict: bool = True,
) -> None:
    """Load canonical-layout tensors into ``model`` in place (inverse of :func:`to_canonical`).

    Args:
        model: the torch module to load into.
        tensors: canonical name (or an alias of a tied parameter) → array-like in
            canonical layout (numpy, torch, anything ``torch.as_tensor`` accepts).
        strict: refuse missing or unknown names (``KeyError`` listing them); with False,
            unknown names are ignored and missing tensors keep their values.
    Raises:
        KeyError, ValueError: unknown/missing names (strict) or a shape mismatch.
    """
    layout = model_layout(model, name_map, warn=False)
    entries = layout.entries
    known: dict[str, int] = {}
    for i, e in enumerate(entries):
        known[e.name] = i
        for a in e.aliases:
            known.setdefault(a, i)
    unknown = sorted(set(tensors) - set(known))
    loaded = {known[n] for n in tensors if n in known}
    missing = sorted(e.name for i, e in enumerate(entries) if i not in loaded)
    if strict and (unknown or missing):
        raise KeyError(
            "from_canonical: "
            + (f"unknown tensors {unknown}" if unknown else "")
            + ("; " if unknown and missing else "")
            + (f"missing tensors {missing}" if missing else "")
        )
    with torch.no_grad():
        for name, value in tensors.items():
            if name not in known:
                continue
            e = entries[known[name]]
            dst = e.part(e.tensor())
            canon = torch.as_tensor(np.asarray(value) if not torch.is_tensor(value) else value)
            if tuple(canon.shape) != e.shape:
                raise ValueError(
                    f"from_canonical: {name!r} has shape {tuple(canon.shape)}, expected "
                    f"canonical shape {e.shape} (torch {e.source_name} {e.source_shape})"
                )
            dst.copy_(e.inverse(canon.to(device=dst.device, dtype=dst.dtype)))
