"""A torch module as a framework-free forward function for the analyses.

:func:`as_forward` wraps a ``torch.nn.Module`` into a :class:`TorchForward`, which
``traintape.analysis`` (which imports no framework) calls like any forward function:
``forward(params, inputs) -> np.ndarray`` with ``params`` in the module's own names and
layouts, obtained from canonical tensors (a store's snapshots) by
:meth:`TorchForward.native_params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from traintape.core.naming import NameMap


class TorchForward:
    """``forward(params, inputs)`` of a torch module (see the module docstring).

    ``native_params(canonical)`` loads canonical tensors into the module (through
    :func:`traintape.torch.from_canonical`) and returns its ``named_parameters()`` as
    numpy; the module's state is restored afterwards, so the module the user passed is
    left exactly as it was.
    """

    def __init__(self, model: torch.nn.Module, name_map: NameMap = None) -> None:
        self.model = model
        self.name_map = name_map

    def native_params(self, canonical: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from traintape.adapters.torch.canonical import from_canonical

        model = self.model
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        try:
            from_canonical(model, canonical, name_map=self.name_map, strict=False)
            return {k: p.detach().cpu().numpy().copy() for k, p in model.named_parameters()}
        finally:
            with torch.no_grad():
                model.load_state_dict(saved)

    def __call__(self, params: Mapping[str, Any], inputs: Any) -> np.ndarray:
        from torch.func import functional_call

        ref = next(self.model.parameters())
        tp = {
            k: torch.as_tensor(np.asarray(v), dtype=ref.dtype, device=ref.device)
            for k, v in params.items()
        }
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        with torch.no_grad():
            out = functional_call(self.model, tp, args)
        if isinstance(out, (tuple, list)):
            out = out[0]
        return np.asarray(out.detach().cpu().numpy())


def as_forward(model: torch.nn.Module, name_map: NameMap = None) -> TorchForward:
    """``model`` as a forward function for :func:`traintape.analysis.sparse_update_from_run`
    and ``sparse_update_quality``."""
    return TorchForward(model, name_map)
