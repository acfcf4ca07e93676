"""The declared tensors of a run: per kind, a fixed set of canonical names.

The :class:`TensorRegistry` edits the run's manifest (``tensors``, ``forward_order``):
the set of tensors of a kind is fixed by its first declaration, in sorted canonical
order (the stats array's tensor axis); later calls name their tensors in any order and
are mapped onto that axis. Not thread-safe by itself: the Recorder holds its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from traintape.core.errors import RecordError, RecordNameError
from traintape.schema import (
    InvalidNameError,
    Kind,
    Manifest,
    TensorSpec,
    check_no_prefix_clash,
    validate_name,
)

_KIND_ORDER = {k: i for i, k in enumerate(Kind)}


class TensorRegistry:
    """Declared tensors per kind, kept in ``manifest.tensors`` (see the module docstring)."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.names: dict[Kind, list[str]] = {k: manifest.tensor_names(k) for k in manifest.kinds()}
        self._order_cache: dict[tuple[Kind, tuple[str, ...]], np.ndarray] = {}
        self._valid: set[str] = set()

    def declared(self, kind: Kind) -> bool:
        return kind in self.names

    def specs(self, kind: Kind) -> dict[str, TensorSpec]:
        """Declared specs of ``kind`` by name."""
        return {s.name: s for s in self.manifest.specs(kind)}

    def valid(self, name: str) -> str:
        """``name`` if it follows the canonical grammar, else :class:`RecordNameError`."""
        if name not in self._valid:
            try:
                validate_name(name)
            except InvalidNameError as e:
                raise RecordNameError(str(e)) from e
            self._valid.add(name)
        return name

    def declare(self, specs: Sequence[TensorSpec], *, in_forward_order: bool = True) -> None:
        """Declare the tensors of one or more kinds (see :meth:`Recorder.declare`)."""
        by_kind: dict[Kind, list[TensorSpec]] = {}
        for s in specs:
            by_kind.setdefault(Kind(s.kind), []).append(s)
        m = self.manifest
        for kind, ks in by_kind.items():
            names = sorted(s.name for s in ks)
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise RecordError(f"tensors {dup} declared twice for kind {kind.value}")
            if kind in self.names:
                self.check_same_set(kind, names)
                continue
            check_no_prefix_clash(names)
            if kind == Kind.ACTIVATION and in_forward_order and m.forward_order is None:
                m.forward_order = list(dict.fromkeys(s.layer for s in ks))
            ordered = self._harmonise_layer_kinds(sorted(ks, key=lambda s: s.name))
            m.tensors = sorted([*m.tensors, *ordered], key=lambda s: (_KIND_ORDER[s.kind], s.name))
            self.names[kind] = names

    def _harmonise_layer_kinds(self, new: list[TensorSpec]) -> list[TensorSpec]:
        """Fill ``layer_kind`` both ways between ``new`` and the declared specs: a layer's
        kind is a property of the layer, not of the kind of data."""
        known: dict[str, str] = {}
        for s in [*self.manifest.tensors, *new]:
            if s.layer_kind is not None:
                known.setdefault(s.layer, s.layer_kind)

        def fill(s: TensorSpec) -> TensorSpec:
            k = known.get(s.layer)
            return s.model_copy(update={"layer_kind": k}) if s.layer_kind is None and k else s

        self.manifest.tensors = [fill(s) for s in self.manifest.tensors]
        return [fill(s) for s in new]

    def check_same_set(self, kind: Kind, names: Iterable[str]) -> None:
        """Raise :class:`RecordError` naming the tensors that differ from the declared set."""
        got = set(names)
        want = set(self.names[kind])
        if got != want:
            missing = sorted(want - got)
            extra = sorted(got - want)
            raise RecordError(
                f"kind {kind.value}: the tensor set differs from the declared one"
                + (f"; missing {missing}" if missing else "")
                + (f"; not declared {extra}" if extra else "")
            )

    def order(self, kind: Kind, names: tuple[str, ...]) -> np.ndarray:
        """Indices taking rows named ``names`` to the declared (stats-axis) order."""
        key = (kind, names)
        order = self._order_cache.get(key)
        if order is None:
            self.check_same_set(kind, names)
            pos = {n: i for i, n in enumerate(names)}
            order = np.array([pos[n] for n in self.names[kind]], dtype=np.intp)
            self._order_cache[key] = order
        return order
