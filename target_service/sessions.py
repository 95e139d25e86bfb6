"""The worker's target sessions: KV caches under a budget, evicted least recently used.

Budget: at most `max_sessions` sessions and `max_cached_tokens` committed tokens summed
over them. A call that grows a session reserves its growth first (prompt length, k + 1
for a proposal, ...); when a new session or a reservation would pass the budget, the
least recently used other sessions are evicted: released and forgotten. Their owner
gets NOT_FOUND on the next call and re-prefills from the committed tokens it keeps.

Locks, always taken in this order, never the other way:
1. `SessionCache._lock` guards the table and the accounting; held only for bookkeeping,
   never while waiting for another lock.
2. One lock per session: concurrent calls on one session are serialized (a TargetSession
   is not thread-safe). Releasing an evicted session waits for its lock, so a session is
   never released under a forward pass. A caller waits for victims' locks while holding
   no session lock, except `open`, whose victims are all older than its new session:
   such waits cannot form a cycle.
3. The model's `StepScheduler` (model_runtime/step_scheduler.py): every forward pass runs
   on its thread, the work of every session that has some batched into one pass per
   step. A caller holds its session's lock while its work waits for and runs in a
   step, so a session has at most one job in the scheduler.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace

from foundation.errors import InvalidArgument, NotFound, ResourceExhausted
from model_runtime.loading import LoadedModel
from model_runtime.step_scheduler import StepLoad, StepScheduler
from service_common.status import AlreadyExists
from speculative.sampling import SamplingParams
from speculative.target import TargetSession, check_prompt

log = logging.getLogger(__name__)

# Ids of recently evicted sessions, remembered only to say "evicted" in NOT_FOUND.
REMEMBERED_EVICTIONS = 4096


@dataclass
class _Entry:
    session_id: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    target: TargetSession | None = None  # None while the prompt is being prefilled
    length: int = 0  # committed tokens as of the last finished call, in tokens
    reserved: int = 0  # growth reserved by calls in flight, in tokens
    gone: bool = False  # evicted or closed: forgotten by the table
    stop: threading.Event | None = None  # set to stop the holder's long work (close, eviction)


@dataclass(frozen=True)
class CacheLoad:
    active_sessions: int
    cached_tokens: int  # committed tokens summed over sessions (what the budget counts)


class SessionCache:
    """Thread-safe table of TargetSessions keyed by session id, with LRU eviction."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int,
        max_cached_tokens: int,
        compute: StepScheduler | None = None,
    ):
        if max_sessions < 1 or max_cached_tokens < 1:
            raise InvalidArgument(
                f"max_sessions and max_cached_tokens must be >= 1, got {max_sessions} and {max_cached_tokens}"
            )
        self.loaded = loaded
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens
        self.compute = compute or StepScheduler(loaded.model)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def open(
        self,
        session_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        resumes: bool = False,
    ) -> tuple[int, StepLoad | None]:
        """Creates and prefills a session (in the scheduler's steps); returns the
        prefill's wall time in nanoseconds and its steps' load. resumes: the prompt
        resumes a stream a client is reading (StepScheduler.submit)."""
        check_prompt(prompt_token_ids, self.loaded.vocab_size, self.loaded.context_length)
        growth = len(prompt_token_ids)
        entry, victims = self._insert(session_id, growth)  # entry comes locked
        try:
            self._release(victims)
            start = time.perf_counter_ns()
            target = TargetSession(self.loaded, prompt_token_ids, params, prefill=False)
            _, load = self.compute.submit(target.prefill_steps(), resumes=resumes)
            target.prefill_ns = time.perf_counter_ns() - start
            entry.target = target
            return target.prefill_ns, load
        except BaseException:
            self._forget(entry)
            raise
        finally:
            entry.lock.release()
            self._settle(entry, growth)

    @contextlib.contextmanager
    def use(
        self, session_id: str, growth: int = 0, stop: threading.Event | None = None
    ) -> Iterator[TargetSession]:
        """The session, locked for the caller, with room reserved for `growth` more
        tokens. Submit its forward passes to `compute`. stop (for work that holds the
        session long, a run of decoded tokens): then `growth` is reserved as far as the
        budget holds it, at least one token, and `stop` is set when the session is
        closed or evicted meanwhile, for the work to end within a step (closing and
        evicting wait for it)."""
        entry, victims, growth = self._reserve(session_id, growth, up_to=stop is not None)
        try:
            self._release(victims)
            with entry.lock:
                entry.stop = stop  # before the check: a close from now on sets it
                try:
                    if entry.gone or entry.target is None:  # evicted or closed meanwhile
                        with self._lock:
                            error = self._not_found(session_id)
                        raise error
                    yield entry.target
                finally:
                    entry.stop = None
        finally:
            self._settle(entry, growth)

    def close(self, session_id: str) -> bool:
        """Releases and forgets a session; False when there was none."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return False
            self._forget_locked(entry)
            self._evicted.pop(session_id, None)
        self._release([entry])
        return True

    def load(self) -> CacheLoad:
        with self._lock:
            return CacheLoad(len(self._entries), sum(e.length for e in self._entries.values()))

    # Bookkeeping: the methods below take self._lock, or expect it held (_locked, and
    # those called from them).

    def _insert(self, session_id: str, growth: int) -> tuple[_Entry, list[_Entry]]:
        self._check_fits(session_id, growth)
        with self._lock:
            if session_id in self._entries:
                raise AlreadyExists(
                    f"target session {session_id!r} already exists: close it or pick another id"
                )
            entry = _Entry(session_id, reserved=growth)
            entry.lock.acquire()  # nobody uses the session before its prefill is done
            self._entries[session_id] = entry
            self._evicted.pop(session_id, None)
            return entry, self._evict_for(entry)

    def _reserve(
        self, session_id: str, growth: int, up_to: bool = False
    ) -> tuple[_Entry, list[_Entry], int]:
        """Reserves growth (up_to: as much of it as the budget holds, at least 1); returns
        the entry, the victims to release and the growth reserved."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                raise self._not_found(session_id)
            if up_to:
                growth = max(1, min(growth, self.max_cached_tokens - entry.length - entry.reserved))
            self._check_fits(session_id, entry.length + entry.reserved + growth)
            self._entries.move_to_end(session_id)
            entry.reserved += growth
            return entry, self._evict_for(entry), growth

    def _check_fits(self, session_id: str, num_tokens: int) -> None:
        if num_tokens > self.max_cached_tokens:
            raise ResourceExhausted(
                f"target session {session_id!r} would hold {num_tokens} tokens, more than the "
                f"worker's whole KV cache budget of {self.max_cached_tokens} tokens"
            )

    def _evict_for(self, keep: _Entry) -> list[_Entry]:
        """Forgets least recently used sessions other than `keep` until within budget."""
        total = sum(e.length + e.reserved for e in self._entries.values())
        victims = []
        for entry in list(self._entries.values()):
            too_many = len(self._entries) > self.max_sessions
            if not too_many and total <= self.max_cached_tokens:
                break
            if entry is keep:
                continue
            total -= entry.length + entry.reserved
            self._forget_locked(entry)
            self._evicted[entry.session_id] = None
            while len(self._evicted) > REMEMBERED_EVICTIONS:
                self._evicted.popitem(last=False)
            victims.append(entry)
            fields = {
                "session_id": entry.session_id,
                "committed_len": entry.length,
                "reason": "max_sessions" if too_many else "max_cached_tokens",
            }
            log.info("evicted session", extra={"fields": fields})
            # On the span of the call that needed the room (a no-op when not tracing).
            trace.get_current_span().add_event(
                "specdec.evicted", {f"specdec.{k}": v for k, v in fields.items()}
            )
        return victims

    def _forget_locked(self, entry: _Entry) -> None:
        entry.gone = True
        self._entries.pop(entry.session_id, None)

    def _forget(self, entry: _Entry) -> None:
        with self._lock:
            self._forget_locked(entry)

    def _settle(self, entry: _Entry, growth: int) -> None:
        """After a call: the reservation becomes the session's actual length."""
        with self._lock:
            entry.reserved -= growth
            if entry.target is not None:
                entry.length = entry.target.length

    def _not_found(self, session_id: str) -> NotFound:
        if session_id in self._evicted:
            return NotFound(
                f"target session {session_id!r} was evicted (least recently used, to keep the "
                "worker within its KV cache budget): open it again from the committed tokens"
            )
        return NotFound(
            f"target session {session_id!r} not found (evicted or never opened): open it "
            "again from the committed tokens"
        )

    # Outside self._lock.

    @staticmethod
    def _release(entries: list[_Entry]) -> None:
        for entry in entries:
            stop = entry.stop  # read after the entry was forgotten: see `use`
            if stop is not None:
                stop.set()
            with entry.lock:  # waits for a call in flight on it to finish
                if entry.target is not None:
                    entry.target.release()
