"""Orchestrator configuration: flags in kebab-case, or ORCHESTRATOR_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from service_common.options import TelemetryConfig


@dataclass
class OrchestratorConfig(TelemetryConfig):
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
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
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
