"""Settings every service (or every worker) shares, as flags and PREFIX_* variables like
the rest of its configuration: TelemetryConfig (service_common/telemetry.py) and
RegistryConfig (service_common/registry.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def _option(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass
class TelemetryConfig:
    # Off by default: no provider is installed and instrumentation costs nothing.
    trace_exporter: str = _option(
        "none", "none, otlp (gRPC), jsonl (one span per line to --trace-file) or console"
    )
    trace_file: str = _option("", "path of the JSON-lines span file (trace_exporter jsonl)")
    # Empty = the standard OTEL_EXPORTER_OTLP_ENDPOINT variable, else http://localhost:4317.
    otlp_endpoint: str = _option(
        "", "OTLP gRPC endpoint of a collector, e.g. http://otel-collector:4317"
    )
    # Prometheus text format at http://0.0.0.0:PORT/metrics; 0 = no endpoint.
    metrics_port: int = _option(0, "port of the Prometheus /metrics endpoint; 0 = off")


@dataclass
class RegistryConfig:
    """How a worker joins its pool: a record in Redis that expires unless refreshed."""

    # Empty = no registration (the orchestrator is given worker addresses instead).
    redis_url: str = _option(
        "", "Redis of the worker registry, e.g. redis://redis:6379/0; empty = do not register"
    )
    heartbeat_s: float = _option(1.0, "seconds between heartbeats (load is refreshed with each)")
    # A worker that misses heartbeats for this long leaves its pool.
    heartbeat_ttl_s: float = _option(5.0, "seconds a registration lives without a heartbeat")


@dataclass
class TlsConfig:
    """A role's TLS files (docs/security.md): for its server and its calls to other roles."""

    # All three, or none (plaintext, the default on loopback). With them the server
    # accepts only peers whose certificate the CA signed, and every call to another
    # role presents this role's certificate and trusts only servers the CA signed.
    tls_cert: str = _option(
        "", "PEM file: this role's certificate (chain); with tls_key and tls_ca turns TLS on"
    )
    tls_key: str = _option("", "PEM file: this role's private key")
    tls_ca: str = _option("", "PEM file: the cluster CA that signs every role's certificate")
    # Pods are dialled by IP; a pool's certificates then share one DNS name (e.g.
    # specdec-worker) that callers expect instead of the IP.
    tls_server_name: str = _option(
        "",
        "name expected in the certificates of the servers this role calls; "
        "empty = the host dialled",
    )


@dataclass
class ServerConfig(TlsConfig):
    """What every role's gRPC server shares: TLS, a plaintext health-only port for
    probes, the message size limit."""

    # Kubernetes' gRPC probes present no client certificate: they need a port of their
    # own that serves nothing but grpc.health.v1, in plaintext. Empty = no such port.
    health_address: str = _option(
        "",
        "host:port of a plaintext server with only the gRPC health service "
        "(for probes under TLS); empty = none",
    )
    # Proposals and prompts are small: 16 MiB bounds what one message can make a server
    # hold; a larger one is RESOURCE_EXHAUSTED by gRPC itself.
    max_message_bytes: int = _option(16 * 1024 * 1024, "largest gRPC message received, in bytes")
