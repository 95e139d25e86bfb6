"""The draft sessions a worker holds: an LRU cache under a session and a token budget,
with one lock per session so that a session has one user at a time.

A Speculate call holds its session's lock for all its rounds; a Truncate sent right
after cancelling one waits for the round in flight, then finds a consistent session.
An evicted session is gone: its owner opens it again from the committed tokens.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from foundation.errors import NotFound, ResourceExhausted, SpeculativeError
from service_common.status import AlreadyExists
from speculative.drafter_base import DraftSession
from speculative.policy import AdaptiveK

log = logging.getLogger(__name__)


class SessionBusy(SpeculativeError):
    """Another call held the session for longer than this call could wait (ABORTED)."""


@dataclass(eq=False)
class SessionEntry:
    session_id: str
    drafter: str  # name of the session's drafter: "model", "ngram" or "ngram+model"
    draft: DraftSession
    next_round: int = 0  # Proposal.round of the session's next round (0-based per session)
    # The last adaptive call's policy: the next call (the next turn) goes on with what it measured.
    policy: AdaptiveK | None = None
    closed: bool = False  # evicted or closed: whoever still holds the entry must not use it
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def length(self) -> int:
        """Committed tokens, in tokens (no call holds unverified drafts between rounds)."""
        return self.draft.length


def not_found(session_id: str) -> NotFound:
    return NotFound(
        f"draft session {session_id!r} not found: evicted or never opened: open it again"
    )


class SessionCache:
    """Thread-safe; least recently used first. A session in use is never evicted."""

    def __init__(self, max_sessions: int, max_cached_tokens: int):
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens  # in tokens
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        self._lock = threading.Lock()  # guards _entries; never held while waiting for a session

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        """Tokens held over all sessions."""
        with self._lock:
            return sum(entry.length for entry in self._entries.values())

    def check_new(self, session_id: str) -> None:
        with self._lock:
            if session_id in self._entries:
                raise AlreadyExists(
                    f"draft session {session_id!r} already exists: choose another id or none"
                )

    def make_room(self, num_tokens: int, keep: SessionEntry | None = None) -> None:
        """Evicts idle sessions, least recently used first, until one more session (or,
        with `keep`, `num_tokens` more tokens for it) fits; ResourceExhausted if not."""
        if num_tokens > self.max_cached_tokens:
            raise ResourceExhausted(
                f"{num_tokens} tokens exceed the draft worker's budget of {self.max_cached_tokens} tokens"
            )
        with self._lock:
            new_sessions = 0 if keep is not None else 1
            for entry in list(self._entries.values()):
                if self._fits(num_tokens, new_sessions):
                    return
                if entry is not keep and entry.lock.acquire(blocking=False):
                    try:
                        self._evict(entry)
                    finally:
                        entry.lock.release()
            if not self._fits(num_tokens, new_sessions):
                raise ResourceExhausted(
                    f"draft worker is full: {len(self._entries)} sessions in use hold "
                    f"{sum(e.length for e in self._entries.values())} tokens (limits "
                    f"{self.max_sessions} sessions, {self.max_cached_tokens} tokens); retry later "
                    "or on another worker"
                )

    def _fits(self, num_tokens: int, new_sessions: int) -> bool:
        tokens = sum(entry.length for entry in self._entries.values())
        return (
            len(self._entries) + new_sessions <= self.max_sessions
            and tokens + num_tokens <= self.max_cached_tokens
        )

    def _evict(self, entry: SessionEntry) -> None:
        del self._entries[entry.session_id]
        entry.closed = True
        entry.draft.release()
        log.info(
            "evicted draft session",
            extra={"fields": {"session_id": entry.session_id, "tokens": entry.length}},
        )

    def add(self, entry: SessionEntry) -> None:
        with self._lock:
            if entry.session_id in self._entries:
                entry.draft.release()
                raise AlreadyExists(
                    f"draft session {entry.session_id!r} already exists: choose another id or none"
                )
            self._entries[entry.session_id] = entry

    @contextlib.contextmanager
    def locked(self, session_id: str, wait_s: float) -> Iterator[SessionEntry]:
        """The session, held for the block: waits up to wait_s seconds for another call
        to let go of it (SessionBusy), NotFound if it does not exist (or was evicted)."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                raise not_found(session_id)
            self._entries.move_to_end(session_id)
        if not entry.lock.acquire(timeout=max(wait_s, 0.0)):
            raise SessionBusy(
                f"draft session {session_id!r} is busy with another call (e.g. a Speculate "
                f"stream) for more than {wait_s:.1f} s; cancel that call first"
            )
        try:
            if entry.closed:
                raise not_found(session_id)
            yield entry
        finally:
            entry.lock.release()

    def close(self, session_id: str, wait_s: float) -> None:
        """Frees a session once no call uses it; an unknown id is not an error."""
        try:
            with self.locked(session_id, wait_s) as entry:
                with self._lock:
                    self._entries.pop(session_id, None)
                entry.closed = True
                entry.draft.release()
        except NotFound:
            pass

    def close_all(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            entry.closed = True
            entry.draft.release()
