"""The capture engine shared by the tape, the optimizer observer and the Keras callback.

Everything that touches tensors is written once for both modes:

- eagerly, the step is a Python int, ``Recorder.wants`` decides and raw rows are
  computed (host kernel or TF ops) then handed to ``Recorder.record_step``;
- inside ``tf.function`` the step is a tensor: ``CapturePolicy.captures(step)`` gates a
  ``tf.cond`` whose true branch computes every raw row in the graph and hands
  them (plus full tensors on full-capture steps only) to the host in **one**
  ``tf.numpy_function`` call per emission.

Tensor producers are passed as zero-argument callables so the work happens only
inside the taken branch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from traintape.core.recorder import KindRows, Recorder
from traintape.schema import Kind
from traintape.schema.stats import IndexMap, activation_map

from .recording import declare, selected
from .stats import host_raw_matrices, host_stats_enabled, raw_matrix

_log = logging.getLogger("traintape")
__all__ = ["Group", "declare", "emit", "selected"]
TensorsFn = Callable[[], Sequence[Any]]


@dataclass
class Group:
    """Tensors of one kind recorded together: ``fn()`` returns them in ``names`` order."""

    kind: Kind
    names: list[str]
    fn: TensorsFn
    snapshot: bool = True  # False: never pass full tensors (training-batch activations)
    host_snapshots: Callable[[int], Mapping[str, np.ndarray] | None] | None = None
    """Snapshots already on the host (probe-batch activations), looked up by step."""


def _maps(kind: Kind, tensors: Sequence[Any]) -> list[IndexMap | None]:
    """Index maps (the ``sig`` statistic's) of a group's tensors held on the host: TF
    holds tensors in the canonical layout; an activation's batch axis is free."""
    if kind is not Kind.ACTIVATION:
        return [None] * len(tensors)
    return [activation_map(tuple(np.shape(t))) for t in tensors]


def _active(rec: Recorder, groups: Sequence[Group]) -> list[Group]:
    return [g for g in groups if g.names and rec.policy.records_kind(g.kind)]


def _host(
    rec: Recorder, groups: Sequence[Group], snap: list[bool], on_host: bool = False
) -> Callable:
    """Host callback. ``on_host``: the arguments are the full tensors of every group
    (in group order, snapshots taken from them where ``snap``), not stat matrices."""

    def fn(step: Any, *arrays: np.ndarray) -> np.int64:
        try:
            _record(step, arrays)
        except Exception:
            if rec.strict:
                raise
            _log.exception("traintape.tf: recording step %s failed (training goes on)", step)
        return np.int64(0)

    def _record(step: Any, arrays: Sequence[np.ndarray]) -> None:
        s = int(step)
        n = len(groups)
        if on_host:  # full tensors came over: stats on the host with the fused kernel
            parts, k = [], 0
            for g in groups:
                parts.append(arrays[k : k + len(g.names)])
                k += len(g.names)
            maps = [_maps(g.kind, part) for g, part in zip(groups, parts, strict=True)]
            mats = host_raw_matrices(parts, maps)  # one kernel call for the whole step
            rows = []
            for g, sn, part, st in zip(groups, snap, parts, mats, strict=True):
                snaps: Mapping[str, np.ndarray] | None = None
                if sn and rec.snapshots(s, g.kind):
                    snaps = {x: np.array(a, copy=True) for x, a in zip(g.names, part, strict=True)}
                elif g.host_snapshots is not None and rec.snapshots(s, g.kind):
                    snaps = g.host_snapshots(s)
                rows.append(KindRows(g.kind, g.names, st, snaps))
            rec.record_step(s, rows)
            return
        stats, rest = arrays[:n], list(arrays[n:])
        rows = []
        for g, st, sn in zip(groups, stats, snap, strict=True):
            kind, nm = g.kind, g.names
            snaps = None
            if sn:
                snaps = {x: rest.pop(0) for x in nm}
            elif g.host_snapshots is not None:
                snaps = g.host_snapshots(s)
            if not rec.snapshots(s, kind):
                snaps = None
            rows.append(KindRows(kind, nm, st, snaps))
        rec.record_step(s, rows)

    return fn


def emit(rec: Recorder, step: Any, groups: Sequence[Group]) -> Any:
    """Record ``groups`` at optimizer ``step`` (int, or scalar tensor inside tf.function)."""
    groups = _active(rec, groups)
    if not groups:
        return None
    if tf.executing_eagerly():
        return _emit_eager(rec, int(step), groups)
    return _emit_graph(rec, tf.cast(step, tf.int64), groups)


def _emit_eager(rec: Recorder, step: int, groups: Sequence[Group]) -> None:
    groups = [g for g in groups if rec.wants(step, g.kind)]
    tensors = [list(g.fn()) for g in groups]
    if host_stats_enabled():  # one fused kernel call for the whole step
        maps = [_maps(g.kind, ts) for g, ts in zip(groups, tensors, strict=True)]
        mats = host_raw_matrices(tensors, maps)
    else:
        mats = [
            raw_matrix(ts, batch_free=g.kind is Kind.ACTIVATION).numpy()
            for g, ts in zip(groups, tensors, strict=True)
        ]
    rows = []
    for g, ts, stats in zip(groups, tensors, mats, strict=True):
        snaps = None
        if g.snapshot and rec.snapshots(step, g.kind):
            # views of immutable eager tensors: a variable's later in-place update
            # copies on write while a view holds its buffer
            snaps = {
                n: np.asarray(tf.convert_to_tensor(t)) for n, t in zip(g.names, ts, strict=True)
            }
        rows.append(KindRows(g.kind, g.names, stats, snaps))
    rec.record_step(step, rows)


def _emit_graph(rec: Recorder, step: tf.Tensor, groups: Sequence[Group]) -> tf.Tensor:
    pol = rec.policy
    snap = [g.snapshot and g.kind in pol.snapshot_kinds for g in groups]

    def taken() -> tf.Tensor:
        tensors = [[tf.convert_to_tensor(t) for t in g.fn()] for g in groups]
        if host_stats_enabled():
            # CPU only: the tensors cross to numpy without a device copy and one fused
            # C pass per tensor beats TF's multi-op stat graph (see stats.py).
            flat_all = [t for ts in tensors for t in ts]
            host = _host(rec, groups, snap, on_host=True)
            return tf.numpy_function(host, [step, *flat_all], tf.int64, stateful=True)
        stats = [
            raw_matrix(ts, batch_free=g.kind is Kind.ACTIVATION)
            for g, ts in zip(groups, tensors, strict=True)
        ]
        plain = _host(rec, groups, [False] * len(groups))

        def stats_only() -> tf.Tensor:
            return tf.numpy_function(plain, [step, *stats], tf.int64, stateful=True)

        if pol.full_every is None or not any(snap):
            return stats_only()
        full = _host(rec, groups, snap)
        flat = [t for ts, sn in zip(tensors, snap, strict=True) if sn for t in ts]

        def with_full() -> tf.Tensor:
            return tf.numpy_function(full, [step, *stats, *flat], tf.int64, stateful=True)

        return tf.cond(pol.is_full(step), with_full, stats_only)

    return tf.cond(pol.captures(step), taken, lambda: tf.constant(0, tf.int64))
