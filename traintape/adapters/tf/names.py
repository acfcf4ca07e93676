"""Keras 3 / TensorFlow variables → canonical names, roles and layouts.

Layer paths are found by walking the model, not by parsing ``variable.path`` alone
(Keras paths drop list indices and repeat names in subclassed models):

- Sequential and Functional models: each layer is the segment ``layer.name``.
- Subclassed layers/models: a public attribute holding a layer gives ``layer.name``
  (as in ``variable.path``); a list/tuple of layers gives ``<attribute>/<index>``
  (the layer names inside lists are dropped, as Flax does with ``layers_0``); a dict
  of layers gives ``<attribute>/<key>``.
- The model's own scope and ``:0`` suffixes never appear. Auto-generated names
  (``dense_1``) are kept as they are; use ``name_map`` to rename.

Roles and layouts (Keras already stores channels-last, kernel-last, like canonical):

=====================  ===========================================================
Keras layer            canonical
=====================  ===========================================================
Dense / Conv*          ``kernel``, ``bias`` (identical layout)
Embedding              ``embeddings`` → ``embedding``
Layer/Group/RMS norm   ``gamma`` → ``scale``, ``beta`` → ``bias``
BatchNormalization     + ``moving_mean`` → ``running_mean``,
                       ``moving_variance`` → ``running_var``
LSTM                   ``kernel`` → ``kernel_ih`` (in, 4h), ``recurrent_kernel`` →
                       ``kernel_hh`` (h, 4h), ``bias`` → ``bias_ih`` (4h,), plus
                       ``bias_hh`` (4h,) (see below). Keras gate order i, f, c, o is
                       canonical i, f, g, o.
GRU (reset_after=True) ``kernel`` → ``kernel_ih``, ``recurrent_kernel`` → ``kernel_hh``,
                       ``bias[0]`` → ``bias_ih``, ``bias[1]`` → ``bias_hh``; gate blocks
                       permuted from Keras z, r, h to canonical r, z, n along the last
                       axis. A GRU with reset_after=False keeps its Keras leaves
                       (``kernel``, ``recurrent_kernel``, ``bias``), no layer kind.
MultiHeadAttention     sub-layers ``q``, ``k``, ``v``, ``o`` (from ``query``, ``key``,
                       ``value``, ``attention_output``); q/k/v ``kernel`` (in, heads,
                       head_dim) is reshaped to (in, heads*head_dim), ``bias``
                       (heads, head_dim) to (heads*head_dim,); o ``kernel`` (heads,
                       head_dim, out) to (heads*head_dim, out). Row-major reshape:
                       canonical column ``h*head_dim + d`` is head ``h``, dim ``d``.
=====================  ===========================================================

Block permutations and reshapes are not axis transposes, so specs carry
``permutation=None`` and the transform is documented here; ``source_name`` is the
Keras ``variable.path`` (with ``[0]``/``[1]`` for the rows of the GRU bias).

LSTM biases: the canonical LSTM has PyTorch's two biases ``bias_ih`` and ``bias_hh``
(schema roles; the torch adapter records both), which the cell only ever uses summed.
A Keras LSTM has one ``bias`` = ``bias_ih + bias_hh``, so it is recorded as a Keras
LSTM *is*: ``bias_ih`` = the Keras bias, ``bias_hh`` = a parameter pinned at zero —
``param`` zeros, ``grad`` = the gradient of the Keras bias (∂L/∂b_hh = ∂L/∂b_ih, exactly
as PyTorch reports it), ``update`` zeros (the optimizer moves only the Keras bias). The
tensor set, shapes, θ_0 and ∇L(θ_0) therefore equal those of a PyTorch LSTM loaded from
the same canonical weights with a zero ``bias_hh``. ``bias_hh`` has no Keras variable of
its own (``source_name`` names the Keras bias with a ``+0`` mark, ``source_shape`` is
None). :func:`~traintape.adapters.tf.canonical.from_canonical` loads
``bias = bias_ih + bias_hh``, so PyTorch weights (any ``bias_hh``) load exactly and a
Keras round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
from numpy.typing import NDArray

from traintape.core.naming import NameMap, canonical_name
from traintape.schema import roles as R
from traintape.schema.names import split_name

try:  # Keras 3 internal class of functional models
    from keras.src.models.functional import Functional as _Functional
except ImportError:  # pragma: no cover
    _Functional = ()


# --------------------------------------------------------------------- transforms
@dataclass(frozen=True)
class Transform:
    """How one canonical tensor is read from (and written into) one Keras variable.

    ``row``: take ``source[row]`` first (GRU bias). ``cols``: gather these indices of
    the last axis (gate block permutation). ``shape``: reshape (row-major) to it.
    """

    row: int | None = None
    cols: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None

    @property
    def identity(self) -> bool:
        return self.row is None and self.cols is None and self.shape is None

    def tf(self, x: Any) -> Any:
        """Source tensor → canonical tensor of the Keras backend's own kind (a TF tensor
        inside or outside ``tf.function``, a traced JAX array inside the compiled step,
        a torch tensor)."""
        if self.identity:
            return x
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            if self.row is not None:
                x = x[self.row]
            if self.cols is not None:
                x = tf.gather(x, list(self.cols), axis=-1)
            if self.shape is not None:
                x = tf.reshape(x, self.shape)
            return x
        ops = keras.ops
        if self.row is not None:
            x = x[self.row]
        if self.cols is not None:
            x = ops.take(x, np.asarray(self.cols, np.int32), axis=-1)
        if self.shape is not None:
            x = ops.reshape(x, self.shape)
        return x

    def np(self, x: np.ndarray) -> np.ndarray:
        if self.row is not None:
            x = x[self.row]
        if self.cols is not None:
            x = x[..., list(self.cols)]
        if self.shape is not None:
            x = x.reshape(self.shape)
        return x

    def write(self, buf: NDArray[Any], value: NDArray[Any]) -> None:
        """Write a canonical ``value`` into ``buf`` (a copy of the source variable)."""
        target = buf[self.row] if self.row is not None else buf
        if self.cols is not None:
            shaped = value.reshape(target.shape)
            target[..., list(self.cols)] = shaped
        else:
            target[...] = value.reshape(target.shape)


@dataclass
class Entry:
    """One canonical tensor backed by (part of) one Keras variable."""

    name: str
    variable: Any
    role: str
    layer: str
    layer_kind: str | None
    shape: tuple[int, ...]
    source_name: str
    transform: Transform = field(default_factory=Transform)
    trainable: bool = True
    zero: bool = False
    """A parameter pinned at zero that the Keras variable absorbs (LSTM ``bias_hh``):
    its value reads as zeros, its gradient is the variable's gradient, and
    ``from_canonical`` adds it into the variable instead of replacing it."""

    @property
    def source_shape(self) -> tuple[int, ...] | None:
        """Shape of the backing Keras variable (None for a ``zero`` entry)."""
        if self.zero:
            return None
        return tuple(int(d) for d in self.variable.shape)

    def read(self) -> Any:
        """The canonical value as a backend tensor (in-graph / in-trace safe)."""
        return self.canonical(_tensor(self.variable))

    def canonical(self, x: Any) -> Any:
        """``x`` (a value of the backing variable, a backend tensor) in canonical layout;
        zeros for a ``zero`` entry."""
        x = self.transform.tf(x)
        return keras.ops.zeros_like(x) if self.zero else x

    def read_np(self) -> np.ndarray:
        """The canonical value as a host array (eager only)."""
        x = self.transform.np(np.asarray(keras.ops.convert_to_numpy(self.variable)))
        return np.zeros_like(x) if self.zero else x

    def grad(self, g: Any) -> Any:
        """The canonical gradient from the gradient ``g`` of the backing variable."""
        return self.transform.tf(_tensor(g))


def _tensor(x: Any) -> Any:
    """A variable's value or a gradient as a dense backend tensor (TF ``IndexedSlices``
    densified)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.convert_to_tensor(x)
    return keras.ops.convert_to_tensor(x)


