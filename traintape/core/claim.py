"""One writer per store: the writer claim.

A Recorder claims its store before it writes anything: a small JSON document at
:data:`CLAIM_KEY` (session id, host, pid, start time, heartbeat) created with a
*conditional* kvstore write — "only if the key does not exist" — so of two writers racing
for a store exactly one wins, on a local disk (TensorStore's file driver serialises the
condition with a lock file) as on object storage (the same TensorStore call; S3 and GCS
implement it with ``If-None-Match``/``If-Match`` / generation preconditions). The writer
thread refreshes the heartbeat with another conditional write ("only if it is still my
generation") and removes the claim when the Recorder closes.

A second Recorder on a live store is refused with a :class:`StoreError` naming the live
writer. A writer that died (SIGKILL, machine lost) does not lock the store forever: its
claim is **stale** when its heartbeat is older than ``stale_after`` seconds, or at once
when it was made on this host by a process that no longer runs; the next Recorder takes
it over (a conditional write on the generation it read, so of two racing take-overs one
wins) and resumes the store.

What this guarantees: while a writer's heartbeat is fresh, no other Recorder writes the
store; a writer that loses its claim (the store was removed or renamed, or another writer
took it over after it stopped heartbeating) notices at its next heartbeat or commit and
stops capture with a loud error instead of writing into a store it no longer owns.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

import tensorstore as ts

from traintape.core.errors import StoreError

CLAIM_KEY = ".traintape/writer.json"
STALE_AFTER = 30.0
"""Seconds without a heartbeat after which a claim is stale (default)."""


@dataclass(frozen=True)
class ClaimInfo:
    """Who holds a store."""

    session: str
    host: str
    pid: int
    started_at: str
    heartbeat: float
    """Unix time of the last refresh."""

    def describe(self, now: float | None = None) -> str:
        age = (now if now is not None else time.time()) - self.heartbeat
        return (
            f"host {self.host}, pid {self.pid}, since {self.started_at}, last heartbeat "
            f"{age:.0f} s ago"
        )


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" not in line.split(":", 1)[1]
    except OSError:
        pass
    return True


class WriterClaim:
    """The claim of one Recorder on one store (see the module docstring)."""

    def __init__(self, kv: ts.KvStore, url: str, *, stale_after: float = STALE_AFTER) -> None:
        if stale_after <= 0:
            raise ValueError(f"stale_after must be > 0 seconds, got {stale_after}")
        self.kv = kv
        self.url = url
        self.stale_after = stale_after
        self.info = ClaimInfo(
            session=uuid.uuid4().hex,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=datetime.now(UTC).isoformat(timespec="seconds"),
            heartbeat=time.time(),
        )
        self._generation: bytes | None = None
        self.took_over: ClaimInfo | None = None
        """The stale claim this one replaced, if any."""

    @property
    def held(self) -> bool:
        return self._generation is not None

    def _read(self) -> tuple[ClaimInfo | None, bytes]:
        r = self.kv.read(CLAIM_KEY).result()
        if r.state == "missing":
            return None, r.stamp.generation
        try:
            doc: Any = json.loads(bytes(r.value))
            info = ClaimInfo(**{k: doc[k] for k in ClaimInfo.__dataclass_fields__})
        except Exception:  # unreadable claim (torn by a crash): treat as stale
            info = ClaimInfo("?", "?", -1, "?", 0.0)
        return info, r.stamp.generation

    def _write(self, if_equal: bytes) -> bool:
        info = self.info
        data = json.dumps(asdict(info), sort_keys=True).encode()
        gen = self.kv.write(CLAIM_KEY, data, if_equal=if_equal).result().generation
        if gen == b"":
            return False
        self._generation = gen
        return True

    def is_stale(self, other: ClaimInfo, now: float | None = None) -> bool:
        now = now if now is not None else time.time()
        if other.host == self.info.host and other.pid == self.info.pid:
            return False  # this process holds it (another Recorder in it)
        if other.host == self.info.host and other.pid > 0 and not pid_alive(other.pid):
            return True
        return now - other.heartbeat > self.stale_after

    def acquire(self) -> None:
        """Claim the store, or raise :class:`StoreError` naming the live writer."""
        other, gen = self._read()
        if other is not None:
            if not self.is_stale(other):
                raise StoreError(
                    f"{self.url} is being written by another Recorder ({other.describe()}); "
                    f"one writer per store: close it first, or record to another path "
                    f"(a claim is stale after {self.stale_after:.0f} s without a heartbeat)"
                )
            self.took_over = other
        self.info = ClaimInfo(**{**asdict(self.info), "heartbeat": time.time()})
        if not self._write(gen):
            now_other, _ = self._read()
            who = now_other.describe() if now_other is not None else "another writer"
            raise StoreError(f"{self.url}: another Recorder claimed the store first ({who})")

    def refresh(self) -> None:
        """Renew the heartbeat (writer thread). Raises :class:`StoreError` when the claim
        is gone (store removed or renamed) or another writer took it over."""
        if self._generation is None:
            return
        self.info = ClaimInfo(**{**asdict(self.info), "heartbeat": time.time()})
        if not self._write(self._generation):
            self._lost(self._read()[0])

    def _lost(self, other: ClaimInfo | None) -> NoReturn:
        """Raise that the claim is gone (``other``: who holds it now, if anyone)."""
        self._generation = None
        if other is None:
            raise StoreError(
                f"{self.url}: the store was removed or moved while this Recorder wrote "
                f"it (its writer claim {CLAIM_KEY} is gone)"
            )
        raise StoreError(f"{self.url}: another Recorder took the store over ({other.describe()})")

    def verify(self) -> None:
        """Check (one read, nothing written) that this Recorder still holds the claim;
        raises :class:`StoreError` like :meth:`refresh` when it does not. The fence
        before a commit when the heartbeat is recent."""
        if self._generation is None:
            return
        other, gen = self._read()
        if gen != self._generation:
            self._lost(other)

    def release(self) -> None:
        """Remove the claim if this Recorder still holds it (best effort)."""
        if self._generation is None:
            return
        with contextlib.suppress(Exception):  # best effort: a stale claim expires anyway
            self.kv.write(CLAIM_KEY, None, if_equal=self._generation).result()
        self._generation = None
        if self.url.startswith("file://"):  # the file driver leaves the empty directory,
            with contextlib.suppress(OSError):  # which zarr-python would warn about
                os.rmdir(os.path.join(self.url[len("file://") :], CLAIM_KEY.split("/")[0]))
