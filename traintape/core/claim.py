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
writer. A writer that died (SIGKILL, machine lost, container restarted) does not lock the
store forever. Staleness is judged by **heartbeats observed to stop**, never by comparing
clocks across hosts: a claim is taken over when the next Recorder has watched it stay
unchanged (same kvstore generation) for a full stale interval — ``max`` of its own
``stale_after`` and the holder's — measured on its own monotonic clock; a claim that
changes while it watches is a live writer (refused). Only a holder that is *provably*
gone is taken over at once: one on this machine (same kernel boot id and PID namespace)
whose PID no longer runs or now belongs to a process started at another time (the
holder's identity is boot id + PID namespace + PID + process start time, which a
restart always changes — a restarted container has a new PID namespace, a reused PID a
new start time). A holder that is *provably* alive — a process of this machine and PID
namespace running with the claimed start time, or a Recorder of this very process that
still holds the claim — is refused at once; any other holder (another host, another
container) is refused as soon as its heartbeat is seen to change, at most a third of
its stale interval later. The take-over is a conditional write on the generation
read, so of two racing take-overs one wins.

What this guarantees: while a writer heartbeats, no other Recorder writes the store,
whatever the hosts' clocks say; a writer that loses its claim (the store was removed or
renamed, or another writer took it over after it stopped heartbeating) notices at its
next heartbeat or commit and stops capture with a loud error instead of writing into a
store it no longer owns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
import weakref
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
    """Unix time of the last refresh (informative: staleness is observed, not computed)."""
    boot_id: str = ""
    """The kernel boot id of the holder's machine ('' where unknown)."""
    pid_ns: str = ""
    """The holder's PID namespace (``/proc/self/ns/pid``; '' where unknown)."""
    start_ticks: int = -1
    """The holder process's start time (clock ticks since boot; -1 where unknown)."""
    stale_after: float = 0.0
    """The holder's stale interval (it heartbeats every third of it)."""

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


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def boot_id() -> str:
    """This machine's kernel boot id ('' where unknown: not Linux)."""
    return _read_text("/proc/sys/kernel/random/boot_id")


