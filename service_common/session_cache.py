"""The sessions a worker holds (draft or target): an LRU cache under a budget, one lock
per session so that a session has one call at a time.

Budget: at most `max_sessions` sessions and `max_cached_tokens` tokens summed over them:
committed tokens plus the growth calls in flight reserved. When a new session or a growth
would pass it, least recently used other sessions are evicted: released and forgotten.
Their owner gets NOT_FOUND on the next call and re-prefills from the committed tokens it
keeps.

The one choice a worker makes, `evicts_in_use`:
- False (the draft worker): a session in use is never evicted, and closing it waits for
  its call (a Speculate stream holds its session for all its rounds and cannot be cut
  short). When only sessions in use are left to evict, the call needing room gets
  RESOURCE_EXHAUSTED.
- True (the target worker): any session but the caller's may be evicted, or closed, under
  a call: the call's `stop` is set (a run of decoded tokens ends within a step) and the
  session is released once the call lets go, never under a forward pass.

Locks:
1. `SessionCache._lock` guards the table and the accounting; held only for bookkeeping,
   never while waiting for another lock (a session's is only tried), so a call may take
   it while holding its session's.
2. `CachedSession.lock`, one per session. A caller waits for victims' locks while holding
   no session lock, except when adding a session (its victims are all older than it) or
   when victims were idle (evicts_in_use False): such waits cannot form a cycle.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Generic, TypeVar

from opentelemetry import trace

from foundation.errors import InvalidArgument, NotFound, ResourceExhausted
from service_common.status import AlreadyExists, SessionBusy

log = logging.getLogger(__name__)

# Ids of recently evicted sessions, remembered only to say "evicted" in NOT_FOUND.
REMEMBERED_EVICTIONS = 4096


@dataclass(eq=False)
class CachedSession:
    """A session as the cache holds it; a worker's entry type adds the session itself
    (`length`, `release`)."""

    session_id: str
    _: KW_ONLY
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by the call using it
    reserved: int = 0  # growth reserved by calls in flight, in tokens
    closed: bool = False  # evicted or closed: whoever still holds the entry must not use it
    stop: threading.Event | None = None  # its call's, set to end long work (close, eviction)

    @property
    def length(self) -> int:
        """Committed tokens, in tokens: what the budget counts besides `reserved`."""
        raise NotImplementedError

    def settle(self) -> None:
        """After each call, under the cache's lock: `length` catches up with the call (an
        entry whose `length` is not read live keeps it consistent with `reserved`)."""

    def release(self) -> None:
        """Frees the session's memory; called once, with its lock held."""
        raise NotImplementedError


Entry = TypeVar("Entry", bound=CachedSession)


@dataclass(frozen=True)
class CacheLoad:
    active_sessions: int
    cached_tokens: int  # committed tokens summed over sessions (what the budget counts)


