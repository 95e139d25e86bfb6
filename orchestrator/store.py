"""Session state: committed tokens and the KV-cache handle on each worker.

`SessionStore` is the interface; `InMemorySessionStore` serves a single orchestrator
process, `orchestrator.redis_store.RedisSessionStore` any number of replicas. A call
that advances a session holds its lease; saving under a lease that was lost fails, so
two replicas never advance one session twice.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import copy
import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass, field

from foundation.errors import NotFound
from service_common.status import SessionBusy


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class WorkerHandle:
    """Which worker holds a session's cache, and how many tokens it has committed."""

    worker_id: str
    address: str  # host:port
    session_id: str  # the worker's own id for the session
    committed_len: int  # tokens
    drafter: str = ""  # a draft session's drafter as requested ("" = the worker's default)


@dataclass
class SessionRecord:
    session_id: str
    token_ids: list[int]  # committed tokens: prompts and generated, in order
    target: WorkerHandle | None = None
    draft: WorkerHandle | None = None
    messages: list[dict] = field(default_factory=list)  # chat history, when used with chat
    sampling: bytes = b""  # serialized SamplingParams defaults of the session
    speculation: bytes = b""  # serialized SpeculationParams defaults of the session
    created_ms: int = field(default_factory=now_ms)
    # The name of the API key that created the session: only it may use the session
    # ("" without API keys). Records saved before owners existed read as "".
    owner: str = ""
    last_used_ms: int = field(default_factory=now_ms)

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        for name in ("sampling", "speculation"):
            fields[name] = base64.b64encode(fields[name]).decode()
        return fields

    @classmethod
    def from_json(cls, fields: dict) -> SessionRecord:
        fields = dict(fields)
        for name in ("sampling", "speculation"):
            fields[name] = base64.b64decode(fields[name])
        for name in ("target", "draft"):
            fields[name] = WorkerHandle(**fields[name]) if fields[name] else None
        return cls(**fields)


@dataclass
class Lease:
    """Exclusive use of one session by one call; `lost` once another may hold it."""

    session_id: str
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    lost: bool = False


class SessionStore(abc.ABC):
    @abc.abstractmethod
    def put(self, record: SessionRecord, lease: Lease | None = None) -> None:
        """Saves the record; with a lease, only while the lease is held (else SessionBusy).
        A record without a lease is a new session nobody else knows yet."""

    @abc.abstractmethod
    def get(self, session_id: str) -> SessionRecord:
        """A copy of the record; raises NotFound."""

    @abc.abstractmethod
    def delete(self, session_id: str, lease: Lease) -> None: ...

    @abc.abstractmethod
    def lease(self, session_id: str):
        """Context manager yielding a Lease: exclusive use of a session for one call, or
        SessionBusy."""

    @abc.abstractmethod
    def count_owned(self, owner: str) -> int:
        """Sessions of owner that have not expired."""

    def get_owned(self, session_id: str, owner: str) -> SessionRecord:
        """The record, when owner's; another owner's session is NotFound with the very
        words of a missing one, so that its existence is not revealed."""
        record = self.get(session_id)
        if record.owner != owner:
            raise not_found(session_id)
        return record

    def close(self) -> None:
        """Stops background work (lease renewal)."""


def not_found(session_id: str) -> NotFound:
    return NotFound(f"session {session_id!r} not found (closed, expired or never created)")


def busy(session_id: str) -> SessionBusy:
    return SessionBusy(
        f"session {session_id!r} is busy with another Generate or CloseSession call; retry when it ends"
    )


class InMemorySessionStore(SessionStore):
    """For a single orchestrator process; idle sessions expire after ttl_s."""

    def __init__(self, ttl_s: float):
        self._ttl_ms = ttl_s * 1000
        self._records: dict[str, SessionRecord] = {}
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def put(self, record: SessionRecord, lease: Lease | None = None) -> None:
        with self._lock:
            if lease is not None and self._leases.get(record.session_id) is not lease:
                raise busy(record.session_id)
            self._records[record.session_id] = copy.deepcopy(record)

    def get(self, session_id: str) -> SessionRecord:
        with self._lock:
            self._expire()
            record = self._records.get(session_id)
            if record is None:
                raise not_found(session_id)
            return copy.deepcopy(record)

    def delete(self, session_id: str, lease: Lease) -> None:
        with self._lock:
            self._records.pop(session_id, None)

    @contextlib.contextmanager
    def lease(self, session_id: str):
        lease = Lease(session_id)
        with self._lock:
            if session_id in self._leases:
                raise busy(session_id)
            self._leases[session_id] = lease
        try:
            yield lease
        finally:
            with self._lock:
                self._leases.pop(session_id, None)

    def count_owned(self, owner: str) -> int:
        with self._lock:
            self._expire()
            return sum(1 for record in self._records.values() if record.owner == owner)

    def _expire(self) -> None:
        now = now_ms()
        expired = [
            r
            for r in self._records.values()
            if now - r.last_used_ms > self._ttl_ms and r.session_id not in self._leases
        ]
        for record in expired:
            del self._records[record.session_id]
