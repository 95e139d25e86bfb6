"""The worker registry in Redis: workers announce themselves, the orchestrators read.

A worker writes one record (pool, id, address, model, tokenizer fingerprint, load) under
a key that expires after `heartbeat_ttl_s`, and rewrites it every `heartbeat_s`: a worker
that stops heartbeating (killed, hung, partitioned) leaves its pool within the TTL, by
Redis's own expiry, with no clock shared between hosts. A sorted set indexes the keys so
readers need no SCAN; the key's existence, not the index, says a worker is alive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
from google.protobuf import json_format

from service_common import telemetry
from service_common.redis_client import connect, describe, unavailable_on_error
from service_common.security import Tls, tls_of
from service_common.server import Service, add_health_port, create_server
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

KEY_PREFIX = "specdec:worker:"
INDEX_KEY = "specdec:workers"
POOL_NAMES = {common_pb2.WORKER_POOL_TARGET: "target", common_pb2.WORKER_POOL_DRAFT: "draft"}


def record_key(pool: int, worker_id: str) -> str:
    return f"{KEY_PREFIX}{POOL_NAMES[pool]}:{worker_id}"


class WorkerRegistry:
    def __init__(self, url: str, tls: Tls | None = None):
        self.url = url
        self.client = connect(url, tls)

    def announce(self, record: common_pb2.Worker, ttl_s: float) -> None:
        """Writes (or refreshes) a worker's record for ttl_s seconds."""
        key = record_key(record.pool, record.worker_id)
        ttl_ms = int(ttl_s * 1000)
        with unavailable_on_error(self.url, "worker registry"):
            with self.client.pipeline(transaction=True) as pipe:
                pipe.set(key, json_format.MessageToJson(record, indent=None), px=ttl_ms)
                # Score: when the record expires; only used to prune the index.
                pipe.zadd(INDEX_KEY, {key: record.last_heartbeat_unix_ms + ttl_ms})
                pipe.execute()

    def withdraw(self, pool: int, worker_id: str) -> None:
        key = record_key(pool, worker_id)
        with unavailable_on_error(self.url, "worker registry"):
            with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                pipe.zrem(INDEX_KEY, key)
                pipe.execute()

    def workers(self) -> list[common_pb2.Worker]:
        """Every worker whose record has not expired."""
        with unavailable_on_error(self.url, "worker registry"):
            keys = [k.decode() for k in self.client.zrange(INDEX_KEY, 0, -1)]
            values = self.client.mget(keys) if keys else []
            gone = [k for k, v in zip(keys, values) if v is None]
            if gone:
                self.client.zrem(INDEX_KEY, *gone)
        return [json_format.Parse(v, common_pb2.Worker()) for v in values if v is not None]


class Heartbeat:
    """A worker's registration: announces `describe()` every `interval_s` from a daemon
    thread until stopped; withdraws the record on a graceful stop, so the pools stop
    placing sessions on a draining worker at once. Redis outages are logged and ridden
    out: the next heartbeat after Redis returns registers the worker again."""

    def __init__(
        self,
        registry: WorkerRegistry,
        describe_worker: Callable[[], common_pb2.Worker],
        interval_s: float,
        ttl_s: float,
    ):
        if not 0 < interval_s < ttl_s:
            raise ValueError(
                f"heartbeat_s ({interval_s}) must be > 0 and below heartbeat_ttl_s ({ttl_s})"
            )
        self.registry, self.describe_worker = registry, describe_worker
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._healthy = True

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        record = self.describe_worker()
        try:
            self.registry.withdraw(record.pool, record.worker_id)
        except Exception as error:  # noqa: BLE001 - the TTL removes it anyway
            log.warning("could not withdraw from the registry: %s", error)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def _beat(self) -> None:
        try:
            self.registry.announce(self.describe_worker(), self.ttl_s)
        except Exception as error:  # noqa: BLE001 - keep beating; log each outage once
            if self._healthy:
                log.warning("heartbeat failed, retrying every %.1f s: %s", self.interval_s, error)
            self._healthy = False
            return
        if not self._healthy:
            log.info("heartbeat restored: registered in %s again", describe(self.registry.url))
        self._healthy = True


def worker_record(pool: int, address: str, info: common_pb2.InfoResponse) -> common_pb2.Worker:
    """A worker's registry record, from its own Info answer."""
    return common_pb2.Worker(
        pool=pool,
        worker_id=info.worker_id,
        address=address,
        model=info.model,
        load=info.load,
        last_heartbeat_unix_ms=int(time.time() * 1000),
    )


def create_worker_service(
    config,
    register: Callable[[grpc.Server], None],
    service_name: str,
    pool: int,
    info: Callable[[], common_pb2.InfoResponse],
    max_calls: int | None = None,
) -> Service:
    """Builds (does not start) a worker's Service: its gRPC server, and, when
    config.redis_url (a RegistryConfig) is set, its membership of `pool` while it serves
    (without Redis the orchestrator is given worker addresses instead). max_calls: the
    long calls it holds at once (default: one per session)."""
    tls = tls_of(config)
    server, port, health = create_server(
        config.address,
        register,
        [service_name],
        # Each Verify, Decode or Speculate stream holds a thread for its rounds (about one
        # per session), plus headroom for unary calls and health checks.
        max_workers=(max_calls or config.max_sessions) + 16,
        interceptors=telemetry.current().server_interceptors(),
        # Workers answer only other roles: with TLS, only peers the cluster CA signed.
        tls=tls,
        require_client_auth=True,
        max_message_bytes=config.max_message_bytes,
    )
    service = Service(server, port, health)
    if config.health_address:
        add_health_port(service, config.health_address)
    if config.redis_url:
        address = config.resolved_advertise_address(port)
        heartbeat = Heartbeat(
            WorkerRegistry(config.redis_url, tls),
            lambda: worker_record(pool, address, info()),
            config.heartbeat_s,
            config.heartbeat_ttl_s,
        )
        service.on_started.append(heartbeat.start)
        service.on_stopping.append(heartbeat.stop)
    return service
