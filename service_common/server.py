"""A gRPC server with what every service needs: the library health service, reflection,
message limits, interceptors, and a graceful stop on SIGTERM."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import logging
import os
import queue
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service_common import telemetry
from service_common.malformed import MalformedRequests
from service_common.security import Tls

log = logging.getLogger(__name__)

# Proposals and prompts are small; 16 MiB bounds a request whatever a client sends
# (a larger one is RESOURCE_EXHAUSTED by gRPC itself).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Proposals are latency-bound: keep connections warm between rounds.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A peer not listening yet (started at the same time, restarting) is tried again at
    # least every half second: gRPC's default backoff grows to 2 minutes, and a channel
    # made before its server listened missed it for minutes after it served.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def create_server(
    address: str,
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    max_workers: int = 64,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: Tls | None = None,
    require_client_auth: bool = True,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Builds (does not start) a server; returns it, the bound port and its health servicer.

    address "host:0" binds a free port (tests). With tls the port speaks only TLS and,
    with require_client_auth, only to clients whose certificate the CA signed.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        # Last: a malformed request is refused inside the others (authenticated, counted
        # and released like any call); they pass its tolerant parse on.
        interceptors=[*interceptors, MalformedRequests()],
        options=message_options(max_message_bytes),
    )
    register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.server_credentials(require_client_auth))
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, port, health_servicer


@contextlib.contextmanager
def port_held(address: str) -> Iterator[None]:
    """Keeps host:port bound (SO_REUSEPORT, not listening) until the server binds it too,
    so that sockets opened meanwhile (tensor-parallel ranks' gloo connections take
    ephemeral ports) cannot take a port chosen before the model loads. Port 0: nothing."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    if not port.isdigit() or int(port) == 0:
        yield
        return
    held = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        held.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEPORT, 1
        )  # gRPC binds with SO_REUSEPORT too
        held.bind((host, int(port)))
    except OSError as error:  # taken already: the server's own bind will say so
        log.debug("could not hold %s: %s", address, error)
    try:
        yield
    finally:
        held.close()


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """CHANNEL_OPTIONS with another limit on the size of a message."""
    return [
        (name, max_message_bytes if name.endswith("_message_length") else value)
        for name, value in CHANNEL_OPTIONS
    ]


def add_health_port(service: Service, address: str) -> int:
    """Serves service's health status, and nothing else, in plaintext on address (for
    probes that cannot do TLS); started and stopped with the service. Returns the port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), options=message_options(64 * 1024)
    )
    health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the health port to {address}")
    service.on_started.append(server.start)
    service.on_stopping.append(lambda: server.stop(None))
    return port


@dataclass
class Service:
    """A built (not started) server with what runs around it: hooks run once it serves
    (e.g. joining a pool), at SIGTERM before calls are drained (e.g. leaving it) and
    after (e.g. stopping helper processes)."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    on_started: list[Callable[[], None]] = field(default_factory=list)
    on_stopping: list[Callable[[], None]] = field(default_factory=list)
    on_stopped: list[Callable[[], None]] = field(default_factory=list)  # once calls are drained

    def start(self) -> None:
        self.server.start()
        for hook in self.on_started:
            hook()

    def stop(self, grace_s: float) -> None:
        """Reports NOT_SERVING, runs the stopping hooks, lets calls in flight finish."""
        self.health.enter_graceful_shutdown()
        for hook in self.on_stopping:
            try:
                hook()
            except Exception:  # noqa: BLE001 - stopping goes on
                log.exception("stopping hook failed")
        self.server.stop(grace_s).wait()
        for hook in self.on_stopped:
            hook()

    def serve_until_signalled(self, grace_s: float) -> None:
        """Runs until SIGTERM/SIGINT, then stops gracefully."""
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        freeze_startup_heap()
        self.start()
        stop.wait()
        log.info("stopping: draining calls for up to %.0f s", grace_s)
        self.stop(grace_s)


