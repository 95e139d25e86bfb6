"""Admission control: at most `max_running` calls do model work at once; up to
`max_queued` more wait for a slot, oldest first, for as long as their own deadline
allows; past that a call is refused at once with RESOURCE_EXHAUSTED naming the limit.

A slot is held for a whole call (an OpenSession or Extend prefill, a Verify stream, a
Decode stream): the calls admitted are the sessions that share the batched steps, so
`max_running` bounds the batch and so each running session's time per step. Refusing
at once, rather than timing out after minutes, lets the orchestrator place the session
on another worker or tell its client to back off.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from foundation.errors import InvalidArgument, ResourceExhausted


@dataclass(frozen=True)
class AdmissionLoad:
    running: int
    queued: int


class Admission:
    def __init__(self, max_running: int, max_queued: int):
        if max_running < 1 or max_queued < 0:
            raise InvalidArgument(
                f"max_running must be >= 1 and max_queued >= 0, got {max_running} and {max_queued}"
            )
        self.max_running = max_running
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self._running = 0
        self._waiting: collections.deque[threading.Event] = collections.deque()  # oldest first

    def acquire(self, timeout_s: float | None) -> int:
        """Takes a slot; returns how long the call waited for it, in nanoseconds.
        RESOURCE_EXHAUSTED when the queue is full, or when the call's time (timeout_s,
        None = no limit) ran out while it waited."""
        start = time.perf_counter_ns()
        with self._lock:
            if self._running < self.max_running and not self._waiting:
                self._running += 1
                return 0
            if len(self._waiting) >= self.max_queued:
                raise ResourceExhausted(
                    f"target worker is full: {self._running} calls running (max_running="
                    f"{self.max_running}) and {len(self._waiting)} queued (max_queued="
                    f"{self.max_queued}); retry later or on another worker"
                )
            turn = threading.Event()
            self._waiting.append(turn)
        if not turn.wait(timeout_s):
            with self._lock:
                if not turn.is_set():  # still queued: leave the queue
                    self._waiting.remove(turn)
                    raise ResourceExhausted(
                        f"target worker is full: waited {timeout_s:.1f} s for one of its "
                        f"{self.max_running} running slots (max_running) within the call's deadline"
                    )
        return time.perf_counter_ns() - start  # the slot was handed over by release()

    def release(self) -> None:
        """Frees a slot, handing it straight to the oldest waiting call."""
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()  # the slot passes on: running stays the same
            else:
                self._running -= 1

    def load(self) -> AdmissionLoad:
        with self._lock:
            return AdmissionLoad(self._running, len(self._waiting))
