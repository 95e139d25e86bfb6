"""Orchestrator configuration: flags in kebab-case, or ORCHESTRATOR_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OrchestratorConfig:
    address: str = "0.0.0.0:50050"  # the public API
    # Comma-separated worker addresses (a registry replaces these lists in deployments).
    target_addresses: str = "127.0.0.1:50051"
    draft_addresses: str = "127.0.0.1:50052"
    # Tokenizer to load; empty = the target's model id (the same name loads the same
    # tokenizer without weights).
    tokenizer: str = ""
    default_k: int = 4  # draft tokens per round when a request does not say
    default_max_new_tokens: int = 256
    # A Generate that outlives this is cancelled on the workers (seconds); a client
    # deadline, when shorter, wins.
    generate_timeout_s: float = 600.0
    rpc_timeout_s: float = 30.0  # deadline of each unary call to a worker
    worker_refresh_s: float = 2.0  # how often worker Info (load) is refreshed
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    session_ttl_s: float = 3600.0  # idle sessions are forgotten after this
    grace_s: float = 10.0  # graceful shutdown: time for calls in flight
    log_level: str = "INFO"

    def target_list(self) -> list[str]:
        return [a.strip() for a in self.target_addresses.split(",") if a.strip()]

    def draft_list(self) -> list[str]:
        return [a.strip() for a in self.draft_addresses.split(",") if a.strip()]
