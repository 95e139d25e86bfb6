"""Deadlines that follow the client: a server passes its caller's deadline on to the
calls it makes downstream, so that a call under load fails when its client gives up,
not when a fixed timeout somewhere on the way runs out."""

from __future__ import annotations

import time

# gRPC reports a call without a deadline as ~9.2e18 s remaining (grpc 1.85; older
# versions said None): anything beyond a century is no deadline.
NO_DEADLINE_S = 100 * 365 * 24 * 3600.0


def time_remaining(context) -> float | None:
    """Seconds left before the caller's deadline (>= 0); None when it set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    return max(remaining, 0.0)


def bounded(remaining_s: float | None, bound_s: float | None) -> float | None:
    """The shorter of two waits, None standing for no limit."""
    if remaining_s is None:
        return bound_s
    return remaining_s if bound_s is None else min(remaining_s, bound_s)


class Deadline:
    """A point in time (monotonic), or none: what is left of it is asked as time goes on."""

    def __init__(self, timeout_s: float | None):
        self._at = None if timeout_s is None else time.monotonic() + timeout_s

    @classmethod
    def of_caller(cls, context, default_s: float | None = None) -> Deadline:
        """The caller's deadline; default_s from now (None = none) when it set none."""
        remaining = time_remaining(context)
        return cls(default_s if remaining is None else remaining)

    def remaining(self) -> float | None:
        """Seconds left (>= 0), None without a deadline: a gRPC `timeout=` as it is."""
        return None if self._at is None else max(self._at - time.monotonic(), 0.0)
