"""The Redis session store and the worker registry against a real redis-server."""

from __future__ import annotations

import time

import pytest

from foundation.errors import NotFound
from orchestrator.redis_store import LEASE_KEY, RECORD_KEY, RedisSessionStore
from orchestrator.store import SessionBusy, SessionRecord, WorkerHandle
from service_common.registry import Heartbeat, WorkerRegistry, worker_record
from service_common.status import Unavailable
from specdec.v1 import common_pb2
from tests.polling import holds_for, wait_until

TARGET = common_pb2.WORKER_POOL_TARGET


def _record(session_id="s1") -> SessionRecord:
    return SessionRecord(
        session_id,
        [1, 2, 3],
        target=WorkerHandle("t-1", "127.0.0.1:1", "w-s1", 3),
        messages=[{"role": "user", "content": "hi"}],
        sampling=b"\x08\x01",
    )


@pytest.fixture
def store(redis_server):
    store = RedisSessionStore(redis_server.url, ttl_s=60, lease_ttl_s=3)
    yield store
    store.close()


def test_a_record_round_trips_and_expires_when_idle(redis_server):
    store = RedisSessionStore(redis_server.url, ttl_s=0.5, lease_ttl_s=3)
    record = _record()
    store.put(record)
    assert store.get("s1") == record
    wait_until(
        lambda: not redis_server.client().exists(RECORD_KEY.format("s1")),
        "the idle record expired",
        timeout_s=5,
    )
    with pytest.raises(NotFound, match="'s1' not found"):
        store.get("s1")
    store.close()


def test_a_session_is_leased_by_one_call_at_a_time(store, redis_server):
    store.put(_record())
    other_replica = RedisSessionStore(redis_server.url, ttl_s=60, lease_ttl_s=3)
    with store.lease("s1") as lease:
        with pytest.raises(SessionBusy, match="busy"):
            with other_replica.lease("s1"):
                pass
        record = store.get("s1")
        record.token_ids.append(4)
        store.put(record, lease)
    with other_replica.lease("s1"):  # released: the other replica may take it now
        assert other_replica.get("s1").token_ids == [1, 2, 3, 4]
    other_replica.close()


def test_the_lease_is_renewed_while_a_call_runs(store, redis_server):
    with store.lease("s1") as lease:
        holds_for(
            lambda: (
                (redis_server.client().get(LEASE_KEY.format("s1")) or b"").decode() == lease.token
            ),
            "the lease is ours",
            duration_s=4,
        )  # longer than the 3 s lease TTL
        store.put(_record(), lease)


def test_a_replica_that_lost_its_lease_cannot_save(store, redis_server):
    """Fencing: once another replica took the session over, the late save is refused."""
    store.put(_record())
    with store.lease("s1") as lease:
        redis_server.client().set(LEASE_KEY.format("s1"), "another-replica")
        stale = _record()
        stale.token_ids.append(99)
        with pytest.raises(SessionBusy):
            store.put(stale, lease)
        assert lease.lost
    assert store.get("s1").token_ids == [1, 2, 3]


def test_redis_down_is_unavailable_naming_redis_and_the_store_recovers(store, redis_server):
    record = _record()
    store.put(record)
    redis_server.stop()
    for call in (
        lambda: store.get("s1"),
        lambda: store.put(_record("s2")),
        lambda: store.lease("s1").__enter__(),
    ):
        with pytest.raises(
            Unavailable, match=f"Redis at 127.0.0.1:{redis_server.port} is unavailable"
        ):
            call()
    redis_server.start()
    assert store.get("s1") == record  # persisted across the restart, reconnected by itself


def _info(worker_id: str, active: int = 0) -> common_pb2.InfoResponse:
    return common_pb2.InfoResponse(
        worker_id=worker_id,
        model=common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f"),
        load=common_pb2.WorkerLoad(active_sessions=active, max_sessions=8),
    )


def test_a_worker_is_in_the_registry_while_it_heartbeats(redis_server):
    registry = WorkerRegistry(redis_server.url)
    load = {"active": 0}
    heartbeat = Heartbeat(
        registry,
        lambda: worker_record(TARGET, "127.0.0.1:7", _info("t-1", load["active"])),
        interval_s=0.2,
        ttl_s=1.0,
    )
    heartbeat.start()
    (worker,) = registry.workers()
    assert (worker.worker_id, worker.address, worker.model.model_id) == ("t-1", "127.0.0.1:7", "m")
    load["active"] = 5
    wait_until(
        lambda: registry.workers()[0].load.active_sessions == 5,
        "the load travels with the heartbeat",
    )
    heartbeat.stop()  # a graceful stop withdraws at once
    assert registry.workers() == []


def test_a_worker_that_stops_heartbeating_leaves_within_its_ttl(redis_server):
    registry = WorkerRegistry(redis_server.url)
    registry.announce(worker_record(TARGET, "127.0.0.1:7", _info("t-1")), ttl_s=0.5)
    assert len(registry.workers()) == 1
    wait_until(lambda: registry.workers() == [], "the worker left after its 0.5 s TTL", timeout_s=2)
    assert redis_server.client().zcard("specdec:workers") == 0  # the index is pruned too


def test_heartbeats_ride_out_a_redis_outage(redis_server):
    registry = WorkerRegistry(redis_server.url)
    heartbeat = Heartbeat(
        registry,
        lambda: worker_record(TARGET, "127.0.0.1:7", _info("t-1")),
        interval_s=0.2,
        ttl_s=1.0,
    )
    heartbeat.start()
    redis_server.stop()
    time.sleep(1.5)  # the outage: heartbeats fail meanwhile (logged, not raised)
    redis_server.start()
    wait_until(
        lambda: [w.worker_id for w in registry.workers()] == ["t-1"],
        "the heartbeat re-registered it",
    )
    heartbeat.stop()