def _gate_cols(units: int, order: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(j) for g in order for j in range(g * units, (g + 1) * units))


# --------------------------------------------------------------------- walking
def _is_graph_model(layer: Any) -> bool:
    return isinstance(layer, keras.Sequential) or (
        bool(_Functional) and isinstance(layer, _Functional)
    )


def _children(layer: Any) -> list[tuple[list[str], Any]]:
    """Direct sub-layers of ``layer`` with the path segments they add."""
    out: list[tuple[list[str], Any]] = []
    if _is_graph_model(layer):
        for sub in layer.layers:
            if not isinstance(sub, keras.layers.InputLayer):
                out.append(([sub.name], sub))
        return out
    attrs = dict(vars(layer))
    # torch backend: Keras layers are torch Modules, which keep sub-modules in _modules
    for attr, val in getattr(layer, "_modules", {}).items():
        attrs.setdefault(attr, val)
    for attr, val in attrs.items():
        if attr.startswith("_"):
            continue
        if isinstance(val, keras.layers.Layer):
            out.append(([val.name], val))
        elif isinstance(val, (list, tuple)):
            for i, v in enumerate(val):
                if isinstance(v, keras.layers.Layer):
                    out.append(([attr, str(i)], v))
        elif isinstance(val, dict):
            for k, v in val.items():
                if isinstance(v, keras.layers.Layer):
                    out.append(([attr, str(k)], v))
    return out