def pid_namespace() -> str:
    """This process's PID namespace ('' where unknown)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def start_ticks(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field
    22), or -1 when it does not run or it cannot be told."""
    text = _read_text(f"/proc/{pid}/stat")
    try:
        return int(text.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return -1


def _identity() -> dict[str, Any]:
    return {
        "boot_id": boot_id(),
        "pid_ns": pid_namespace(),
        "start_ticks": start_ticks(os.getpid()),
    }


_HELD: weakref.WeakValueDictionary[str, WriterClaim] = weakref.WeakValueDictionary()
"""Claims this process holds now, by session."""

_REQUIRED = ("session", "host", "pid", "started_at", "heartbeat")
"""Fields every claim has (the others came later: a claim of an older build lacks them)."""

OBSERVE_PAUSE = 0.25
"""Seconds between reads of a claim being watched (at most; a shorter stale interval
reads it 20 times)."""


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
            stale_after=stale_after,
            **_identity(),
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
            info = ClaimInfo(
                **{k: doc[k] for k in ClaimInfo.__dataclass_fields__ if k in doc or k in _REQUIRED}
            )
        except Exception:  # unreadable claim: no holder is named (watched like any other)
            info = ClaimInfo("?", "?", -1, "?", 0.0)
        return info, r.stamp.generation

    def _write(self, if_equal: bytes) -> bool:
        info = self.info
        data = json.dumps(asdict(info), sort_keys=True).encode()
        _HELD[info.session] = self  # first: a reader of the claim must find it held
        try:
            gen = self.kv.write(CLAIM_KEY, data, if_equal=if_equal).result().generation
        except BaseException:
            if self._generation is None:
                _HELD.pop(info.session, None)
            raise
        if gen == b"":
            if self._generation is None:
                _HELD.pop(info.session, None)
            return False
        self._generation = gen
        return True

    def provably_gone(self, other: ClaimInfo) -> bool:
        """Whether the holder of ``other`` certainly no longer runs: it ran on this
        machine since its last boot, in this PID namespace (so its PID means the same
        here), and that PID is free or now names a process started at another time."""
        me = self.info
        if not (me.boot_id and me.pid_ns and other.boot_id == me.boot_id):
            return False
        if other.pid_ns != me.pid_ns or other.pid <= 0 or other.start_ticks < 0:
            return False
        if other.session == me.session:
            return False
        if not pid_alive(other.pid):
            return True
        return start_ticks(other.pid) != other.start_ticks

    def provably_alive(self, other: ClaimInfo) -> bool:
        """Whether the holder of ``other`` certainly still holds it: a process of this
        machine and PID namespace that runs with the same start time — another process,
        or this one while a Recorder in it holds that claim (a claim of this process that
        no live Recorder holds, e.g. one whose release failed, is watched like any)."""
        me = self.info
        if not (me.boot_id and me.pid_ns and other.boot_id == me.boot_id):
            return False
        if other.pid_ns != me.pid_ns or other.pid <= 0 or other.start_ticks < 0:
            return False
        if other.pid == me.pid and other.start_ticks == me.start_ticks:
            return other.session in _HELD
        return pid_alive(other.pid) and start_ticks(other.pid) == other.start_ticks

    def looks_live(self, other: ClaimInfo, now: float | None = None) -> bool:
        """A read-only guess for listings (``traintape ls``), never used to take a claim:
        provably alive or gone where this process can tell, else whether the holder's
        last heartbeat is younger than its stale interval by this host's clock (clocks
        of two hosts may disagree: :meth:`acquire` watches instead of comparing)."""
        if self.provably_alive(other):
            return True
        if self.provably_gone(other):
            return False
        age = (now if now is not None else time.time()) - other.heartbeat
        return age < (other.stale_after or self.stale_after)

    def _refuse(self, other: ClaimInfo, why: str = "") -> NoReturn:
        raise StoreError(
            f"{self.url} is being written by another Recorder ({other.describe()}){why}; "
            f"one writer per store: close it first, or record to another path (a claim "
            f"is taken over once its heartbeat has stopped for "
            f"{max(self.stale_after, other.stale_after):.0f} s)"
        )

    def _watch(self, other: ClaimInfo, gen: bytes) -> tuple[ClaimInfo | None, bytes]:
        """Watch the claim for a full stale interval (this host's monotonic clock):
        return it (and its generation) if it never changed — its writer stopped — or
        ``(None, generation)`` if it was removed; refuse if it changed (a live writer,
        whatever its clock says)."""
        wait = max(self.stale_after, other.stale_after)
        logging.getLogger("traintape").warning(
            "traintape: %s is claimed by a writer that cannot be checked from here (%s); "
            "watching its heartbeat for %.0f s before taking it over",
            self.url, other.describe(), wait,
        )  # fmt: skip
        deadline = time.monotonic() + wait
        pause = min(OBSERVE_PAUSE, wait / 20)
        while True:
            now_other, now_gen = self._read()
            if now_other is None:
                return None, now_gen
            if now_gen != gen:
                self._refuse(now_other, ": its heartbeat was renewed while this one waited")
            if time.monotonic() >= deadline:
                return other, gen
            time.sleep(pause)

    def acquire(self) -> None:
        """Claim the store, or raise :class:`StoreError` naming the live writer. A claim
        that is neither provably alive nor provably gone is watched for a full stale
        interval first (see the module docstring)."""
        other, gen = self._read()
        if other is not None and not self.provably_gone(other):
            if self.provably_alive(other):
                self._refuse(other)
            other, gen = self._watch(other, gen)
        if other is not None:
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
        _HELD.pop(self.info.session, None)
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
        _HELD.pop(self.info.session, None)
        if self.url.startswith("file://"):  # the file driver leaves the empty directory,
            with contextlib.suppress(OSError):  # which zarr-python would warn about
                os.rmdir(os.path.join(self.url[len("file://") :], CLAIM_KEY.split("/")[0]))
