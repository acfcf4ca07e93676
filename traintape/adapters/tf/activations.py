"""Activations of a Keras model's parametrised layers, for the Keras callback and the
custom-loop tape alike.

:class:`ActivationCapture` wraps ``call`` of every layer that owns recorded parameters
(and every ``MultiHeadAttention``, recorded as one layer): a call made with
``training=True`` stashes its output (eagerly, or the symbolic tensor while a
``tf.function`` is traced); :meth:`ActivationCapture.groups` turns the stash into the
``activation`` group of the step being run or traced (``<layer>/output``, channels-last
as Keras computes them; stats over the batch, no snapshots of training batches). A fixed
``probe`` batch run with ``training=False`` (:meth:`ActivationCapture.run_probe`) gives
the activation snapshots of full-capture steps.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from traintape.core.naming import NameMap, canonical_name
from traintape.core.recorder import Recorder
from traintape.schema import Kind
from traintape.schema.names import split_name

from .canonical import activation_spec
from .names import layer_paths, model_entries


class ActivationCapture:
    """Stashes the training-mode outputs of a model's parametrised layers (see module)."""

    def __init__(self, recorder: Recorder, model: Any, name_map: NameMap = None) -> None:
        self.recorder = recorder
        self.model = model
        self.name_map = name_map
        self._wrapped: list[Any] = []
        self._stash: dict[str, tuple[str, str | None, Any]] = {}
        self._probing = False
        self._probe_out: dict[str, np.ndarray] = {}
        self._probe_snaps: dict[int, dict[str, np.ndarray]] = {}
        self.sink: Callable[[str, str, str | None, Any], None] | None = None
        """Where training-mode outputs go on the JAX and torch backends: called as
        ``sink(name, layer, layer_kind, output)`` (TF: None, the stash below)."""

    @property
    def installed(self) -> bool:
        return bool(self._wrapped)

    def install(self) -> None:
        """Wrap the layers (idempotent)."""
        if self._wrapped:
            return
        entries = model_entries(self.model, self.name_map)
        owners = {e.layer for e in entries}
        for path, layer in layer_paths(self.model):
            if not path:
                continue
            layer_name = canonical_name(path, None)
            name = canonical_name([*path, "output"], self.name_map)
            if isinstance(layer, keras.layers.MultiHeadAttention):
                # its tensors live on the q/k/v/o sub-layers; the output is the layer's
                self._wrap(layer, name, "attention")
            elif layer_name in owners or split_name(name)[0] in owners:
                kind = next((e.layer_kind for e in entries if e.layer == layer_name), None)
                self._wrap(layer, name, kind)

    def remove(self) -> None:
        """Unwrap every layer and forget stashed tensors."""
        for layer in self._wrapped:
            with contextlib.suppress(AttributeError):
                object.__delattr__(layer, "call")
        self._wrapped.clear()
        self._stash.clear()
        self._probe_snaps.clear()

    def _wrap(self, layer: Any, name: str, kind: str | None) -> None:
        orig = layer.call
        stash = self._stash

        @functools.wraps(orig)
        def call(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            if self._probing:
                t = out[0] if isinstance(out, (list, tuple)) else out
                # convert_to_numpy detaches (torch) and copies from the device
                self._probe_out[name] = np.asarray(keras.ops.convert_to_numpy(t))
                return out
            ctx = layer._get_call_context() if hasattr(layer, "_get_call_context") else None
            training = getattr(ctx, "training", None) if ctx is not None else None
            if training is None:
                training = kwargs.get("training")
            if training:
                t = out[0] if isinstance(out, (list, tuple)) else out
                if self.sink is not None:
                    self.sink(name, split_name(name)[0], kind, t)
                    return out
                import tensorflow as tf

                if isinstance(t, tf.Tensor):
                    old = stash.get(name)
                    if old is not None and _graph_of(old[2]) is not _graph_of(t):
                        del stash[name]  # left from another trace: re-enter in call order
                    stash[name] = (split_name(name)[0], kind, t)
            return out

        object.__setattr__(layer, "call", call)
        self._wrapped.append(layer)

    def groups(self) -> list[Any]:
        """The activation group of the step being run eagerly or traced (empties the
        stash of that graph).

        The stash is in layer call order (outputs enter it as the layers return), so
        the specs are declared in forward order (the recorder keeps it as
        ``manifest.forward_order``).
        """
        import tensorflow as tf

        from .capture import Group

        rec = self.recorder
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        items = [
            (name, layer, kind, t)
            for name, (layer, kind, t) in self._stash.items()
            if _graph_of(t) is graph and rec.policy.selects(name)
        ]
        self._stash.clear()  # entries of other graphs are left from stale traces
        if not items:
            return []
        rec.declare([activation_spec(n, k, t.dtype.name, t.shape.as_list())
                     for n, _, k, t in items])  # fmt: skip
        tensors = [t for *_, t in items]
        names = [n for n, *_ in items]
        return [Group(Kind.ACTIVATION, names, lambda: tensors, snapshot=False,
                      host_snapshots=self._probe_snapshots)]  # fmt: skip

    def run_probe(self, step: int, probe: Any) -> None:
        """On a full-capture step, run the model on ``probe`` (``training=False``, θ_t)
        and keep its layer outputs as that step's activation snapshots."""
        if not self._wrapped or not self.recorder.snapshots(step, Kind.ACTIVATION):
            return
        self._probing = True
        self._probe_out = {}
        try:
            self.model(probe, training=False)
        finally:
            self._probing = False
        self._probe_snaps = {step: self._probe_out}

    def _probe_snapshots(self, step: int) -> dict[str, np.ndarray] | None:
        snaps = self._probe_snaps.pop(step, None)
        if snaps is None:
            return None
        names = set(self.recorder.manifest.tensor_names(Kind.ACTIVATION))
        return {n: a for n, a in snaps.items() if n in names}


def _graph_of(t: Any) -> Any:
    """The graph a (symbolic) tensor belongs to; None for an eager tensor."""
    return getattr(t, "graph", None)  # EagerTensor.graph raises AttributeError


_BY_MODEL: dict[tuple[int, int], ActivationCapture] = {}


def capture_for(recorder: Recorder, model: Any, name_map: NameMap = None) -> ActivationCapture:
    """The installed capture of ``model`` for ``recorder`` (one per pair; the custom-loop
    tape is created every step). It is removed when the recorder closes."""
    key = (id(recorder), id(model))
    cap = _BY_MODEL.get(key)
    if cap is None or cap.recorder is not recorder or cap.model is not model:
        cap = ActivationCapture(recorder, model, name_map)
        cap.install()
        _BY_MODEL[key] = cap

        def remove(closing: bool) -> None:
            if closing:
                cap.remove()
                _BY_MODEL.pop(key, None)

        recorder.add_sync_hook(remove)
    return cap
