"""Handing freed KV-cache memory back to the operating system.

A session's keys and values are many tensors that grow token by token; glibc's malloc
keeps the pages they freed in its arenas, so a worker's resident memory stays at the
high-water mark of its busiest minute (a failover that doubled its sessions) long
after those sessions closed. `FreedMemory.returned()` asks glibc to return whole free
pages (malloc_trim), at most once per `min_interval_s`: a trim walks every arena
under its lock, a few milliseconds, too much to pay on every close.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable

MIN_TRIM_INTERVAL_S = 5.0


def _glibc_trim() -> Callable[[], None] | None:
    """malloc_trim(0) where the C library is glibc; None elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class FreedMemory:
    def __init__(self, min_interval_s: float = MIN_TRIM_INTERVAL_S,
                 trim: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.min_interval_s, self.clock = min_interval_s, clock
        self._trim = trim if trim is not None else _glibc_trim()
        self._lock = threading.Lock()
        self._last = float("-inf")

    def returned(self) -> bool:
        """Memory was freed (sessions released): returns free pages to the OS unless
        that was done less than min_interval_s ago. True if it trimmed."""
        if self._trim is None:
            return False
        with self._lock:
            now = self.clock()
            if now - self._last < self.min_interval_s:
                return False
            self._last = now
        self._trim()
        return True
