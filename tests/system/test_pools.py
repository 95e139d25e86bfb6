"""Pools and failover with real processes and a real redis-server: 2 orchestrator
replicas, 2 draft and 2 target workers (tiny fp32 models), sessions and the worker
registry in Redis. Workers are SIGKILLed mid-stream; Redis is stopped and restarted."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import grpc
import pytest

from specdec.v1 import common_pb2, orchestrator_pb2
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams
from tests.local_system import LocalSystem
from tests.polling import wait_until
from tests.redis_server import RedisServer

HEARTBEAT_S, HEARTBEAT_TTL_S = 0.5, 2.0
PROMPT = [5, 17, 99, 3, 42, 8]  # its greedy continuation runs 88 tokens before end-of-text
TARGET, DRAFT = common_pb2.WORKER_POOL_TARGET, common_pb2.WORKER_POOL_DRAFT


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def pools(redis_server, tmp_path_factory):
    """The system; both orchestrators append their spans to one JSON-lines file."""
    spans = tmp_path_factory.mktemp("spans") / "orchestrators.jsonl"
    settings = {"ORCHESTRATOR_TRACE_EXPORTER": "jsonl", "ORCHESTRATOR_TRACE_FILE": str(spans)}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)  # inherited by the orchestrator processes only (by prefix)
    try:
        with LocalSystem(
            redis_url=redis_server.url,
            orchestrators=2,
            target_workers=2,
            draft_workers=2,
            heartbeat_s=HEARTBEAT_S,
            heartbeat_ttl_s=HEARTBEAT_TTL_S,
        ) as system:
            system.spans = spans
            _wait_for_workers(system, targets=2, drafts=2)
            yield system
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def _workers(stub) -> list[common_pb2.Worker]:
    return list(stub.ListWorkers(orchestrator_pb2.ListWorkersRequest(), timeout=10).workers)


def _wait_for_workers(system, targets: int, drafts: int, timeout_s: float = 30.0) -> None:
    """Until both replicas see exactly that many workers in each pool."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = [[w.pool for w in _workers(system.orchestrator(i))] for i in (0, 1)]
        if all((v.count(TARGET), v.count(DRAFT)) == (targets, drafts) for v in views):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"pools seen by the replicas: {views}, wanted {targets} targets, {drafts} drafts"
            )
        time.sleep(0.2)


def _request(ids=(), session_id="", max_new_tokens=200, drafter="model", k=4):
    request = orchestrator_pb2.GenerateRequest(session_id=session_id, include_stats=True)
    request.token_ids.ids.extend(ids)
    request.sampling.max_new_tokens = max_new_tokens
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=k, drafter=drafter)
    )
    return request


def _reference(tiny_target, ids, max_new_tokens=200):
    params = SamplingParams(
        max_new_tokens=max_new_tokens, stop_token_ids=(tiny_target.eos_token_id,)
    )
    return SpeculativeGenerator(tiny_target).generate(list(ids), params, k=0).token_ids


def _open_session(stub) -> tuple[str, list[int], orchestrator_pb2.Session]:
    """A session placed on workers by a first short turn: its id, committed tokens and
    description (which workers hold it)."""
    first = stub.Generate(_request(PROMPT[:3], max_new_tokens=2), timeout=30)
    session = stub.GetSession(
        orchestrator_pb2.GetSessionRequest(session_id=first.session_id), timeout=10
    )
    return first.session_id, [*PROMPT[:3], *first.token_ids], session


def _stream_killing(
    system, stub, request, victim: str
) -> tuple[list[int], common_pb2.GenerationStats]:
    """Streams request; SIGKILLs the victim process once the first tokens arrived."""
    tokens, stats = [], None
    for chunk in stub.GenerateStream(request, timeout=60):
        tokens.extend(chunk.token_ids)
        if tokens and system.process(victim).poll() is None:
            os.kill(system.process(victim).pid, signal.SIGKILL)
        if chunk.HasField("stats"):
            stats = chunk.stats
    return tokens, stats


def test_a_session_created_on_one_replica_continues_on_the_other(pools, tiny_target):
    first = pools.orchestrator(0).Generate(_request(PROMPT, max_new_tokens=12), timeout=30)
    second = pools.orchestrator(1).Generate(
        _request(PROMPT[:2], session_id=first.session_id, max_new_tokens=12), timeout=30
    )
    assert list(first.token_ids) == _reference(tiny_target, PROMPT, 12)
    history = [*PROMPT, *first.token_ids, *PROMPT[:2]]
    assert list(second.token_ids) == _reference(tiny_target, history, 12)
    assert second.stats.num_prefill_tokens == 2  # the caches were reused, not recomputed
    session = pools.orchestrator(0).GetSession(
        orchestrator_pb2.GetSessionRequest(session_id=first.session_id)
    )
    assert session.num_committed_tokens == len(history) + len(second.token_ids)


