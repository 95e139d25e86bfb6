"""glibc's heap under a model server: a fixed mmap threshold.

glibc serves a request above its mmap threshold with a fresh mapping and everything
below from its heaps. The threshold is dynamic: freeing a mapped block raises it to
that block's size (up to 32 MiB), so once the output layer's logits of a wide step
([tokens, vocabulary] fp32, megabytes) are freed, blocks of every size between come
from the heap, where tensors of ever-changing sizes (each step's batch differs)
fragment it and resident memory climbs for as long as new sizes turn up. Measured on
SmolLM2-135M's linears, one pass at each of 1..150 rows, twice: +2.1-3.1 GiB with the
dynamic threshold, +0.46 GiB (then flat) with it fixed at 4 MiB. A fixed threshold
(mallopt also turns the adjustment off) sends every block above it to its own mapping,
returned whole when freed; a mapping costs its page faults, under 1% of a pass that
fills megabytes. No-op where the C library has no mallopt (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc malloc.h
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024


def fix_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fixes glibc's mmap threshold for this process; False where it cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    fixed = mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1
    if fixed:
        log.debug("glibc mmap threshold fixed at %d bytes", threshold_bytes)
    return fixed
