"""Orchestrator configuration: flags in kebab-case, or ORCHESTRATOR_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from service_common.options import ServerConfig, TelemetryConfig


@dataclass
class OrchestratorConfig(ServerConfig, TelemetryConfig):
    address: str = "0.0.0.0:50050"  # the public API
    # Shared state for replicas: sessions and the worker registry live in this Redis
    # (redis://[:password@]host:port/db). Empty = one replica with sessions in memory
    # and the worker addresses below.
    redis_url: str = ""
    # Comma-separated worker addresses, without Redis (with it, workers register).
    target_addresses: str = ""
    draft_addresses: str = ""
    # Tokenizer to load; empty = the target's model id (the same name loads the same
    # tokenizer without weights).
    tokenizer: str = ""
    default_k: int = 4  # draft tokens per round when a request does not say
    default_max_new_tokens: int = 256
    # Deadline of a Generate whose client set none, in seconds (0 = none): then it is
    # cancelled on the workers. A client's own deadline, longer or shorter, always wins:
    # a call slow under load must not fail while its client still waits.
    generate_timeout_s: float = 600.0
    # Deadline of each bookkeeping call to a worker (Truncate, CloseSession, Info):
    # quick at any load. Calls that do model work and may queue behind other sessions
    # (OpenSession, Extend: prefills) get what is left of the Generate's deadline.
    rpc_timeout_s: float = 30.0
    worker_refresh_s: float = 1.0  # how often the pools (and their load) are re-read
    # Public API limits (docs/security.md): a request past one is refused with a status
    # naming the setting. Stop strings are matched against every new piece of text.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    # Tokens of a Generate's prompt as the target sees it (a continued session's history
    # counts): bounds the prefill one request can cause. 0 = the model's context only.
    max_prompt_tokens: int = 32768
    # The largest max_new_tokens a request or session may ask for: bounds the decoding
    # one request can hold a worker for. 0 = the room left in the context only.
    max_new_tokens_limit: int = 4096
    # API keys (docs/security.md): `NAME sha256:HEX` lines, made by `python -m
    # service_common.auth add NAME FILE`. Empty = no authentication (a loopback run).
    api_keys_file: str = ""
    # With TLS, also require a client certificate the cluster CA signed on the public
    # API (when only the HTTP front calls it); else API keys authenticate clients.
    tls_require_client_cert: bool = False
    # Sessions one API key holds at once (every Generate without a session id makes
    # one; CloseSession or the idle TTL frees it). 0 = no bound. Not applied without keys.
    max_sessions_per_key: int = 1000
    # Public API calls in flight at once on this replica, streams included (each holds
    # a server thread), and per API key; past either, RESOURCE_EXHAUSTED at once.
    # 0 = no bound. Health checks are never counted.
    max_concurrent_calls: int = 128
    max_calls_per_key: int = 64
    # Token bucket per API key: calls per second, and the burst saved up. 0 = off.
    rate_limit_per_s: float = 0.0
    rate_limit_burst: int = 20
    session_ttl_s: float = 3600.0  # idle sessions are forgotten after this
    # A replica holds a session while it generates; the hold is renewed every third of
    # this, so a replica that dies frees its sessions within this many seconds.
    lease_ttl_s: float = 15.0
    # Failovers one call may go through (a worker lost mid-generation) before it fails.
    max_failovers: int = 4
    grace_s: float = 10.0  # graceful shutdown: time for calls in flight
    log_level: str = "INFO"

    def target_list(self) -> list[str]:
        return [a.strip() for a in self.target_addresses.split(",") if a.strip()]

    def draft_list(self) -> list[str]:
        return [a.strip() for a in self.draft_addresses.split(",") if a.strip()]
