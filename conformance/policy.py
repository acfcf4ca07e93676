"""The capture policy every conformance run uses (one policy, so stores are comparable)."""

from __future__ import annotations

from conformance import spec as S


def policy() -> object:
    """Every step: param, grad, update, activation stats; full snapshots of param, grad
    and update on steps 0, FULL_EVERY, ... (activations: stats only — the JAX adapter
    ships no activation snapshots; see README)."""
    import traintape

    return traintape.CapturePolicy(
        every=1,
        full_every=S.FULL_EVERY,
        snapshot_kinds=("param", "grad", "update"),
    )


def recorder(url: str, model: str) -> object:
    """The Recorder every conformance run writes through: :func:`policy`, strict, and
    the model's forward order in ``manifest.user``."""
    import traintape

    return traintape.Recorder(
        url, policy=policy(), strict=True, user={"forward_order": S.FORWARD_ORDER[model]}
    )
