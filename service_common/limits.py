"""Bounds on the calls a server takes at once and per caller: a call past one is
refused at once with RESOURCE_EXHAUSTED naming the setting, so its client can back
off or go elsewhere instead of waiting behind work it cannot see.

Per-caller limits apply when callers are named (API keys); anonymous calls share only
the per-server bound.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from foundation.errors import InvalidArgument, ResourceExhausted


@dataclass
class TokenBucket:
    """rate_per_s tokens a second, at most burst saved up; a call takes one."""

    rate_per_s: float
    burst: float
    tokens: float
    updated_s: float

    def take(self, now_s: float) -> float:
        """0 when a token was taken, else the seconds until one will be there."""
        self.tokens = min(self.burst, self.tokens + (now_s - self.updated_s) * self.rate_per_s)
        self.updated_s = now_s
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate_per_s


class CallLimits:
    """max_calls: calls in flight on the server (0 = no bound); max_calls_per_key: in
    flight per named caller (0 = no bound); rate_per_s / burst: a token bucket per named
    caller (rate 0 = off)."""

    def __init__(
        self,
        max_calls: int = 0,
        max_calls_per_key: int = 0,
        rate_per_s: float = 0.0,
        burst: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        for name, value in (
            ("max_concurrent_calls", max_calls),
            ("max_calls_per_key", max_calls_per_key),
            ("rate_limit_per_s", rate_per_s),
        ):
            if value < 0:
                raise InvalidArgument(f"{name} must be >= 0 (0 = no limit), got {value}")
        if rate_per_s and burst < 1:
            raise InvalidArgument(f"rate_limit_burst must be >= 1, got {burst}")
        self.max_calls, self.max_calls_per_key = max_calls, max_calls_per_key
        self.rate_per_s, self.burst, self.clock = rate_per_s, burst, clock
        self._lock = threading.Lock()
        self._calls = 0
        self._per_key: collections.Counter[str] = collections.Counter()
        self._buckets: dict[str, TokenBucket] = {}

    def admit(self, caller: str) -> None:
        """Counts a call in; ResourceExhausted naming the limit it would pass. caller ""
        (anonymous) is bound by max_calls only."""
        with self._lock:
            if caller and self.rate_per_s:
                wait_s = self._bucket(caller).take(self.clock())
                if wait_s:
                    raise ResourceExhausted(
                        f"API key {caller!r} is over its rate limit of {self.rate_per_s:g} calls/s with bursts of "
                        f"{self.burst} (rate_limit_per_s, rate_limit_burst); retry in {wait_s:.2f} s"
                    )
            if self.max_calls and self._calls >= self.max_calls:
                raise ResourceExhausted(
                    f"server is at its limit of {self.max_calls} calls in flight (max_concurrent_calls); retry later"
                )
            if (
                caller
                and self.max_calls_per_key
                and self._per_key[caller] >= self.max_calls_per_key
            ):
                raise ResourceExhausted(
                    f"API key {caller!r} has {self._per_key[caller]} calls in flight, its limit "
                    f"(max_calls_per_key={self.max_calls_per_key}); wait for one to end"
                )
            self._calls += 1
            if caller:
                self._per_key[caller] += 1

    def release(self, caller: str) -> None:
        with self._lock:
            self._calls -= 1
            if caller:
                self._per_key[caller] -= 1
                if not self._per_key[caller]:
                    del self._per_key[caller]

    def in_flight(self, caller: str | None = None) -> int:
        with self._lock:
            return self._calls if caller is None else self._per_key[caller]

    def _bucket(self, caller: str) -> TokenBucket:
        bucket = self._buckets.get(caller)
        if bucket is None:
            bucket = self._buckets[caller] = TokenBucket(
                self.rate_per_s, self.burst, self.burst, self.clock()
            )
        return bucket
