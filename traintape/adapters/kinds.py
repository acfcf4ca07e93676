"""Kinds asked of an adapter explicitly are recorded, whatever the policy's ``kinds``.

``traintape.jax.watch(tx, rec, kinds=("update", "opt_state"))`` (or torch
``watch(..., kinds=...)``) asks for those kinds: a kind the recorder's policy leaves out
(``opt_state`` is not among the default policy's kinds) is added for this recorder, never
dropped silently. The policy stored in the run's manifest stays the one the recorder was
opened with (a resumed run opened with the same policy is accepted); the tensors of the
added kind are declared in the manifest like any other. Steps and tensor selection
(``every``, ``include``/``exclude``) still follow the policy; snapshots of an added kind
are written only where the policy's ``snapshot_kinds`` name it.
"""

from __future__ import annotations

from collections.abc import Iterable

from traintape.core import Recorder
from traintape.schema import Kind


def request_kinds(recorder: Recorder, kinds: Iterable[Kind | str]) -> None:
    """Make ``recorder`` record ``kinds`` (added to its policy's kinds for this session)."""
    want = [Kind(k) for k in kinds]
    pol = recorder.policy
    extra = tuple(k for k in want if not pol.records_kind(k))
    if extra:
        recorder.policy = pol.model_copy(update={"kinds": (*pol.kinds, *extra)})
