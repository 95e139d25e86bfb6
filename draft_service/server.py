"""Construction and the command line of the draft worker."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from draft_service.config import ENV_PREFIX, DraftConfig
from draft_service.drafting import Drafters
from draft_service.servicer import DraftServicer
from draft_service.target_connections import TargetConnections
from foundation.errors import SpeculativeError
from service_common import config as config_flags
from service_common import server as common_server
from service_common import telemetry
from service_common.logs import configure_logging
from service_common.registry import create_worker_service
from service_common.security import tls_of
from service_common.session_cache import SessionCache
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

if TYPE_CHECKING:
    from model_runtime.loading import LoadedModel

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def create_server(
    config: DraftConfig, loaded_model: LoadedModel | None = None
) -> common_server.Service:
    """Builds (does not start) the worker; with config.redis_url it joins the draft pool
    once it serves.

    loaded_model: the "model" drafter's model, already loaded (tests share one); None =
    load config.model, or serve the n-gram drafter only when that is empty.
    """
    config.validate()
    model = None
    if loaded_model is not None or config.model:
        # Imported here only: torch and transformers take seconds, and n-gram lookup needs neither.
        from draft_service.draft_model import start_draft_model

        model = start_draft_model(config, loaded_model)
    drafters = Drafters(
        model,
        config.default_drafter,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
        config.drafter_plugin,
    )
    servicer = DraftServicer(
        config,
        drafters,
        # A session in use is never evicted: a Speculate stream cannot be cut short.
        SessionCache("draft", config.max_sessions, config.max_cached_tokens, evicts_in_use=False),
        TargetConnections(tls_of(config)),
    )

    service = create_worker_service(
        config,
        lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
        SERVICE_NAME,
        common_pb2.WORKER_POOL_DRAFT,
        lambda: servicer.Info(common_pb2.InfoRequest(), None),
    )
    servicer.advertise_address = config.resolved_advertise_address(service.port)
    return service


def main(argv: list[str] | None = None) -> int:
    config = config_flags.parse(
        DraftConfig,
        ENV_PREFIX,
        argv,
        description="Draft worker: drafts tokens and runs speculation rounds against a target worker.",
    )
    configure_logging("draft", config.log_level)
    try:
        telemetry.setup("draft", config, config.resolved_worker_id())
        service = create_server(config)
    except (SpeculativeError, OSError) as error:
        log.error("cannot start: %s", error)
        return 2
    # One parseable line for launchers: the bound port (address ":0" picks a free one).
    log.info(
        "draft worker serving",
        extra={
            "fields": {
                "port": service.port,
                "address": config.resolved_advertise_address(service.port),
                "worker_id": config.resolved_worker_id(),
                "model": config.model or None,
                "default_drafter": config.default_drafter,
            }
        },
    )
    service.serve_until_signalled(config.grace_s)
    telemetry.current().shutdown()  # flushes the spans still buffered
    log.info("stopped")
    return 0
