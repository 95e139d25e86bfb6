"""A target worker in the test process, on a real socket: its gRPC stub, stopped after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from specdec.v1 import target_pb2_grpc
from target_service.config import TargetConfig
from target_service.server import create_server


@contextlib.contextmanager
def target_channel(loaded, worker_id: str, **config) -> Iterator[grpc.Channel]:
    """A target worker serving `loaded` (a model_runtime LoadedModel) on 127.0.0.1, any free
    port: a channel to it (for its health and reflection services too)."""
    service = create_server(
        TargetConfig(address="127.0.0.1:0", worker_id=worker_id, **config), loaded
    )
    service.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield channel
    finally:
        channel.close()
        service.server.stop(None)


@contextlib.contextmanager
def serving_target(loaded, worker_id: str, **config) -> Iterator[target_pb2_grpc.TargetServiceStub]:
    """`target_channel`'s worker, as its TargetService stub."""
    with target_channel(loaded, worker_id, **config) as channel:
        yield target_pb2_grpc.TargetServiceStub(channel)
