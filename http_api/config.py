"""HTTP API configuration: flags in kebab-case, or HTTP_API_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from service_common.options import TlsConfig


# TlsConfig: HTTP_API_TLS_CERT / _KEY / _CA (+ _SERVER_NAME) make the channel to the
# orchestrator TLS with the front's own certificate (docs/security.md).
@dataclass
class HttpApiConfig(TlsConfig):
    address: str = "0.0.0.0:8000"  # where the HTTP API and the playground listen
    # The orchestrator's public gRPC API: a "host:port" or any gRPC target (dns:///...).
    orchestrator_address: str = "127.0.0.1:50050"
    # The model name /v1/models lists and requests must name; empty = the model id of the
    # target workers (as the orchestrator's ListWorkers reports them).
    model_name: str = ""
    # Speculation of a request that does not say (extra body fields of the same names):
    # draft tokens per round (-1 = the orchestrator's default_k), the drafter ("" = the
    # draft worker's default), adaptive k.
    default_num_speculative_tokens: int = -1
    default_drafter: str = ""
    default_adaptive: bool = False
    # max_tokens of a request that does not say; 0 = the orchestrator's default_max_new_tokens.
    default_max_tokens: int = 0
    # Deadline of each generation on the orchestrator, in seconds.
    timeout_s: float = 600.0
    # How long the served model names (ListWorkers) are cached, in seconds.
    models_cache_s: float = 5.0
    # Conversations remembered to continue their orchestrator session (its KV caches)
    # when a client sends them again with a new message; the least recently used beyond
    # this are closed.
    max_conversations: int = 1024
    grace_s: float = 10.0  # graceful shutdown: time for requests in flight
    log_level: str = "INFO"
