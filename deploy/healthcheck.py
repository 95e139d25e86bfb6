"""Docker HEALTHCHECK: exit 0 when the service in this container reports SERVING on the
gRPC health service (grpc.health.v1), 1 otherwise. The port is the one of the role's
TARGET_/DRAFT_/ORCHESTRATOR_HEALTH_ADDRESS, else of *_ADDRESS when set, else the defaults (50050, 50051, 50052):
one container runs one role, so whichever answers SERVING is it. The HTTP API's container
(HTTP_API_ADDRESS, else port 8000) answers on GET /health instead: 200 once its
orchestrator serves."""

import os
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_PORTS = {"ORCHESTRATOR": 50050, "TARGET": 50051, "DRAFT": 50052}


def ports(environ) -> list[int]:
    # Under TLS the role's own port asks for a client certificate; its plaintext
    # health-only port (*_HEALTH_ADDRESS, docs/security.md) answers this check instead.
    for setting in ("HEALTH_ADDRESS", "ADDRESS"):
        configured = [environ.get(f"{prefix}_{setting}", "") for prefix in DEFAULT_PORTS]
        found = [int(a.rpartition(":")[2]) for a in configured if a.rpartition(":")[2].isdigit()]
        if found:
            return found
    return list(DEFAULT_PORTS.values())


def serving(port: int, timeout_s: float = 2.0) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_port(environ) -> int:
    port = environ.get("HTTP_API_ADDRESS", "").rpartition(":")[2]
    return int(port) if port.isdigit() else 8000


def http_serving(port: int, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout_s) as reply:
            return reply.status == 200
    except OSError:  # refused, or 503 while its orchestrator does not serve
        return False


if __name__ == "__main__":
    if "HTTP_API_ADDRESS" in os.environ or "HTTP_API_ORCHESTRATOR_ADDRESS" in os.environ:
        sys.exit(0 if http_serving(http_port(os.environ)) else 1)
    sys.exit(0 if any(serving(port) for port in ports(os.environ)) else 1)
