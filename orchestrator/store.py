"""Session state: committed tokens and the KV-cache handle on each worker.

The store is an interface so that any orchestrator replica can serve any session
(Redis, in its own issue) while a single-process run keeps state in memory.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import threading
import time
from dataclasses import dataclass, field

from speculative.errors import NotFound, SpeculativeError


class SessionBusy(SpeculativeError):
    """Another call is generating on the session (FAILED_PRECONDITION)."""


@dataclass
class WorkerHandle:
    """Which worker holds a session's cache, and how many tokens it has committed."""

    worker_id: str
    address: str  # host:port
    session_id: str  # the worker's own id for the session
    committed_len: int  # tokens


@dataclass
class SessionRecord:
    session_id: str
    token_ids: list[int]  # committed tokens: prompts and generated, in order
    target: WorkerHandle | None = None
    draft: WorkerHandle | None = None
    messages: list[dict] = field(default_factory=list)  # chat history, when used with chat
    sampling: bytes = b""  # serialized SamplingParams defaults of the session
    speculation: bytes = b""  # serialized SpeculationParams defaults of the session
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    last_used_ms: int = field(default_factory=lambda: int(time.time() * 1000))


class SessionStore(abc.ABC):
    @abc.abstractmethod
    def put(self, record: SessionRecord) -> None: ...

    @abc.abstractmethod
    def get(self, session_id: str) -> SessionRecord:
        """A copy of the record; raises NotFound."""

    @abc.abstractmethod
    def delete(self, session_id: str) -> None: ...

    @abc.abstractmethod
    def lease(self, session_id: str):
        """Context manager: exclusive use of a session for one call, or SessionBusy."""


class InMemorySessionStore(SessionStore):
    """For a single orchestrator process; idle sessions expire after ttl_s."""

    def __init__(self, ttl_s: float):
        self._ttl_ms = ttl_s * 1000
        self._records: dict[str, SessionRecord] = {}
        self._leased: set[str] = set()
        self._lock = threading.Lock()

    def put(self, record: SessionRecord) -> None:
        with self._lock:
            self._records[record.session_id] = copy.deepcopy(record)

    def get(self, session_id: str) -> SessionRecord:
        with self._lock:
            self._expire()
            record = self._records.get(session_id)
            if record is None:
                raise NotFound(f"session {session_id!r} not found (closed, expired or never created)")
            return copy.deepcopy(record)

    def delete(self, session_id: str) -> None:
        with self._lock:
            self._records.pop(session_id, None)

    @contextlib.contextmanager
    def lease(self, session_id: str):
        with self._lock:
            if session_id in self._leased:
                raise SessionBusy(f"session {session_id!r} is busy with another Generate call")
            self._leased.add(session_id)
        try:
            yield
        finally:
            with self._lock:
                self._leased.discard(session_id)

    def _expire(self) -> None:
        now = time.time() * 1000
        expired = [r for r in self._records.values() if now - r.last_used_ms > self._ttl_ms and r.session_id not in self._leased]
        for record in expired:
            del self._records[record.session_id]
