"""The draft and target pools as this orchestrator sees them: addresses, model, load.

Workers are polled with Info; the least-loaded reachable worker is chosen for a new
session, and a draft is only ever paired with a target of the same vocabulary.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from service_common.server import channel
from service_common.status import Unavailable
from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2, target_pb2_grpc
from speculative.fingerprint import check_compatible

log = logging.getLogger(__name__)

TARGET, DRAFT = "target", "draft"


@dataclass
class Worker:
    pool: str  # TARGET or DRAFT
    address: str
    stub: object  # TargetServiceStub or DraftServiceStub
    info: common_pb2.InfoResponse | None = None  # None until the first Info answered
    last_seen_ms: int = 0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info else ""

    @property
    def fingerprint(self) -> str:
        return self.info.model.tokenizer_fingerprint

    @property
    def model_id(self) -> str:
        return self.info.model.model_id

    def load(self) -> float:
        """Fraction of the worker's session capacity in use."""
        load = self.info.load
        return load.active_sessions / max(1, load.max_sessions)


class WorkerPool:
    def __init__(self, target_addresses, draft_addresses, rpc_timeout_s: float, refresh_s: float):
        self.rpc_timeout_s = rpc_timeout_s
        self.refresh_s = refresh_s
        self.workers = [
            *(Worker(TARGET, a, target_pb2_grpc.TargetServiceStub(channel(a))) for a in target_addresses),
            *(Worker(DRAFT, a, draft_pb2_grpc.DraftServiceStub(channel(a))) for a in draft_addresses),
        ]
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def refresh(self) -> None:
        for worker in self.workers:
            try:
                info = worker.stub.Info(common_pb2.InfoRequest(), timeout=self.rpc_timeout_s)
            except grpc.RpcError as error:
                if worker.info is not None:
                    log.warning("worker %s unreachable: %s", worker.address, error.code())
                with self._lock:
                    worker.info = None
                continue
            with self._lock:
                worker.info, worker.last_seen_ms = info, int(time.time() * 1000)

    def start(self) -> None:
        self.refresh()
        threading.Thread(target=self._refresh_forever, name="worker-refresh", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _refresh_forever(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def live(self, pool: str) -> list[Worker]:
        with self._lock:
            return [w for w in self.workers if w.pool == pool and w.info is not None]

    def by_address(self, pool: str, address: str) -> Worker | None:
        return next((w for w in self.live(pool) if w.address == address), None)

    def pick_target(self) -> Worker:
        targets = self.live(TARGET)
        if not targets:
            raise Unavailable("no target worker is reachable; check the target pool")
        return min(targets, key=Worker.load)

    def pick_draft(self, target: Worker, drafter: str) -> Worker | None:
        """The least-loaded draft that can serve target; None if the pool is empty.

        Raises IncompatibleModels when drafts exist but none shares the target's
        vocabulary (the n-gram drafter needs no vocabulary and fits any target).
        """
        drafts = self.live(DRAFT)
        if not drafts:
            return None
        if drafter != "ngram":
            compatible = [d for d in drafts if _compatible(target, d)]
            if not compatible:
                check_compatible(target.model_id, target.fingerprint, drafts[0].model_id, drafts[0].fingerprint)
            drafts = compatible
        return min(drafts, key=Worker.load)

    def describe(self) -> list[orchestrator_pb2.Worker]:
        pools = {TARGET: orchestrator_pb2.WORKER_POOL_TARGET, DRAFT: orchestrator_pb2.WORKER_POOL_DRAFT}
        return [
            orchestrator_pb2.Worker(
                pool=pools[w.pool], worker_id=w.worker_id, address=w.address, model=w.info.model,
                load=w.info.load, last_heartbeat_unix_ms=w.last_seen_ms,
            )
            for pool in (TARGET, DRAFT) for w in self.live(pool)
        ]


def close_worker_sessions(pool: WorkerPool, handles, timeout_s: float) -> None:
    """Frees a session's caches on the workers that hold them (best effort: a cache on
    an unreachable worker is gone anyway, or evicted later)."""
    for pool_name, handle in handles:
        worker = pool.by_address(pool_name, handle.address) if handle else None
        if worker is None:
            continue
        try:
            worker.stub.CloseSession(common_pb2.CloseSessionRequest(session_id=handle.session_id), timeout=timeout_s)
        except grpc.RpcError as error:
            log.warning("closing %s on %s: %s", handle.session_id, handle.address, error.code())


def _compatible(target: Worker, draft: Worker) -> bool:
    try:
        check_compatible(target.model_id, target.fingerprint, draft.model_id, draft.fingerprint)
    except Exception:  # noqa: BLE001 - IncompatibleModels: not a candidate
        return False
    return True