class SessionCache(Generic[Entry]):
    """Thread-safe table of one worker's sessions keyed by id, least recently used first."""

    def __init__(
        self, kind: str, max_sessions: int, max_cached_tokens: int, *, evicts_in_use: bool
    ):
        if max_sessions < 1 or max_cached_tokens < 1:
            raise InvalidArgument(
                f"max_sessions and max_cached_tokens must be >= 1, got {max_sessions} and {max_cached_tokens}"
            )
        self.kind = kind  # whose sessions, for messages: "draft" or "target"
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens  # in tokens
        self.evicts_in_use = evicts_in_use  # see the module's docstring
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def load(self) -> CacheLoad:
        with self._lock:
            return CacheLoad(len(self._entries), sum(e.length for e in self._entries.values()))

    def check_new(self, session_id: str) -> None:
        """AlreadyExists if the id is taken: checked before a session is made."""
        with self._lock:
            self._check_new_locked(session_id)

    def make_room(self, growth: int, keep: Entry | None = None) -> None:
        """Evicts until `growth` more tokens fit: for `keep`, a session the caller holds, or
        else for one more session (then `add` it); ResourceExhausted if they cannot."""
        held = keep.length + keep.reserved if keep is not None else 0
        self._check_holds(held + growth)
        with self._lock:
            victims, fits = self._evict_for(keep, 0 if keep is not None else 1, growth)
        self._release(victims)
        if not fits:
            raise self._full()

    def add(self, entry: Entry) -> None:
        """Adds a session made outside the cache (after `make_room`); AlreadyExists, and
        the entry released, if its id is taken."""
        try:
            self._insert(entry, 0)
        except BaseException:
            entry.release()
            raise

    @contextlib.contextmanager
    def adding(self, entry: Entry, growth: int) -> Iterator[Entry]:
        """Adds a session, held by the caller for the block (its prefill: no other call
        uses it before) with `growth` tokens reserved; a failing block forgets it."""
        with entry.lock:
            self._insert(entry, growth)
            try:
                yield entry
            except BaseException:
                self._forget(entry)
                raise
            finally:
                self._settle(entry, growth)

    @contextlib.contextmanager
    def locked(
        self,
        session_id: str,
        wait_s: float | None = None,
        growth: int = 0,
        stop: threading.Event | None = None,
    ) -> Iterator[Entry]:
        """The session, held by the caller for the block, with room reserved for `growth`
        more tokens. wait_s: how long to wait for another call to let go of it, in seconds
        (SessionBusy after that; None: as long as it takes). stop (for work that holds the
        session long, a run of decoded tokens): `growth` is reserved as far as the budget
        holds it, at least one token, and `stop` is set when the session is closed or
        evicted meanwhile, for the work to end within a step. NotFound if the session does
        not exist, or was evicted or closed before the caller got it."""
        entry, growth = self._reserve(session_id, growth, up_to=stop is not None)
        try:
            if not entry.lock.acquire(timeout=-1 if wait_s is None else max(wait_s, 0.0)):
                raise SessionBusy(
                    f"{self.kind} session {session_id!r} is busy with another call (e.g. a "
                    f"stream) for more than {wait_s:.1f} s; cancel that call first"
                )
            try:
                entry.stop = stop  # before the check: a close from now on sets it
                if entry.closed:
                    with self._lock:
                        error = self._not_found(session_id)
                    raise error
                yield entry
            finally:
                entry.stop = None
                entry.lock.release()
        finally:
            self._settle(entry, growth)

    def close(self, session_id: str, wait_s: float | None = None) -> bool:
        """Releases and forgets a session; False when there was none. A session in use:
        evicts_in_use, its call is stopped and waited for; otherwise closing waits up to
        wait_s seconds for the call to end (SessionBusy)."""
        if not self.evicts_in_use:
            try:
                with self.locked(session_id, wait_s) as entry:
                    self._forget(entry)
                    entry.release()
                return True
            except NotFound:
                return False
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return False
            self._forget_locked(entry)
        self._release([entry])
        return True

    # Bookkeeping: the methods below take self._lock, or expect it held (_locked, and
    # those called from them).

    def _insert(self, entry: Entry, growth: int) -> None:
        self._check_holds(growth)
        with self._lock:
            self._check_new_locked(entry.session_id)
            entry.reserved = growth
            self._entries[entry.session_id] = entry
            self._evicted.pop(entry.session_id, None)
            victims, fits = self._evict_for(entry)
            if not fits:
                self._forget_locked(entry)
        self._release(victims)
        if not fits:
            raise self._full()

    def _reserve(self, session_id: str, growth: int, up_to: bool) -> tuple[Entry, int]:
        """Reserves growth (up_to: as much of it as the budget holds, at least 1); returns
        the entry and the growth reserved."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                raise self._not_found(session_id)
            if up_to:
                growth = max(1, min(growth, self.max_cached_tokens - entry.length - entry.reserved))
            if growth:
                self._check_holds(entry.length + entry.reserved + growth)
            self._entries.move_to_end(session_id)
            if not growth:
                return entry, 0
            entry.reserved += growth
            victims, fits = self._evict_for(entry)
            if not fits:
                entry.reserved -= growth
        self._release(victims)
        if not fits:
            raise self._full()
        return entry, growth

    def _check_new_locked(self, session_id: str) -> None:
        if session_id in self._entries:
            raise AlreadyExists(
                f"{self.kind} session {session_id!r} already exists: close it, or choose "
                "another id or none"
            )

    def _check_holds(self, num_tokens: int) -> None:
        if num_tokens > self.max_cached_tokens:
            raise ResourceExhausted(
                f"a {self.kind} session would hold {num_tokens} tokens, more than the worker's "
                f"whole budget of {self.max_cached_tokens} tokens"
            )

    def _evict_for(
        self, keep: Entry | None, new_sessions: int = 0, growth: int = 0
    ) -> tuple[list[Entry], bool]:
        """Forgets least recently used sessions other than `keep` (only idle ones unless
        evicts_in_use) until `new_sessions` more sessions and `growth` more tokens fit;
        returns them, to release outside self._lock, and whether all fits now."""
        total = growth + sum(e.length + e.reserved for e in self._entries.values())
        victims = []
        for entry in list(self._entries.values()):
            too_many = len(self._entries) + new_sessions > self.max_sessions
            if not too_many and total <= self.max_cached_tokens:
                break
            if entry is keep:
                continue
            if self.evicts_in_use:
                self._evict(entry, too_many)
            elif entry.lock.acquire(blocking=False):  # idle: closed before anyone takes it
                try:
                    self._evict(entry, too_many)
                finally:
                    entry.lock.release()
            else:
                continue
            total -= entry.length + entry.reserved
            victims.append(entry)
        too_many = len(self._entries) + new_sessions > self.max_sessions
        return victims, not too_many and total <= self.max_cached_tokens

    def _evict(self, entry: Entry, too_many: bool) -> None:
        self._forget_locked(entry)
        self._evicted[entry.session_id] = None
        while len(self._evicted) > REMEMBERED_EVICTIONS:
            self._evicted.popitem(last=False)
        fields = {
            "session_id": entry.session_id,
            "committed_len": entry.length,
            "reason": "max_sessions" if too_many else "max_cached_tokens",
        }
        log.info("evicted %s session", self.kind, extra={"fields": fields})
        # On the span of the call that needed the room (a no-op when not tracing).
        trace.get_current_span().add_event(
            "specdec.evicted", {f"specdec.{k}": v for k, v in fields.items()}
        )

    def _forget_locked(self, entry: Entry) -> None:
        entry.closed = True
        self._entries.pop(entry.session_id, None)
        self._evicted.pop(entry.session_id, None)  # closed, not evicted (unless _evict says)

    def _forget(self, entry: Entry) -> None:
        with self._lock:
            self._forget_locked(entry)

    def _settle(self, entry: Entry, growth: int) -> None:
        """After a call: the reservation becomes the session's actual length."""
        with self._lock:
            entry.reserved -= growth
            entry.settle()

    def _full(self) -> ResourceExhausted:
        with self._lock:
            tokens = sum(e.length + e.reserved for e in self._entries.values())
            return ResourceExhausted(
                f"{self.kind} worker is full: {len(self._entries)} sessions in use hold {tokens} "
                f"tokens (limits {self.max_sessions} sessions, {self.max_cached_tokens} tokens); "
                "retry later or on another worker"
            )

    def _not_found(self, session_id: str) -> NotFound:
        note = ""
        if session_id in self._evicted:
            note = " (it was evicted: least recently used when the worker needed room)"
        return NotFound(
            f"{self.kind} session {session_id!r} not found: evicted or never opened: open it "
            f"again from the committed tokens{note}"
        )

    # Outside self._lock.

    @staticmethod
    def _release(entries: list[Entry]) -> None:
        for entry in entries:
            stop = entry.stop  # read after the entry was forgotten: see `locked`
            if stop is not None:
                stop.set()
            with entry.lock:  # waits for a call in flight on it to finish
                entry.release()
