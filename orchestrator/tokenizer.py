"""The target's tokenizer, loaded on first use.

The orchestrator may start before any target worker (Kubernetes starts pods in any
order): without --tokenizer it learns the model from the first target it sees, and
until then answers UNAVAILABLE rather than refusing to start.
"""

from __future__ import annotations

import gc
import threading

from service_common.server import freeze_startup_heap
from service_common.status import Unavailable
from speculative.loading import load_tokenizer
from orchestrator.workers import WorkerPool


class TargetTokenizer:
    def __init__(self, pool: WorkerPool, name: str = "", tokenizer=None):
        self.pool, self.name = pool, name
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.name or self._target_model_id())
                # It lives as long as the process, like what start-up built: where that
                # was frozen out of the collector's reach, so is this (else the next
                # calls pay full collections of 30-100 ms, walking what loading it left).
                if gc.get_freeze_count():
                    freeze_startup_heap()
            return self._tokenizer

    def _target_model_id(self) -> str:
        targets = self.pool.live_targets()
        if not targets:
            raise Unavailable(self.pool.why_empty(
                "no target worker is reachable to learn the tokenizer from; start a target worker or set --tokenizer"))
        return targets[0].model_id
