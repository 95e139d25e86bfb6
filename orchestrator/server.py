"""Orchestrator process: `python -m orchestrator --target-addresses ... --draft-addresses ...`."""

from __future__ import annotations

import logging

import grpc

from service_common import config as config_flags
from service_common.logs import configure_logging
from service_common.server import create_server as create_grpc_server
from service_common.server import serve_until_signalled
from specdec.v1 import orchestrator_pb2_grpc
from speculative.loading import load_tokenizer
from orchestrator.config import OrchestratorConfig
from orchestrator.servicer import OrchestratorServicer
from orchestrator.store import InMemorySessionStore
from orchestrator.workers import TARGET, WorkerPool

log = logging.getLogger(__name__)
SERVICE_NAME = "specdec.v1.Orchestrator"
ENV_PREFIX = "ORCHESTRATOR"


def create_server(config: OrchestratorConfig, tokenizer=None) -> tuple[grpc.Server, int, object]:
    """Builds the server; connects to the workers and loads the target's tokenizer."""
    pool = WorkerPool(config.target_list(), config.draft_list(), config.rpc_timeout_s, config.worker_refresh_s)
    pool.start()
    if tokenizer is None:
        tokenizer = load_tokenizer(config.tokenizer or _target_model_id(pool))
    servicer = OrchestratorServicer(config, pool, InMemorySessionStore(config.session_ttl_s), tokenizer)
    server, port, health = create_grpc_server(
        config.address, lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, s), [SERVICE_NAME]
    )
    return server, port, health


def _target_model_id(pool: WorkerPool) -> str:
    targets = pool.live(TARGET)
    if not targets:
        raise SystemExit("no target worker reachable to learn the model from; set --tokenizer")
    return targets[0].model_id


def main(argv=None) -> None:
    config = config_flags.parse(OrchestratorConfig, ENV_PREFIX, argv, description=__doc__)
    configure_logging("orchestrator", config.log_level)
    server, port, health = create_server(config)
    log.info("orchestrator serving", extra={"fields": {"address": config.address, "port": port}})
    serve_until_signalled(server, health, config.grace_s)
