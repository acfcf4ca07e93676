"""Rows: the open step, sealing, and first-NaN/Inf events.

A *row* holds everything recorded for one optimizer step (stat vectors per kind,
metrics). Calls for the same step add to the open row; the first call for a later step
seals it into the outbox (handed to the writer by the Recorder). Steps never go back,
and on resume continue after the last committed one. Not thread-safe by itself: the
Recorder holds its lock.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from traintape.core.errors import RecordError
from traintape.core.inputs import check_step
from traintape.core.writer import Row, Snapshot
from traintape.schema import STAT_INDEX, Event, EventType, Kind, Severity

_NAN, _INF = STAT_INDEX["nan_count"], STAT_INDEX["inf_count"]


class RowState:
    """The open row and the sealed rows/snapshots not yet handed to the writer."""

    def __init__(self, url: str, last_committed_step: int | None) -> None:
        self.url = url
        self.row: Row | None = None
        self.last_sealed = last_committed_step
        self.outbox: list[Row | Snapshot] = []
        self.on_open: Callable[[Row], None] | None = None
        """Called with each newly opened row (the Recorder's system metrics)."""

    def row_for(self, step: int) -> Row:
        """The open row of ``step`` (sealing an earlier open row); raises RecordError
        when ``step`` goes back."""
        step = check_step(step)
        row = self.row
        if row is not None and row.step == step:
            return row
        if row is not None and step < row.step:
            raise RecordError(
                f"step {step} is before step {row.step}, which is already being recorded; "
                f"steps must not go backwards"
            )
        if row is None and self.last_sealed is not None and step <= self.last_sealed:
            raise RecordError(
                f"step {step} is not after the last recorded step {self.last_sealed} "
                f"of {self.url}; steps must increase (resume continues after it)"
            )
        if row is not None:
            self.seal()
        self.row = Row(step)
        if self.on_open is not None:
            self.on_open(self.row)
        return self.row

    def seal(self) -> None:
        """Move the open row (if any) to the outbox."""
        if self.row is not None:
            self.last_sealed = self.row.step
            self.outbox.append(self.row)
            self.row = None

    def take(self) -> list[Row | Snapshot]:
        """Everything sealed so far (emptying the outbox)."""
        items, self.outbox = self.outbox, []
        return items


class NonfiniteEvents:
    """One ERROR event the first time each tensor (or metric) holds NaN or Inf."""

    def __init__(self, events: list[Event]) -> None:
        self.seen: set[tuple[str, str, str]] = {
            (e.type, str(e.kind), e.tensor or "") for e in events
        }

    def of_stats(self, step: int, kind: Kind, names: list[str], vecs: np.ndarray) -> list[Event]:
        """Events for stat vectors ``vecs`` (declared order ``names``) at ``step``."""
        nan, inf = vecs[:, _NAN], vecs[:, _INF]
        if not (nan.any() or inf.any()):  # the common case (counts are >= 0)
            return []
        out = []
        for typ, counts in ((EventType.NAN, nan), (EventType.INF, inf)):
            for i in np.flatnonzero(counts > 0):
                ev = self._first(step, typ, kind, names[i], int(counts[i]))
                if ev is not None:
                    out.append(ev)
        return out

    def of_metric(self, step: int, name: str, value: float) -> Event | None:
        if np.isfinite(value):
            return None
        return self._first(step, EventType.NAN if np.isnan(value) else EventType.INF, None, name)

    def _first(
        self, step: int, typ: EventType, kind: Kind | None, name: str, count: int | None = None
    ) -> Event | None:
        key = (typ, str(kind), name)
        if key in self.seen:
            return None
        self.seen.add(key)
        what = f"{kind.value} {name!r}" if kind is not None else f"metric {name!r}"
        data: dict[str, float | int | str] = {"count": count} if count is not None else {}
        return Event(
            step=step,
            type=typ,
            severity=Severity.ERROR,
            tensor=name,
            kind=kind,
            message=f"first {typ.upper()} in {what} at step {step}",
            data=data,
        )