def layer_paths(model: Any) -> list[tuple[list[str], Any]]:
    """Every layer under ``model`` (not the model itself) with its path segments.

    Shared layers keep their first path.
    """
    seen: set[int] = set()
    out: list[tuple[list[str], Any]] = []

    def walk(layer: Any, prefix: list[str]) -> None:
        for segs, sub in _children(layer):
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            path = prefix + segs
            out.append((path, sub))
            if not isinstance(sub, (keras.layers.LSTM, keras.layers.GRU,
                                    keras.layers.MultiHeadAttention)):  # fmt: skip
                walk(sub, path)

    walk(model, [])
    return out


def _own_variables(layer: Any) -> list[Any]:
    own = [*getattr(layer, "_trainable_variables", []),
           *getattr(layer, "_non_trainable_variables", [])]  # fmt: skip
    return own


_NORMS = (
    (keras.layers.BatchNormalization, R.BATCH_NORM),
    (keras.layers.LayerNormalization, R.LAYER_NORM),
    (keras.layers.GroupNormalization, R.GROUP_NORM),
)


def _layer_kind(layer: Any) -> str | None:
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return R.DENSE
    if isinstance(layer, keras.layers.Embedding):
        return R.EMBED
    for cls, kind in _NORMS:
        if isinstance(layer, cls):
            return kind
    rms = getattr(keras.layers, "RMSNormalization", None)
    if rms is not None and isinstance(layer, rms):
        return R.RMS_NORM
    name = type(layer).__name__
    if name.startswith("Conv") and "Transpose" not in name:
        return R.CONV
    return None


def _entries_for_layer(layer: Any, path: list[str], name_map: NameMap) -> list[Entry]:
    def make(segs: list[str], role: str, var: Any, kind: str | None, **kw: Any) -> Entry:
        src = kw.pop("source_name", var.path)
        name = canonical_name([*segs, role], name_map, source_name=src)
        lay, rl = split_name(name)
        tr: Transform = kw.pop("transform", Transform())
        shape = tuple(tr.np(np.zeros(tuple(var.shape), dtype=np.int8)).shape)
        return Entry(name=name, variable=var, role=rl, layer=lay, layer_kind=kind, shape=shape,
                     source_name=src, transform=tr, trainable=bool(var.trainable), **kw)  # fmt: skip

    if isinstance(layer, keras.layers.LSTM):
        c = layer.cell
        out = [make(path, R.KERNEL_IH, c.kernel, R.LSTM),
               make(path, R.KERNEL_HH, c.recurrent_kernel, R.LSTM)]  # fmt: skip
        if c.use_bias:  # bias_ih = the Keras bias, bias_hh pinned at zero (module doc)
            out += [make(path, R.BIAS_IH, c.bias, R.LSTM),
                    make(path, R.BIAS_HH, c.bias, R.LSTM, source_name=f"{c.bias.path}+0",
                         zero=True)]  # fmt: skip
        return out
    if isinstance(layer, keras.layers.GRU):
        c = layer.cell
        if not c.reset_after:
            return [make(path, v.name, v, None) for v in _own_variables(c)]
        cols = _gate_cols(c.units, (1, 0, 2))  # Keras z, r, h -> canonical r, z, n
        g = Transform(cols=cols)
        out = [make(path, R.KERNEL_IH, c.kernel, R.GRU, transform=g),
               make(path, R.KERNEL_HH, c.recurrent_kernel, R.GRU, transform=g)]  # fmt: skip
        if c.use_bias:
            for row, role in ((0, R.BIAS_IH), (1, R.BIAS_HH)):
                out.append(make(path, role, c.bias, R.GRU, source_name=f"{c.bias.path}[{row}]",
                                transform=Transform(row=row, cols=cols)))  # fmt: skip
        return out
    if isinstance(layer, keras.layers.MultiHeadAttention):
        out = []
        subs = (("q", layer.query_dense), ("k", layer.key_dense),
                ("v", layer.value_dense), ("o", layer.output_dense))  # fmt: skip
        for short, dense in subs:
            for v in _own_variables(dense):
                shp = tuple(int(d) for d in v.shape)
                new: tuple[int, ...]
                if short == "o" and v.name == "kernel":
                    new = (shp[0] * shp[1], shp[2])
                elif v.name == "kernel":
                    new = (shp[0], shp[1] * shp[2])
                else:
                    new = (int(np.prod(shp)),)
                tr = Transform(shape=new) if new != shp else Transform()
                out.append(make([*path, short], R.canonical_role(v.name), v, R.DENSE, transform=tr))
        return out
    kind = _layer_kind(layer)
    return [make(path, R.canonical_role(v.name), v, kind) for v in _own_variables(layer)]


