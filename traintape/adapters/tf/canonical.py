"""Canonical weights in and out of a Keras model, and the specs declared for a store."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from traintape.core.naming import NameMap
from traintape.schema import Kind, TensorSpec

from .names import Entry, model_entries


def to_canonical(model: Any, name_map: NameMap = None) -> dict[str, np.ndarray]:
    """The model's weights (trainable + BatchNorm moving statistics) as host arrays,
    keyed by canonical name, in canonical layout (see :mod:`.names`; an LSTM gives
    ``bias_ih`` = its Keras bias and ``bias_hh`` = zeros)."""
    return {e.name: e.read_np() for e in model_entries(model, name_map)}


def from_canonical(
    model: Any,
    tensors: Mapping[str, Any],
    *,
    name_map: NameMap = None,
    strict: bool = True,
) -> None:
    """Load canonical weights into a built Keras ``model`` (inverse of :func:`to_canonical`).

    Args:
        tensors: canonical name -> array in canonical layout (any array-like).
        strict: require every model tensor to be given and every given name to be known;
            with False, unknown names are ignored and missing tensors keep their values.

    An LSTM's single Keras bias is loaded as ``bias_ih + bias_hh`` (PyTorch's two
    biases, which the cell only ever sums): PyTorch weights load exactly, and the
    ``bias_hh`` zeros of :func:`to_canonical` make a Keras round trip bit-exact. Without
    ``bias_ih`` (``strict=False``) the current Keras bias stands for it.

    Raises:
        KeyError: missing/unknown names (strict); ValueError: wrong shapes.
    """
    entries = model_entries(model, name_map)
    by_name = {e.name: e for e in entries}
    unknown = sorted(set(tensors) - set(by_name))
    missing = sorted(set(by_name) - set(tensors))
    if strict and (unknown or missing):
        raise KeyError(f"from_canonical: missing {missing}; unknown {unknown}")
    given = [(by_name[n], np.asarray(v)) for n, v in tensors.items() if n in by_name]
    for e, arr in given:
        if tuple(arr.shape) != e.shape:
            raise ValueError(
                f"from_canonical: {e.name!r} has shape {arr.shape}, expected {e.shape}"
            )
    bufs: dict[int, tuple[Any, np.ndarray]] = {}
    # replacing writes first, then the pinned-zero entries add into their variable
    for e, arr in sorted(given, key=lambda p: p[0].zero):
        v = e.variable
        if id(v) not in bufs:
            bufs[id(v)] = (v, np.array(keras.ops.convert_to_numpy(v), copy=True))
        buf = bufs[id(v)][1]
        if e.zero:
            e.transform.write(buf, e.transform.np(buf) + arr.astype(buf.dtype, copy=False))
        else:
            e.transform.write(buf, arr.astype(buf.dtype, copy=False))
    for v, buf in bufs.values():
        v.assign(buf)


def entry_spec(e: Entry, kind: Kind | str) -> TensorSpec:
    """The TensorSpec of a parameter-layout tensor (param/grad/update) of ``e``."""
    return TensorSpec.build(
        e.name,
        kind,
        layer_kind=e.layer_kind,
        dtype=keras.backend.standardize_dtype(e.variable.dtype),
        shape=e.shape,
        source_name=e.source_name,
        source_shape=e.source_shape,
    )


def activation_spec(
    name: str, layer_kind: str | None, dtype: str, shape: Sequence[int | None]
) -> TensorSpec:
    """The TensorSpec of an activation ``<layer>/output`` (batch axis ``None``)."""
    return TensorSpec.build(name, Kind.ACTIVATION, layer_kind=layer_kind, dtype=dtype, shape=shape)
