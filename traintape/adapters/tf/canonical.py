"""Canonical weights in and out of a Keras model, and the specs declared for a store."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from traintape.core.naming import NameMap
from traintape.schema import Kind, TensorSpec

from .names import Entry, model_entries


def to_canonical(model: Any, name_map: NameMap = None) -> dict[str, np.ndarray]:
    """The model's weights (trainable + BatchNorm moving statistics) as host arrays,
    keyed by canonical name, in canonical layout (see :mod:`.names`)."""
    return {e.name: e.transform.np(np.asarray(e.variable.numpy())) for e in model_entries(
        model, name_map)}  # fmt: skip


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
        strict: require every model tensor to be given and every given name to be known.
            An LSTM also accepts ``<lstm>/bias_hh``: it is added into the single Keras bias
            together with ``bias_ih`` (PyTorch's two biases are only ever summed).
    Raises:
        KeyError: missing/unknown names (strict); ValueError: wrong shapes.
    """
    entries = model_entries(model, name_map)
    by_name = {e.name: e for e in entries}
    extra_hh: dict[str, Entry] = {}
    for e in entries:
        if e.role == "bias_ih" and e.layer_kind == "lstm":
            extra_hh[f"{e.layer}/bias_hh" if e.layer else "bias_hh"] = e
    unknown = sorted(set(tensors) - set(by_name) - set(extra_hh))
    missing = sorted(set(by_name) - set(tensors))
    if strict and (unknown or missing):
        raise KeyError(f"from_canonical: missing {missing}; unknown {unknown}")
    bufs: dict[int, tuple[Any, np.ndarray]] = {}
    for name, value in tensors.items():
        e = by_name.get(name) or extra_hh.get(name)
        if e is None:
            continue
        arr = np.asarray(value)
        if name in by_name and tuple(arr.shape) != e.shape:
            raise ValueError(f"from_canonical: {name!r} has shape {arr.shape}, expected {e.shape}")
        v = e.variable
        if id(v) not in bufs:
            bufs[id(v)] = (v, np.array(v.numpy(), copy=True))
        buf = bufs[id(v)][1]
        if name in extra_hh:
            continue
        e.transform.write(buf, arr.astype(buf.dtype, copy=False))
    for name, e in extra_hh.items():  # add bias_hh after bias_ih was written
        if name in tensors:
            buf = bufs[id(e.variable)][1]
            buf += np.asarray(tensors[name], dtype=buf.dtype).reshape(buf.shape)
    for v, buf in bufs.values():
        v.assign(buf)


def entry_spec(e: Entry, kind: Kind | str) -> TensorSpec:
    """The TensorSpec of a parameter-layout tensor (param/grad/update) of ``e``."""
    return TensorSpec(
        name=e.name,
        kind=Kind(kind),
        role=e.role,
        layer=e.layer,
        layer_kind=e.layer_kind,
        dtype=tf.as_dtype(e.variable.dtype).name,
        shape=list(e.shape),
        source_name=e.source_name,
        source_shape=list(e.source_shape),
        permutation=None,
    )


def activation_spec(
    name: str, layer: str, layer_kind: str | None, dtype: str, shape: Sequence[int | None]
) -> TensorSpec:
    """The TensorSpec of an activation ``<layer>/output`` (batch axis ``None``)."""
    return TensorSpec(
        name=name, kind=Kind.ACTIVATION, role="output", layer=layer, layer_kind=layer_kind,
        dtype=dtype, shape=[None, *list(shape)[1:]],
    )  # fmt: skip