def _fallback_segments(path: str, model_name: str | None) -> list[str]:
    segs = [s for s in path.split(":")[0].split("/") if s]
    if model_name and len(segs) > 1 and segs[0] == model_name:
        segs = segs[1:]
    return [*segs[:-1], R.canonical_role(segs[-1])]


def model_entries(model: Any, name_map: NameMap = None) -> list[Entry]:
    """Canonical entries of every variable of a built Keras model/layer.

    Includes trainable variables and BatchNorm moving statistics; other non-trainable
    state (seed generators, metric accumulators) is skipped. Raises ``ValueError`` if
    two tensors get the same canonical name (use ``name_map``).
    """
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built; call it on a batch first")
    entries: list[Entry] = []
    covered: set[int] = set()
    for path, layer in layer_paths(model):
        for e in _entries_for_layer(layer, path, name_map):
            entries.append(e)
            covered.add(id(e.variable))
    if not _is_graph_model(model):
        entries.extend(_entries_for_layer(model, [], name_map))
        covered.update(id(e.variable) for e in entries)
    for v in model.trainable_variables:
        if id(v) not in covered:
            segs = _fallback_segments(v.path, model.name)
            entries.append(Entry(name=canonical_name(segs, name_map, v.path), variable=v,
                                 role=segs[-1], layer="/".join(segs[:-1]), layer_kind=None,
                                 shape=tuple(int(d) for d in v.shape), source_name=v.path))  # fmt: skip
            covered.add(id(v))
    entries = [e for e in entries if e.trainable or e.role in (R.RUNNING_MEAN, R.RUNNING_VAR)]
    _check_unique(entries)
    return entries


def variable_entries(
    variables: Iterable[Any], model: Any = None, name_map: NameMap = None
) -> list[list[Entry]]:
    """The canonical entries of each of ``variables`` (``[]`` for non-variables).

    With ``model``, names come from :func:`model_entries` (a GRU bias gives two
    entries); variables not in the model, and all variables without one, are named
    from ``variable.path`` (leaf mapped to its canonical role, layout unchanged).
    """
    by_var: dict[int, list[Entry]] = {}
    if model is not None:
        for e in model_entries(model, name_map):
            by_var.setdefault(id(e.variable), []).append(e)
    out: list[list[Entry]] = []
    for v in variables:
        if not hasattr(v, "assign"):
            out.append([])
            continue
        es = by_var.get(id(v))
        if es is None:
            path = getattr(v, "path", None) or v.name
            segs = _fallback_segments(path, None)
            name = canonical_name(segs, name_map, path)
            es = [Entry(name=name, variable=v, role=split_name(name)[1],
                        layer=split_name(name)[0], layer_kind=None,
                        shape=tuple(int(d) for d in v.shape), source_name=path)]  # fmt: skip
        out.append(es)
    return out


def _check_unique(entries: Sequence[Entry]) -> None:
    seen: dict[str, Entry] = {}
    for e in entries:
        if e.name in seen:
            raise ValueError(
                f"canonical name {e.name!r} given to both {seen[e.name].source_name!r} and "
                f"{e.source_name!r}; give the layers distinct names or pass name_map"
            )
        seen[e.name] = e
