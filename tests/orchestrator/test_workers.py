"""Placement reads queueing and batch occupancy, not session counts alone."""

from __future__ import annotations

from orchestrator.workers import TARGET, Worker, WorkerPool
from specdec.v1 import common_pb2


def _target(address: str, **load) -> Worker:
    record = common_pb2.Worker(
        pool=common_pb2.WORKER_POOL_TARGET,
        worker_id=address,
        address=address,
        load=common_pb2.WorkerLoad(max_sessions=64, **load),
    )
    return Worker(TARGET, record, stub=None)


def test_a_target_with_a_queue_is_fuller_than_one_with_more_idle_sessions():
    pool = WorkerPool(discover=lambda: [], refresh_s=60)
    idle_sessions = _target("a:1", active_sessions=40, running_calls=2, max_running=32)
    queueing = _target("b:1", active_sessions=8, running_calls=32, queued_calls=10, max_running=32)
    assert pool.load(queueing) > 1.0 > pool.load(idle_sessions)
    assert pool.least_loaded([queueing, idle_sessions]) is idle_sessions


def test_calls_placed_by_this_replica_count_before_the_next_heartbeat():
    pool = WorkerPool(discover=lambda: [], refresh_s=60)
    a, b = (
        _target("a:1", running_calls=3, max_running=4),
        _target("b:1", running_calls=0, max_running=4),
    )
    with pool.placed(b), pool.placed(b), pool.placed(b), pool.placed(b):
        assert pool.load(b) == 1.0 > pool.load(a)
        assert pool.least_loaded([a, b]) is a


def test_a_worker_that_reports_no_admission_is_placed_by_sessions():
    pool = WorkerPool(discover=lambda: [], refresh_s=60)
    assert pool.load(_target("a:1", active_sessions=16)) == 0.25
