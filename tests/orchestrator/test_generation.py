"""Unit tests of how a Generation brings a worker session to the committed tokens (fake
worker stubs recording calls; the real services are exercised in test_system/test_pools)."""

from __future__ import annotations

import grpc

from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Generation
from orchestrator.planning import Plan
from orchestrator.store import SessionRecord, WorkerHandle
from orchestrator.workers import DRAFT, TARGET, Worker, WorkerPool
from specdec.v1 import common_pb2, draft_pb2, orchestrator_pb2, target_pb2
from speculative.sampling import SamplingParams


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class FakeWorker:
    """Records calls; `fail_extend` fails that many Extend calls with UNAVAILABLE."""

    def __init__(self, name: str, fail_extend: int = 0):
        self.name, self.fail_extend, self.calls = name, fail_extend, []

    def Truncate(self, request, timeout):
        self.calls.append(("Truncate", request.length))
        return common_pb2.TruncateResponse(committed_len=request.length)

    def Extend(self, request, timeout):
        self.calls.append(("Extend", request.base_len, len(request.token_ids)))
        if self.fail_extend:
            self.fail_extend -= 1
            raise Unavailable()
        return common_pb2.ExtendResponse(committed_len=request.base_len + len(request.token_ids))

    def OpenSession(self, request, timeout):
        self.calls.append(("OpenSession", len(request.prompt_token_ids)))
        handle = common_pb2.KvHandle(
            worker_id=self.name, session_id="new", committed_len=len(request.prompt_token_ids)
        )
        response = (
            target_pb2.OpenSessionResponse
            if self.name == TARGET
            else draft_pb2.DraftOpenSessionResponse
        )
        return response(handle=handle)

    def Info(self, request, timeout):
        return common_pb2.InfoResponse(worker_id=self.name)


class Context:
    def is_active(self):
        return True

    def time_remaining(self):
        return None  # no client deadline


def _worker(pool: str, stub: FakeWorker) -> Worker:
    return Worker(pool, common_pb2.Worker(worker_id=pool, address=f"{pool}:1"), stub)


def _generation() -> Generation:
    pool = WorkerPool(lambda: [], refresh_s=60)
    return Generation(
        OrchestratorConfig(), pool, None, None, orchestrator_pb2.GenerateRequest(), Context()
    )


def _plan(record: SessionRecord, tokens: list[int], keep: int) -> Plan:
    return Plan(record, tokens, keep, SamplingParams(max_new_tokens=8), 4, "", False)


def test_a_session_sharing_no_token_is_reopened_not_truncated_to_zero():
    generation, target = _generation(), FakeWorker(TARGET)
    handle = WorkerHandle(TARGET, "target:1", "old", committed_len=3)
    plan = _plan(SessionRecord("s", []), [7, 8, 9, 10], 0)
    new = generation.placer.sync_worker(_worker(TARGET, target), handle, [7, 8, 9, 10], 0, plan)
    assert target.calls == [("OpenSession", 4)]
    assert (new.session_id, new.committed_len) == ("new", 4)


def test_a_retry_after_a_failed_sync_does_not_redo_the_synced_worker():
    """The target is synced, the draft's Extend fails once (its channel reconnecting);
    the retry syncs the draft only, from the same shared prefix."""
    generation = _generation()
    target, draft = FakeWorker(TARGET), FakeWorker(DRAFT, fail_extend=1)
    generation.placement.target = _worker(TARGET, target)
    generation.placement.draft = _worker(DRAFT, draft)
    record = SessionRecord(
        "s",
        [1, 2, 3],
        target=WorkerHandle(TARGET, "target:1", "t", 3),
        draft=WorkerHandle(DRAFT, "draft:1", "d", 3),
    )
    generation.failover.sync(_plan(record, [1, 2, 3, 4, 5], 3), 3)
    assert target.calls == [("Truncate", 3), ("Extend", 3, 2)]
    assert draft.calls == [("Truncate", 3), ("Extend", 3, 2), ("Truncate", 3), ("Extend", 3, 2)]
    assert generation.stats.num_failovers == 1 and generation.placement.synced_len == 5
    assert record.target.committed_len == record.draft.committed_len == 5
