"""Where an adapter's step counter starts: :attr:`Recorder.next_step` by default.

A recorder opened with ``resume_step=N`` continues at step ``N``; appending to an
existing run continues after its last committed step; a new run starts at 0. Every
adapter (JAX ``value_and_grad``/``nnx_value_and_grad``/``filter_value_and_grad``/
``watch``, torch ``watch``, the HF and Lightning callbacks) numbers its first step there
unless given an explicit start step; an explicit one that disagrees with a recorder that
continues a run is refused with both numbers (it would either fail later with "step is
not after the last recorded step" or leave a gap).
"""

from __future__ import annotations

from traintape.core import Recorder
from traintape.core.errors import RecordError


def start_step(recorder: Recorder, explicit: int | None, where: str) -> int:
    """The first step ``where`` (an adapter, for the message) records.

    Args:
        explicit: the start step the user (or a training-loop callback) gave, or None.
    Returns ``recorder.next_step`` (read now, when the adapter is created) when
    ``explicit`` is None; else ``explicit``, which must equal it when the recorder
    continues a run or has recorded steps (``next_step > 0``). A new run
    (``next_step == 0``: nothing recorded before) may start anywhere, e.g. when
    recording is attached to a training already at step 1000.
    Raises :class:`RecordError` naming both steps otherwise.
    """
    nxt = recorder.next_step
    if explicit is None:
        return nxt
    if isinstance(explicit, bool) or int(explicit) != explicit or explicit < 0:
        raise RecordError(f"{where}: start step must be an int >= 0, got {explicit!r}")
    explicit = int(explicit)
    if nxt > 0 and explicit != nxt:
        raise RecordError(
            f"{where}: start step {explicit} disagrees with the recorder, which continues "
            f"{recorder.url} at step {nxt} (its resume_step, or after the last step recorded); "
            f"leave the start step out to start at {nxt}, or open the recorder with "
            f"resume_step={explicit}"
        )
    return explicit