def freeze_startup_heap() -> None:
    """Puts what start-up built (the model, the imported libraries: about 390,000
    objects in a SmolLM2-135M target) out of the garbage collector's reach. It lives as
    long as the process, yet each full collection walks all of it: 180-470 ms in the
    target, draft and orchestrator processes, a stalled token or round each time. Full
    collections are rare while serving (CPython runs one once the objects that outlived
    the younger collections reach a quarter of the old heap), but a service runs for
    days. After the freeze a full collection walks only what calls made since: under
    1 ms."""
    gc.collect()
    gc.freeze()


READ_AHEAD = 1  # messages computed ahead of the one being sent
_READ_AHEAD_DONE = object()  # the handler's stream ended
_READ_AHEAD_POLL_S = 0.1  # how often a blocked side checks that the other is still there


def read_ahead(handler: Callable[[object, grpc.ServicerContext], Iterator]) -> Callable:
    """Wraps a server-streaming handler so that it computes its next message while
    gRPC sends the last one: gRPC's sync server asks a handler for its next message
    only once the previous one is sent, so each message of a stream would otherwise
    wait for its predecessor's send (thread hand-offs and a write, about 0.5 ms).
    The handler runs on a thread of its own at most READ_AHEAD messages ahead of the
    wire (backpressure as before); its errors and aborts reach gRPC as if raised on
    gRPC's thread; a cancelled call stops it after the message it is computing.
    Only for handlers whose next message does not depend on the send (and that make
    no outbound calls: gRPC propagates a call's deadline to those per thread)."""

    @functools.wraps(handler)
    def streaming(request, context):
        messages: queue.Queue = queue.Queue(maxsize=READ_AHEAD)
        stop = threading.Event()
        producer = threading.Thread(
            target=contextvars.copy_context().run,
            name="read-ahead",
            daemon=True,
            args=(_produce, handler(request, context), messages, stop, context),
        )
        producer.start()
        try:
            while (item := _next(messages, producer)) is not _READ_AHEAD_DONE:
                if isinstance(item, _Raised):
                    raise item.error
                yield item
        finally:
            stop.set()  # the call ended or was cancelled: the producer stops

    return streaming


@dataclass
class _Raised:
    error: BaseException


def _produce(responses: Iterator, messages: queue.Queue, stop: threading.Event, context) -> None:
    """Runs the handler's stream into `messages`, then its end or error."""
    try:
        for message in responses:
            if not _put(messages, message, stop, context):
                return
        _put(messages, _READ_AHEAD_DONE, stop, context)
    except BaseException as error:  # noqa: BLE001 - raised again on gRPC's thread
        _put(messages, _Raised(error), stop, context)
    finally:
        responses.close()  # the handler's own clean-up (slots, locks), on this thread


def _put(messages: queue.Queue, item, stop: threading.Event, context) -> bool:
    """Queues item, waiting while the queue is full; False once the call is over."""
    while not stop.is_set() and context.is_active():
        try:
            messages.put(item, timeout=_READ_AHEAD_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _next(messages: queue.Queue, producer: threading.Thread):
    """The producer's next item; the end once it stopped without one (the call was
    cancelled while it computed)."""
    while True:
        try:
            return messages.get(timeout=_READ_AHEAD_POLL_S)
        except queue.Empty:
            if not producer.is_alive() and messages.empty():
                return _READ_AHEAD_DONE


def channel(
    address: str, tls: Tls | None = None, credentials: grpc.ChannelCredentials | None = None
) -> grpc.Channel:
    """The one way a client channel is made: plaintext, or TLS with a role's
    certificate (tls) or a client's credentials; its calls carry the trace context when
    tracing is on."""
    options = list(CHANNEL_OPTIONS)
    if tls is not None:
        credentials = tls.channel_credentials()
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
    if credentials is None:
        raw = grpc.insecure_channel(address, options=options)
    else:
        raw = grpc.secure_channel(address, credentials, options=options)
    return telemetry.current().intercept_channel(raw)


def default_worker_id(role: str) -> str:
    """A worker id unique on this host for the process's lifetime."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def advertised_address(configured: str, bind_address: str, port: int) -> str:
    """How other processes reach this one: the configured address, else the bound one
    with the real port and, for a wildcard host, this host's name."""
    if configured:
        return configured
    host = bind_address.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"
