"""Docker HEALTHCHECK: exit 0 when the service in this container reports SERVING on the
gRPC health service (grpc.health.v1), 1 otherwise. The port is the one of the role's
TARGET_/DRAFT_/ORCHESTRATOR_HEALTH_ADDRESS, else of *_ADDRESS when set, else the defaults (50050, 50051, 50052):
one container runs one role, so whichever answers SERVING is it."""

import os
import sys

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
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    sys.exit(0 if any(serving(port) for port in ports(os.environ)) else 1)
