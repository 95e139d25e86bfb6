"""Waiting in tests: poll with a deadline, never sleep a fixed time before an assertion.

A fixed sleep is either too short on a loaded machine (a flaky test) or too long on an
idle one (a slow test); a poll returns as soon as the condition holds and fails with
what it waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], what: str, timeout_s: float = 10.0, interval_s: float = 0.05
) -> T:
    """condition()'s first truthy value; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"after {timeout_s:.1f} s still not: {what}"
        time.sleep(interval_s)


def holds_for(
    condition: Callable[[], bool], what: str, duration_s: float, interval_s: float = 0.05
) -> None:
    """Asserts condition() at every poll for duration_s: a state that must last, not arrive."""
    end = time.monotonic() + duration_s
    while True:
        assert condition(), f"no longer: {what}"
        if time.monotonic() >= end:
            return
        time.sleep(interval_s)


def settled(read: Callable[[], T], what: str, quiet_s: float = 0.3, timeout_s: float = 10.0) -> T:
    """read()'s value once it stayed unchanged for quiet_s (a process that has stopped)."""
    deadline = time.monotonic() + timeout_s
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"after {timeout_s:.1f} s still changing: {what}"
        time.sleep(0.05)
        latest = read()
        if latest != value:
            value, since = latest, time.monotonic()
    return value
