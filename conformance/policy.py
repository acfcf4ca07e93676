"""The capture policy every conformance run uses (one policy per optimizer, so stores are
comparable)."""

from __future__ import annotations

from conformance import spec as S


def policy(optimizer: str = "sgd") -> object:
    """Every step: param, grad, update, activation stats; full snapshots of param, grad
    and update on steps 0, FULL_EVERY, ... (activations: stats only — the JAX adapter
    ships no activation snapshots; see README). With Adam, ``opt_state`` too (stats
    every step, snapshots on full steps): Adam's ``mu``/``nu`` are the same quantities in
    every framework, SGD's momentum buffer is not (Keras keeps −lr × torch's/optax's
    trace)."""
    import traintape

    kinds = ["param", "grad", "update", "activation"]
    snaps = ["param", "grad", "update"]
    if optimizer == "adam":
        kinds.append("opt_state")
        snaps.append("opt_state")
    return traintape.CapturePolicy(
        every=1, full_every=S.FULL_EVERY, kinds=tuple(kinds), snapshot_kinds=tuple(snaps)
    )


def recorder(url: str, model: str, optimizer: str = "sgd") -> object:
    """The Recorder every conformance run writes through: :func:`policy` of
    ``optimizer``, strict, and the model's forward order in ``manifest.user``."""
    import traintape

    return traintape.Recorder(
        url,
        policy=policy(optimizer),
        strict=True,
        user={"forward_order": S.FORWARD_ORDER[model]},
    )
