"""Orchestrator process: `python -m orchestrator --redis-url redis://...` (replicas share
sessions and discover workers in Redis), or `--target-addresses ... --draft-addresses ...`
(one replica, sessions in memory)."""

from __future__ import annotations

import logging

from foundation.errors import InvalidArgument
from orchestrator.config import OrchestratorConfig
from orchestrator.redis_store import RedisSessionStore
from orchestrator.servicer import OrchestratorServicer
from orchestrator.store import InMemorySessionStore, SessionStore
from orchestrator.tokenizer import TargetTokenizer
from orchestrator.workers import WorkerPool, registry_discovery, static_discovery
from service_common import config as config_flags
from service_common import telemetry
from service_common.auth import ApiGate, ApiKeys
from service_common.limits import CallLimits
from service_common.logs import configure_logging
from service_common.redis_client import describe
from service_common.security import Tls, tls_of
from service_common.server import Service, add_health_port
from service_common.server import create_server as create_grpc_server
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "specdec.v1.Orchestrator"
ENV_PREFIX = "ORCHESTRATOR"


def create_server(config: OrchestratorConfig, tokenizer=None) -> Service:
    """Builds the server; discovers the workers. Starts even when Redis or the workers
    are not up yet: calls fail with UNAVAILABLE naming what is missing until they are."""
    tls = tls_of(config)
    gate = _gate(config)
    # With TLS, a worker from the registry joins only once it answered over mutual TLS.
    pool = WorkerPool(
        _discovery(config, tls), config.worker_refresh_s, tls, vet=bool(tls and config.redis_url)
    )
    pool.start()
    store = _store(config, tls)
    target_tokenizer = TargetTokenizer(pool, config.tokenizer, tokenizer, config.rpc_timeout_s)
    servicer = OrchestratorServicer(config, pool, store, target_tokenizer)
    server, port, health = create_grpc_server(
        config.address,
        lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, s),
        [SERVICE_NAME],
        # A thread per call in flight (streams hold theirs), headroom for health checks.
        max_workers=max(config.max_concurrent_calls, 64) + 16,
        interceptors=[gate, *telemetry.current().server_interceptors()],
        tls=tls,
        require_client_auth=config.tls_require_client_cert,
        max_message_bytes=config.max_message_bytes,
    )
    service = Service(server, port, health)
    if config.health_address:
        add_health_port(service, config.health_address)
    service.on_started.append(lambda: target_tokenizer.fetch_ahead(config.worker_refresh_s))
    service.on_stopping += [pool.stop, store.close, target_tokenizer.stop]
    return service


def _gate(config: OrchestratorConfig) -> ApiGate:
    """API keys (when a file is given) and the call limits, at the door of every public call."""
    keys = ApiKeys(config.api_keys_file) if config.api_keys_file else None
    limits = CallLimits(
        config.max_concurrent_calls,
        config.max_calls_per_key,
        config.rate_limit_per_s,
        config.rate_limit_burst,
    )
    return ApiGate(keys, limits)


def _discovery(config: OrchestratorConfig, tls: Tls | None):
    if config.redis_url:
        if config.target_list() or config.draft_list():
            raise InvalidArgument(
                "give either --redis-url (workers register there) or worker addresses, not both"
            )
        return registry_discovery(config.redis_url, tls)
    if not config.target_list():
        raise InvalidArgument(
            "no workers: give --redis-url (workers register there) or --target-addresses"
        )
    return static_discovery(config.target_list(), config.draft_list(), config.rpc_timeout_s, tls)


def _store(config: OrchestratorConfig, tls: Tls | None) -> SessionStore:
    if config.redis_url:
        return RedisSessionStore(config.redis_url, config.session_ttl_s, config.lease_ttl_s, tls)
    return InMemorySessionStore(config.session_ttl_s)


def main(argv=None) -> int:
    config = config_flags.parse(OrchestratorConfig, ENV_PREFIX, argv, description=__doc__)
    configure_logging("orchestrator", config.log_level)
    try:
        telemetry.setup("orchestrator", config)
        service = create_server(config)
    except (InvalidArgument, OSError) as error:
        log.error("cannot start: %s", error)
        return 2
    log.info(
        "orchestrator serving",
        extra={
            "fields": {
                "address": config.address,
                "port": service.port,
                "sessions": describe(config.redis_url) if config.redis_url else "in memory",
            }
        },
    )
    service.serve_until_signalled(config.grace_s)
    telemetry.current().shutdown()  # flushes the spans still buffered
    return 0