def test_32_concurrent_sessions_spread_over_both_targets(pools, tiny_target):
    def generate(index: int):
        stub = pools.orchestrator(index % 2)
        return stub.Generate(
            _request([index + 1, *PROMPT], max_new_tokens=8, drafter="ngram"), timeout=60
        )

    with concurrent.futures.ThreadPoolExecutor(32) as executor:
        responses = list(executor.map(generate, range(32)))
    for index, response in enumerate(responses):
        assert list(response.token_ids) == _reference(tiny_target, [index + 1, *PROMPT], 8)
    placed = [
        pools.orchestrator(0)
        .GetSession(orchestrator_pb2.GetSessionRequest(session_id=r.session_id))
        .target
        for r in responses
    ]
    per_target = {
        a: sum(p.worker_address == a for p in placed) for a in {p.worker_address for p in placed}
    }
    assert len(per_target) == 2 and min(per_target.values()) >= 8, per_target

    def registry_load():  # the next heartbeats carry the load to the registry
        return {w.address: w.load.active_sessions for w in _workers(pools.stub) if w.pool == TARGET}

    wait_until(
        lambda: all(registry_load().get(a, 0) >= count for a, count in per_target.items()),
        f"the registry shows at least {per_target} sessions",
    )
    for response in responses:
        pools.stub.CloseSession(
            common_pb2.CloseSessionRequest(session_id=response.session_id), timeout=10
        )


@pytest.mark.parametrize("pool", ["draft", "target"])
def test_sigkill_of_the_serving_worker_mid_stream_loses_no_token(pools, tiny_target, pool):
    session_id, history, session = _open_session(pools.orchestrator(0))
    handle = session.draft if pool == "draft" else session.target
    victim = pools.role(handle.worker_address).name
    request = _request(PROMPT[3:], session_id=session_id)
    tokens, stats = _stream_killing(pools, pools.orchestrator(1), request, victim)
    try:
        # none lost, none repeated
        assert tokens == _reference(tiny_target, [*history, *PROMPT[3:]])
        assert stats.num_failovers >= 1, "the worker was killed after the generation ended"
        after = pools.stub.GetSession(
            orchestrator_pb2.GetSessionRequest(session_id=session_id), timeout=10
        )
        moved = after.draft if pool == "draft" else after.target
        assert moved.worker_address != handle.worker_address
        assert after.num_committed_tokens == len(history) + len(PROMPT[3:]) + len(tokens)
        lost = f"{pool}:{handle.worker_address}"
        assert _wait_for_span(
            pools.spans, "specdec.failover", lambda a: lost in a["specdec.lost"]
        ), f"no failover span naming {lost}"
    finally:
        pools.restart(victim)
        _wait_for_workers(pools, targets=2, drafts=2)


def _wait_for_span(path, name: str, matches, timeout_s: float = 15.0) -> bool:
    """Whether a span of that name whose attributes match shows up (spans are exported
    in batches, a few seconds late)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                span = json.loads(line)
                if span["name"] == name and matches(span["attributes"]):
                    return True
        time.sleep(0.5)
    return False


def test_a_worker_that_stops_heartbeating_leaves_the_pool_within_its_ttl(pools):
    victim = next(r for r in pools.roles if r.pool == "draft")
    process = pools.process(victim.name)
    process.send_signal(signal.SIGSTOP)  # hung: no heartbeat, no withdrawal
    try:
        stopped = time.monotonic()
        while victim.address in {w.address for w in _workers(pools.stub)}:
            assert time.monotonic() - stopped < HEARTBEAT_TTL_S + 2.0, (
                "still in the pool after its TTL"
            )
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGCONT)
    _wait_for_workers(pools, targets=2, drafts=2)  # it heartbeats again: back in the pool


def test_redis_outage_fails_requests_cleanly_and_sessions_survive(pools, redis_server, tiny_target):
    first = pools.stub.Generate(_request(PROMPT, max_new_tokens=10), timeout=30)
    redis_server.stop()
    try:
        for index in (0, 1):
            with pytest.raises(grpc.RpcError) as error:
                pools.orchestrator(index).Generate(
                    _request(PROMPT[:2], session_id=first.session_id), timeout=30
                )
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"Redis at 127.0.0.1:{redis_server.port} is unavailable" in error.value.details()
    finally:
        redis_server.start()
    second = _retry_until_served(
        lambda: pools.orchestrator(1).Generate(
            _request(PROMPT[:2], session_id=first.session_id, max_new_tokens=10), timeout=30
        )
    )
    history = [*PROMPT, *first.token_ids, *PROMPT[:2]]
    assert list(second.token_ids) == _reference(tiny_target, history, 10)  # the session was intact


def _retry_until_served(call, timeout_s: float = 20.0):
    """Later requests succeed once the workers have heartbeated into Redis again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_redis_down_at_start_is_unavailable_until_it_comes_up(tiny_target):
    redis_server = RedisServer()  # not started yet
    try:
        with LocalSystem(
            redis_url=redis_server.url, heartbeat_s=HEARTBEAT_S, heartbeat_ttl_s=HEARTBEAT_TTL_S
        ) as system:
            with pytest.raises(grpc.RpcError) as error:
                system.stub.Generate(_request(PROMPT, max_new_tokens=10), timeout=30)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"Redis at 127.0.0.1:{redis_server.port} is unavailable" in error.value.details()
            redis_server.start()
            response = _retry_until_served(
                lambda: system.stub.Generate(_request(PROMPT, max_new_tokens=10), timeout=30)
            )
            assert list(response.token_ids) == _reference(tiny_target, PROMPT, 10)
    finally:
        redis_server.cleanup()
