"""The draft-to-verify time ratio of a draft worker's recent rounds, the gauge its pool's
autoscaler reads (`specdec_worker_draft_verify_time_ratio`, deploy/README.md).

Over the rounds that ended in the last `WINDOW_S` seconds: the time the worker spent
drafting their proposals (`RoundStats.draft_ns`) over the target's passes that verified
them (`RoundStats.target_compute_ns`), a sum over a sum, so that a round of a few
microseconds' verification cannot swing it. Near 1 the draft side is the bottleneck of
its rounds (drafting ahead can no longer hide it behind the verification) and the pool
should grow; far below 1 drafts are cheap. 0 when no round ended in the window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from speculative.stats import RoundStats

# A time window, not the last N rounds: an idle worker reads 0 within it (N rounds would
# keep its last busy value forever, and the pool would never shrink); 30 s spans the
# Prometheus scrape and HPA sync intervals (15-30 s), so each sample sees every round
# since the one before.
WINDOW_S = 30.0
# Rounds are summed per second: memory stays ~30 buckets at thousands of rounds a second.
BUCKET_S = 1.0


@dataclass
class _Bucket:
    index: int  # covers [index * bucket_s, (index + 1) * bucket_s) on the clock
    draft_ns: int = 0
    verify_ns: int = 0


class DraftVerifyWindow:
    """The worker's rounds of the last `window_s` seconds (to within `bucket_s`), summed.
    Thread-safe: every Speculate call adds its rounds while a scrape reads the ratio."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        bucket_s: float = BUCKET_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._clock = clock
        self._buckets: deque[_Bucket] = deque()
        self._lock = threading.Lock()

    def add(self, stats: RoundStats) -> None:
        """One finished round. A stretch's token (the target decoding alone) drafted
        nothing, and a round whose target reported no pass has nothing to divide by:
        neither counts."""
        if stats.streamed or stats.target_compute_ns <= 0:
            return
        with self._lock:
            now = self._clock()
            self._drop_before(now - self.window_s)
            index = int(now // self.bucket_s)
            if not self._buckets or self._buckets[-1].index != index:
                self._buckets.append(_Bucket(index))
            self._buckets[-1].draft_ns += stats.draft_ns
            self._buckets[-1].verify_ns += stats.target_compute_ns

    def ratio(self) -> float:
        """Drafting time over verifying time of the rounds in the window; 0 with none."""
        with self._lock:
            self._drop_before(self._clock() - self.window_s)
            draft_ns = sum(bucket.draft_ns for bucket in self._buckets)
            verify_ns = sum(bucket.verify_ns for bucket in self._buckets)
        return draft_ns / verify_ns if verify_ns else 0.0

    def _drop_before(self, oldest: float) -> None:
        """Drops the buckets that start before `oldest` (clock seconds)."""
        while self._buckets and self._buckets[0].index * self.bucket_s < oldest:
            self._buckets.popleft()
