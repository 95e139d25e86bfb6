"""One long-lived thread that runs every model call of a worker process.

Why a thread of its own: on the 2-core development machine (torch 2.13, OpenMP intra-op
parallelism, 2 threads) SmolLM2-135M decoded at 19-21 tokens/s on the thread that first
ran torch work and at 11-14 tokens/s when the same calls came from other threads (as
gRPC handler threads are). Loading the model and running every forward pass on one
dedicated thread keeps the fast path whichever thread serves the request. It also
serialises forward passes, which on a CPU gain nothing from overlapping, and is where
proposals of several sessions can later be batched into one pass.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    def __init__(self, name: str = "model-compute"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Runs fn on the compute thread and returns its result (or raises its error)."""
        if threading.current_thread() is self._thread:  # already there: no self-deadlock
            return fn(*args, **kwargs)
        future: Future = Future()
        self._queue.put((fn, args, kwargs, future))
        return future.result()

    def stop(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args, kwargs, future = item
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)
