"""benchmarks.delay_proxy: a round trip through it takes at least 2 * delay, bytes arrive
intact and in order, and the delay is latency, not a throttle; `delayed` puts one in
front of each target of a launcher layout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from benchmarks.delay_proxy import DelayProxy, delayed
from launcher.cluster import layout, parse_args

REPO = Path(__file__).resolve().parents[2]
DELAY_MS = 40


@pytest.fixture
def echo_server():
    """A TCP echo server on a thread; yields its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    stopping = threading.Event()

    def serve_one(connection: socket.socket) -> None:
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data)

    def accept() -> None:
        while not stopping.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stopping.set()
    listener.close()


def _recv_exactly(connection: socket.socket, size: int) -> bytes:
    parts, received = [], 0
    while received < size:
        part = connection.recv(min(65536, size - received))
        assert part, "connection closed early"
        parts.append(part)
        received += len(part)
    return b"".join(parts)


def test_round_trip_takes_twice_the_delay_and_data_is_intact(echo_server):
    with (
        DelayProxy(echo_server, DELAY_MS) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as conn,
    ):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        round_trips = []
        for _ in range(5):
            start = time.perf_counter()
            conn.sendall(b"ping")
            assert _recv_exactly(conn, 4) == b"ping"
            round_trips.append(time.perf_counter() - start)
        assert min(round_trips) >= 2 * DELAY_MS / 1000
        assert sorted(round_trips)[2] < 2 * DELAY_MS / 1000 + 0.2  # and not much more (median)

        payload = os.urandom(3 * 1024 * 1024)  # many chunks, both directions at once
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        assert _recv_exactly(conn, len(payload)) == payload
        sender.join()


def test_delay_is_latency_not_a_throttle(echo_server):
    """50 small messages sent back to back come back about one round trip later, not 50."""
    with (
        DelayProxy(echo_server, DELAY_MS) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as conn,
    ):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        messages = [f"{i:04d}".encode() for i in range(50)]
        start = time.perf_counter()
        for message in messages:
            conn.sendall(message)
            time.sleep(0.001)  # separate chunks
        assert _recv_exactly(conn, 200) == b"".join(messages)
        elapsed = time.perf_counter() - start
        assert 2 * DELAY_MS / 1000 <= elapsed < 10 * DELAY_MS / 1000


def test_grpc_through_the_proxy():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with (
            DelayProxy(f"127.0.0.1:{port}", DELAY_MS) as proxy,
            grpc.insecure_channel(proxy.address) as channel,
        ):
            stub = health_pb2_grpc.HealthStub(channel)
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connect (several round trips)
            round_trips = []
            for _ in range(3):
                start = time.perf_counter()
                assert (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                    == health_pb2.HealthCheckResponse.SERVING
                )
                round_trips.append(time.perf_counter() - start)
            assert min(round_trips) >= 2 * DELAY_MS / 1000
    finally:
        server.stop(None)


def test_command_line(echo_server):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.delay_proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            echo_server,
            "--delay-ms",
            "5",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert "listening on 127.0.0.1:" in line
        port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"hello")
            assert _recv_exactly(conn, 5) == b"hello"
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="delay_ms"):
        DelayProxy("127.0.0.1:1", -1)
    with pytest.raises(ValueError, match="host:port"):
        DelayProxy("nohost", 1)


def test_delayed_puts_a_proxy_in_front_of_each_target():
    args = parse_args(["--target-workers", "2", "--http-port", "-1", "--port", "0"])
    roles = layout(args)
    targets = {r.name: r.address for r in roles if r.pool == "target"}
    out = delayed(roles, 5)
    proxies = {r.name.removesuffix("-delay"): r for r in out if r.pool == "proxy"}
    assert [r.pool for r in out][:2] == ["proxy", "target"] and set(proxies) == set(targets)
    orchestrator = next(r for r in out if r.pool == "orchestrator")
    listed = orchestrator.args[orchestrator.args.index("--target-addresses") + 1].split(",")
    for name, address in targets.items():
        proxy, target = proxies[name], next(r for r in out if r.name == name)
        assert proxy.args[proxy.args.index("--upstream") + 1] == address  # the real one
        assert target.args[target.args.index("--address") + 1] == address
        assert target.address == proxy.address in listed  # everyone goes through the proxy
        assert target.args[target.args.index("--advertise-address") + 1] == proxy.address
    unchanged = layout(args)
    assert delayed(unchanged, 0) is unchanged  # no delay, no proxy
