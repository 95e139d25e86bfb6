"""The draft and target pools as this orchestrator sees them: addresses, model, load.

Where the pools come from is a `discover` function: the worker registry in Redis (workers
heartbeat themselves in; see service_common/registry.py), or a fixed list of addresses
polled with Info. The pool re-reads it every `refresh_s` and picks, for a new session,
the least-loaded reachable worker, counting the sessions this replica has just placed
(heartbeats lag behind a burst of new sessions); a draft is only ever paired with a
target of the same vocabulary. A worker found dead mid-call is suspected, i.e. skipped,
until it heartbeats again or leaves the registry.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from foundation.errors import SpeculativeError
from model_runtime.fingerprint import check_compatible
from service_common.registry import WorkerRegistry
from service_common.security import Tls
from service_common.server import channel
from service_common.status import Unavailable
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from speculative.types import NGRAM

log = logging.getLogger(__name__)

TARGET, DRAFT = "target", "draft"
POOL_OF_PROTO = {common_pb2.WORKER_POOL_TARGET: TARGET, common_pb2.WORKER_POOL_DRAFT: DRAFT}
PROTO_OF_POOL = {name: value for value, name in POOL_OF_PROTO.items()}
STUB_OF_POOL = {TARGET: target_pb2_grpc.TargetServiceStub, DRAFT: draft_pb2_grpc.DraftServiceStub}


@dataclass
class Worker:
    pool: str  # TARGET or DRAFT
    record: common_pb2.Worker  # as registered: id, address, model, load, heartbeat
    stub: object  # TargetServiceStub or DraftServiceStub

    @property
    def address(self) -> str:
        return self.record.address

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def model(self) -> common_pb2.ModelInfo:
        return self.record.model

    @property
    def model_id(self) -> str:
        return self.record.model.model_id

    @property
    def fingerprint(self) -> str:
        return self.record.model.tokenizer_fingerprint


Discover = Callable[[], list[common_pb2.Worker]]


def registry_discovery(url: str, tls: Tls | None = None) -> Discover:
    return WorkerRegistry(url, tls).workers


def static_discovery(
    target_addresses: list[str],
    draft_addresses: list[str],
    rpc_timeout_s: float,
    tls: Tls | None = None,
) -> Discover:
    """Polls each address's Info; a worker that does not answer is left out (with TLS,
    one whose certificate the cluster CA did not sign never answers)."""
    stubs = [
        (common_pb2.WORKER_POOL_TARGET, a, target_pb2_grpc.TargetServiceStub(channel(a, tls)))
        for a in target_addresses
    ]
    stubs += [
        (common_pb2.WORKER_POOL_DRAFT, a, draft_pb2_grpc.DraftServiceStub(channel(a, tls)))
        for a in draft_addresses
    ]

    def discover() -> list[common_pb2.Worker]:
        found = []
        for pool, address, stub in stubs:
            try:
                info = stub.Info(common_pb2.InfoRequest(), timeout=rpc_timeout_s)
            except grpc.RpcError as error:
                log.debug("worker %s unreachable: %s", address, error.code())
                continue
            found.append(
                common_pb2.Worker(
                    pool=pool,
                    worker_id=info.worker_id,
                    address=address,
                    model=info.model,
                    load=info.load,
                    last_heartbeat_unix_ms=int(time.time() * 1000),
                )
            )
        return found

    return discover


class WorkerPool:
    """vet: admit a discovered worker only once it has answered Info as the worker its
    record names, over this pool's channels. With TLS that is the registry's proof: a
    record anyone wrote into Redis joins only if a worker holding a certificate the
    cluster CA signed stands behind it."""

    def __init__(
        self,
        discover: Discover,
        refresh_s: float,
        tls: Tls | None = None,
        vet: bool = False,
        vet_timeout_s: float = 2.0,
    ):
        self.discover = discover
        self.refresh_s = refresh_s
        self.tls, self.vet, self.vet_timeout_s = tls, vet, vet_timeout_s
        self._vetted: dict[
            tuple[str, str], str
        ] = {}  # (pool, address) -> the worker id that answered
        # (pool, address, worker id) refused, logged once
        self._refused: set[tuple[str, str, str]] = set()
        self._workers: list[Worker] = []
        self._stubs: dict[tuple[str, str], object] = {}
        # calls in flight per address
        self._placed: collections.Counter[str] = collections.Counter()
        self._suspects: dict[str, int] = {}  # address -> its heartbeat time when suspected
        self.discovery_error: str | None = None  # why the pools cannot be read, e.g. Redis down
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # Discovery.

    def refresh(self) -> None:
        try:
            records = self.discover()
        except SpeculativeError as error:  # Redis away: keep the last view of the pools
            if self.discovery_error is None:
                log.warning("cannot read the worker pools, keeping the last view: %s", error)
            self.discovery_error = str(error)
            return
        self.discovery_error = None
        workers = [
            Worker(POOL_OF_PROTO[r.pool], r, self._stub(POOL_OF_PROTO[r.pool], r.address))
            for r in records
            if r.pool in POOL_OF_PROTO
        ]
        if self.vet:
            workers = [w for w in workers if self._answers_as_recorded(w)]
        with self._lock:
            self._workers = workers
            beats = {w.address: w.record.last_heartbeat_unix_ms for w in workers}
            # A suspect is forgiven when it heartbeats again, forgotten when it is gone.
            self._suspects = {a: t for a, t in self._suspects.items() if beats.get(a) == t}

    def start(self) -> None:
        self.refresh()
        threading.Thread(target=self._refresh_forever, name="worker-refresh", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _refresh_forever(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def _stub(self, pool: str, address: str):
        key = (pool, address)
        if key not in self._stubs:
            self._stubs[key] = STUB_OF_POOL[pool](channel(address, self.tls))
        return self._stubs[key]

    def _answers_as_recorded(self, worker: Worker) -> bool:
        """Vetting: once per (pool, address, worker id), the worker must answer Info
        with the id its record names; until it does it is left out (asked again at
        each refresh)."""
        key = (worker.pool, worker.address)
        if self._vetted.get(key) == worker.worker_id:
            return True
        try:
            answer = worker.stub.Info(common_pb2.InfoRequest(), timeout=self.vet_timeout_s)
            refusal = (
                None
                if answer.worker_id == worker.worker_id
                else f"worker {answer.worker_id!r} answers there"
            )
        except grpc.RpcError as error:
            refusal = f"{error.code().name}: {error.details()}"
        if refusal is None:
            self._vetted[key] = worker.worker_id
            return True
        if (*key, worker.worker_id) not in self._refused:
            self._refused.add((*key, worker.worker_id))
            log.warning(
                "registered %s worker %s at %s left out of the pool: %s",
                worker.pool,
                worker.worker_id,
                worker.address,
                refusal,
            )
        return False

    # Views.

    def live(self, pool: str) -> list[Worker]:
        with self._lock:
            return [w for w in self._workers if w.pool == pool and w.address not in self._suspects]

    def by_address(self, pool: str, address: str) -> Worker | None:
        return next((w for w in self.live(pool) if w.address == address), None)

    def describe(self) -> list[common_pb2.Worker]:
        return [w.record for pool in (TARGET, DRAFT) for w in self.live(pool)]

    # Placement.

    def load(self, worker: Worker) -> float:
        """How full the worker is, in [0, 1+]: the larger of its session capacity in use
        and, for a worker that admits calls (a target), its running slots in use with
        the queued calls counted as running (they wait for one). Both count this
        replica's calls in flight on it, which may not show in its last heartbeat yet."""
        load = worker.record.load
        with self._lock:
            placed = self._placed[worker.address]
        sessions = (load.active_sessions + placed) / max(1, load.max_sessions)
        if not load.max_running:
            return sessions
        return max(sessions, (load.running_calls + load.queued_calls + placed) / load.max_running)

    def least_loaded(self, workers: list[Worker]) -> Worker:
        loads = [self.load(w) for w in workers]
        lightest = min(loads)
        # Ties at random: replicas with the same view must not all pick the same worker.
        return random.choice([w for w, load in zip(workers, loads) if load == lightest])

    def live_targets(self) -> list[Worker]:
        """The live targets; with none known, the pools are read again first (a target
        that registered since the last refresh serves at once)."""
        targets = self.live(TARGET)
        if not targets:
            self.refresh()
            targets = self.live(TARGET)
        return targets

    def pick_target(self) -> Worker:
        targets = self.live_targets()
        if not targets:
            raise Unavailable(
                self.why_empty("no target worker is reachable; check the target pool")
            )
        return self.least_loaded(targets)

    def why_empty(self, message: str) -> str:
        return f"{message} ({self.discovery_error})" if self.discovery_error else message

    def pick_draft(self, target: Worker, drafter: str) -> Worker | None:
        """The least-loaded draft that can serve target; None if the pool is empty.

        Raises IncompatibleModels when drafts exist but none shares the target's
        vocabulary (the n-gram drafter needs no vocabulary and fits any target).
        """
        drafts = self.live(DRAFT)
        if not drafts:
            return None
        if drafter != NGRAM:
            compatible = [d for d in drafts if _compatible(target, d)]
            if not compatible:
                check_compatible(
                    target.model_id, target.fingerprint, drafts[0].model_id, drafts[0].fingerprint
                )
            drafts = compatible
        return self.least_loaded(drafts)

    @contextlib.contextmanager
    def placed(self, worker: Worker):
        """Counts a call in flight on worker for the duration of the block."""
        with self._lock:
            self._placed[worker.address] += 1
        try:
            yield worker
        finally:
            with self._lock:
                self._placed[worker.address] -= 1

    def suspect(self, worker: Worker) -> None:
        """Skips a worker that failed a call until it heartbeats again."""
        log.warning(
            "%s worker %s at %s unreachable: skipped until it heartbeats again",
            worker.pool,
            worker.worker_id,
            worker.address,
        )
        with self._lock:
            self._suspects[worker.address] = worker.record.last_heartbeat_unix_ms


def close_worker_sessions(pool: WorkerPool, handles, timeout_s: float) -> None:
    """Frees a session's caches on the workers that hold them (best effort: a cache on
    an unreachable worker is gone anyway, or evicted later)."""
    for pool_name, handle in handles:
        worker = pool.by_address(pool_name, handle.address) if handle else None
        if worker is None:
            continue
        try:
            worker.stub.CloseSession(
                common_pb2.CloseSessionRequest(session_id=handle.session_id), timeout=timeout_s
            )
        except grpc.RpcError as error:
            log.warning("closing %s on %s: %s", handle.session_id, handle.address, error.code())


def _compatible(target: Worker, draft: Worker) -> bool:
    try:
        check_compatible(target.model_id, target.fingerprint, draft.model_id, draft.fingerprint)
    except Exception:  # noqa: BLE001 - IncompatibleModels: not a candidate
        return False
    return True
