"""Recorder-facing rules shared by the TF tape and the Keras callback (no TF import).

- :func:`next_step`: where a step counter starts — ``Recorder.next_step`` (the step the
  next record carries: the ``resume_step`` of a resumed run, 0 for a new one).
- :func:`start_offset`: how the optimizer's ``iterations`` maps onto recorded steps.
- :func:`request_kinds`: kinds asked of an adapter explicitly are recorded even where
  the recorder's policy leaves them out (the explicit request wins).
- :func:`producer`: the ``Producer`` fields of a Keras run, naming its backend.
- :func:`selected`, :func:`declare`: the policy's tensor globs, parameter-layout specs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from traintape.core.errors import RecordError
from traintape.core.recorder import Recorder
from traintape.schema import Kind

_log = logging.getLogger("traintape")


def next_step(rec: Recorder) -> int:
    """The step the recorder's next record will carry: ``Recorder.next_step`` where the
    core has it, else the ``resume_step`` it was opened with (0 for a new run)."""
    got = getattr(rec, "next_step", None)
    if got is not None:
        return int(got)
    resume = getattr(rec, "_resume_step", None)
    return int(resume) if resume is not None else 0


def start_offset(rec: Recorder, iterations: int, owner: str) -> int:
    """Recorded step = optimizer ``iterations`` + the returned offset.

    A fresh optimizer (``iterations == 0``) counts from :func:`next_step` (a resumed
    recorder's step, as every adapter's counter does); an optimizer that has stepped
    (restored from a checkpoint) is an explicit step: it must equal ``next_step`` when
    the recorder resumes a run, else a :class:`RecordError` names both numbers. A new
    run (``next_step == 0``) takes the optimizer's count as it is.
    """
    nxt = next_step(rec)
    if iterations == 0 or nxt == 0:
        return nxt if iterations == 0 else 0
    if iterations != nxt:
        raise RecordError(
            f"{owner}: the optimizer's iterations is {iterations} but the recorder "
            f"{rec.url} resumes at step {nxt} (Recorder(resume_step={nxt})); restore the "
            f"optimizer from the checkpoint of step {nxt} or open the recorder with "
            f"resume_step={iterations}"
        )
    return 0


def request_kinds(rec: Recorder, kinds: Iterable[Kind | str], owner: str) -> None:
    """Record ``kinds`` (asked of an adapter explicitly) even if the recorder's policy
    leaves them out: the explicit request wins (the policy's kinds are extended, with an
    info log naming them)."""
    extra = tuple(Kind(k) for k in kinds if not rec.policy.records_kind(k))
    if not extra:
        return
    policy = rec.policy.model_copy(update={"kinds": (*rec.policy.kinds, *extra)})
    rec.policy = policy
    manifest = getattr(rec, "_manifest", None)
    if manifest is not None and getattr(manifest, "policy", None) is not None:
        manifest.policy = policy
    _log.info(
        "%s: recording %s as asked, although the recorder's policy leaves them out",
        owner,
        [k.value for k in extra],
    )


def producer(adapter: str) -> dict[str, Any]:
    """``Producer`` fields of a Keras 3 run: ``framework="keras"`` and
    ``framework_version="3.x / <backend> <version>"`` (``keras 3.15.1 / jax 0.10.2``)."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        version = jax.__version__
    elif backend == "torch":
        import torch

        version = torch.__version__
    else:
        import tensorflow as tf

        version = tf.__version__
    return {
        "framework": "keras",
        "framework_version": f"{keras.__version__} / {backend} {version}",
        "adapter": adapter,
    }


def selected(rec: Recorder, entries: Sequence[Any]) -> list[Any]:
    """Entries (anything with ``.name``) selected by the policy's include/exclude globs."""
    return [e for e in entries if rec.policy.selects(e.name)]


def declare(rec: Recorder, kind: Kind, entries: Sequence[Any]) -> None:
    """Declare parameter-layout specs of ``entries`` for ``kind`` (idempotent)."""
    from .canonical import entry_spec

    if entries and rec.policy.records_kind(kind):
        rec.declare([entry_spec(e, kind) for e in entries])
