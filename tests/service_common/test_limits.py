"""Every limit of the public API, each a setting, each refused with a precise status
that names it: over real gRPC on loopback, the real orchestrator (API keys on) in front
of a scripted target that decodes one token every DECODE_DELAY_S (a call held in
flight for as long as a test needs it).
"""

from __future__ import annotations

import contextlib
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from foundation.errors import ResourceExhausted
from orchestrator.config import OrchestratorConfig
from orchestrator.server import create_server as create_orchestrator
from service_common import auth
from service_common.limits import CallLimits
from service_common.server import channel
from specdec.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from tests.scripted_target import BookkeepingTarget

INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
DECODE_DELAY_S = 0.05


class SlowTarget(BookkeepingTarget):
    """Decodes token 7 every DECODE_DELAY_S; the rest is bookkeeping that answers at once."""

    name, context_length = "slow", 4096

    def Decode(self, request, context):
        for index in range(request.sampling.max_new_tokens):
            time.sleep(DECODE_DELAY_S)
            yield target_pb2.DecodeToken(
                token_id=7, committed_len=request.base_len + index + 1, compute_ns=1000
            )


@pytest.fixture(scope="module")
def target():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    target_pb2_grpc.add_TargetServiceServicer_to_server(SlowTarget(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    alice, bob = auth.new_key(), auth.new_key()
    path.write_text(f"alice {auth.hash_key(alice)}\nbob {auth.hash_key(bob)}\n")
    return {
        "path": str(path),
        "alice": [("authorization", f"Bearer {alice}")],
        "bob": [("authorization", f"Bearer {bob}")],
    }


@pytest.fixture
def orchestrator(target, keys, tiny_target):
    """start(**settings) -> a stub of an orchestrator with those settings (stopped after the test)."""
    with contextlib.ExitStack() as stack:

        def start(**settings) -> orchestrator_pb2_grpc.OrchestratorStub:
            config = OrchestratorConfig(
                address="127.0.0.1:0",
                target_addresses=target,
                api_keys_file=keys["path"],
                **settings,
            )
            service = create_orchestrator(config, tokenizer=tiny_target.tokenizer)
            service.start()
            stack.callback(service.stop, 0)
            stub = orchestrator_pb2_grpc.OrchestratorStub(
                stack.enter_context(channel(f"127.0.0.1:{service.port}"))
            )
            stub.address = f"127.0.0.1:{service.port}"
            return stub

        yield start


def _generate(ids=(5, 6, 7), max_new_tokens=2, session_id="", stop=(), text=None):
    request = orchestrator_pb2.GenerateRequest(session_id=session_id, stop=list(stop))
    if text is not None:
        request.text = text
    else:
        request.token_ids.ids.extend(ids)
    request.sampling.max_new_tokens = max_new_tokens
    request.speculation.num_speculative_tokens = 0
    return request


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value.code(), refused.value.details()


def _held_stream(stub, metadata):
    """A GenerateStream in flight (it decodes for minutes) once its first chunk is read."""
    stream = stub.GenerateStream(_generate(max_new_tokens=4000), timeout=120, metadata=metadata)
    next(stream)
    return stream


def _served_again(call, timeout_s: float = 10.0):
    """call()'s answer once it is no longer refused (a cancelled call's slot is freed as
    its handler winds down)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            assert error.code() == EXHAUSTED and time.monotonic() < deadline, error
            time.sleep(0.05)


def test_prompt_tokens(orchestrator, keys):
    stub = orchestrator(max_prompt_tokens=8)
    alice = keys["alice"]
    session = stub.Generate(
        _generate(ids=range(1, 7)), timeout=30, metadata=alice
    ).session_id  # 6 + 2 = 8 tokens
    code, details = _refused(
        lambda: stub.Generate(_generate(ids=range(1, 10)), timeout=30, metadata=alice)
    )
    assert (
        code == INVALID
        and "prompt of 9 tokens is above the limit of 8 tokens (max_prompt_tokens" in details
    )
    # A continued session's history counts: 8 held + 1 new.
    code, details = _refused(
        lambda: stub.Generate(_generate(ids=[3], session_id=session), timeout=30, metadata=alice)
    )
    assert code == INVALID and "prompt of 9 tokens" in details


def test_max_new_tokens(orchestrator, keys):
    stub = orchestrator(max_new_tokens_limit=16)
    alice = keys["alice"]
    assert (
        len(stub.Generate(_generate(max_new_tokens=16), timeout=30, metadata=alice).token_ids) == 16
    )
    expected = (INVALID, "max_new_tokens 17 is above the limit of 16 (max_new_tokens_limit)")
    assert (
        _refused(lambda: stub.Generate(_generate(max_new_tokens=17), timeout=30, metadata=alice))
        == expected
    )
    create = orchestrator_pb2.CreateSessionRequest(
        sampling=common_pb2.SamplingParams(max_new_tokens=17)
    )
    assert _refused(lambda: stub.CreateSession(create, timeout=30, metadata=alice)) == expected


def test_stop_strings(orchestrator, keys):
    stub = orchestrator(max_stop_strings=2, max_stop_string_chars=8)
    alice = keys["alice"]
    stub.Generate(_generate(stop=["ab", "12345678"]), timeout=30, metadata=alice)
    code, details = _refused(
        lambda: stub.Generate(_generate(stop=["a", "b", "c"]), timeout=30, metadata=alice)
    )
    assert code == INVALID and "at most 2 stop strings (max_stop_strings), got 3" in details
    code, details = _refused(
        lambda: stub.Generate(_generate(stop=["123456789"]), timeout=30, metadata=alice)
    )
    assert code == INVALID and "1 to 8 characters (max_stop_string_chars), got 9" in details


def test_message_size(orchestrator, keys):
    stub = orchestrator(max_message_bytes=64 * 1024)
    code, details = _refused(
        lambda: stub.Generate(_generate(text="x" * 100_000), timeout=30, metadata=keys["alice"])
    )
    assert code == EXHAUSTED and "65536" in details
    stub.Generate(
        _generate(text="x" * 1000, max_new_tokens=1), timeout=30, metadata=keys["alice"]
    )  # still serving


def test_sessions_per_key(orchestrator, keys):
    stub = orchestrator(max_sessions_per_key=2)
    alice, bob = keys["alice"], keys["bob"]
    first = stub.Generate(_generate(), timeout=30, metadata=alice).session_id
    stub.CreateSession(orchestrator_pb2.CreateSessionRequest(), timeout=30, metadata=alice)
    expected = (
        EXHAUSTED,
        "API key 'alice' holds 2 sessions, its limit (max_sessions_per_key=2); "
        "close some (CloseSession) or let them expire",
    )
    assert _refused(lambda: stub.Generate(_generate(), timeout=30, metadata=alice)) == expected
    assert (
        _refused(
            lambda: stub.CreateSession(
                orchestrator_pb2.CreateSessionRequest(), timeout=30, metadata=alice
            )
        )
        == expected
    )
    stub.Generate(_generate(session_id=first), timeout=30, metadata=alice)  # her sessions go on
    stub.Generate(_generate(), timeout=30, metadata=bob)  # another key has its own count
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=first), timeout=30, metadata=alice)
    stub.Generate(_generate(), timeout=30, metadata=alice)


def test_concurrent_calls_per_key(orchestrator, keys):
    stub = orchestrator(max_calls_per_key=1)
    alice, bob = keys["alice"], keys["bob"]
    stream = _held_stream(stub, alice)
    code, details = _refused(lambda: stub.Generate(_generate(), timeout=30, metadata=alice))
    assert (
        code == EXHAUSTED
        and "API key 'alice' has 1 calls in flight, its limit (max_calls_per_key=1)" in details
    )
    stub.Generate(_generate(), timeout=30, metadata=bob)
    stream.cancel()
    _served_again(lambda: stub.Generate(_generate(), timeout=30, metadata=alice))


def test_concurrent_calls_per_server_never_block_health(orchestrator, keys):
    stub = orchestrator(max_concurrent_calls=1)
    stream = _held_stream(stub, keys["alice"])
    code, details = _refused(lambda: stub.Generate(_generate(), timeout=30, metadata=keys["bob"]))
    assert (code, details) == (
        EXHAUSTED,
        "server is at its limit of 1 calls in flight (max_concurrent_calls); retry later",
    )
    with channel(stub.address) as health_channel:
        reply = health_pb2_grpc.HealthStub(health_channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stream.cancel()
    _served_again(lambda: stub.Generate(_generate(), timeout=30, metadata=keys["bob"]))


def test_rate_limit_per_key(orchestrator, keys):
    stub = orchestrator(rate_limit_per_s=0.2, rate_limit_burst=2)
    list_workers = orchestrator_pb2.ListWorkersRequest()
    for _ in range(2):
        stub.ListWorkers(list_workers, timeout=10, metadata=keys["alice"])
    code, details = _refused(
        lambda: stub.ListWorkers(list_workers, timeout=10, metadata=keys["alice"])
    )
    assert code == EXHAUSTED
    assert (
        "API key 'alice' is over its rate limit of 0.2 calls/s with bursts of 2 (rate_limit_per_s"
        in details
    )
    stub.ListWorkers(list_workers, timeout=10, metadata=keys["bob"])


def test_call_limits_count_and_refill():
    now = [0.0]
    limits = CallLimits(
        max_calls=3, max_calls_per_key=2, rate_per_s=1.0, burst=2, clock=lambda: now[0]
    )
    limits.admit("a")
    limits.admit("a")
    with pytest.raises(
        ResourceExhausted, match="rate limit of 1 calls/s with bursts of 2 .*retry in 1.00 s"
    ):
        limits.admit("a")  # the burst is spent
    now[0] = 5.0  # the bucket is full again, but two calls are in flight
    with pytest.raises(ResourceExhausted, match="max_calls_per_key=2"):
        limits.admit("a")
    limits.admit("")  # anonymous: only the server's bound
    with pytest.raises(ResourceExhausted, match="max_concurrent_calls"):
        limits.admit("b")
    limits.release("a")
    limits.admit("b")
    assert (limits.in_flight(), limits.in_flight("a"), limits.in_flight("b")) == (3, 1, 1)
