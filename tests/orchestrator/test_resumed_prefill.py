"""A failed-over stream's re-prefill is running work on the target that takes it over: it
shares the steps with the sessions decoding there, chunked to the step budget, and is
not held to the prefill share a new prompt is (issue 37: 7 re-prefills at the share's
~15 tokens a step stalled their streams 3.9-6.3 s). The orchestrator marks such a prefill
(`resumes_stream` on OpenSession and Extend) on its failover's re-sync only."""

from __future__ import annotations

import grpc
import pytest

from foundation.pass_cost import PassCost
from model_runtime.batched_forward import Segment
from model_runtime.step_scheduler import StepScheduler, _Job
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Generation
from orchestrator.planning import Plan
from orchestrator.store import SessionRecord, WorkerHandle
from orchestrator.workers import DRAFT, TARGET, Worker, WorkerPool
from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams
from tests.target_worker import serving_target

MS = 1_000_000
DEADLINE_S = 30


def _waiting(
    token_ids: list[int], num_logits: int, fill: bool = False, resumes: bool = False
) -> _Job:
    job = _Job(iter(()), resumes=resumes)
    job.segment = Segment(None, 0, token_ids, num_logits, fill)
    return job


def test_a_resumed_streams_prefill_takes_the_budget_left_not_the_prefill_share():
    """Beside 8 decode steps (30 + 5 each = 70 ms fitted) a new prompt may add half of
    that (35 tokens at 1 ms); a resumed stream's chunk, though it came later, goes first
    and takes all the budget the decoders leave, and the new prompt keeps its share."""
    scheduler = StepScheduler(None, max_batch_tokens=512, prefill_share=0.5)
    try:
        decoding = [_waiting([7], 1) for _ in range(8)]
        new_prompt = _waiting(list(range(200)), 1, fill=True)
        resumed = _waiting(list(range(600)), 1, fill=True, resumes=True)
        scheduler._jobs = [new_prompt, *decoding, resumed]
        scheduler._cost = PassCost(30 * MS, 5 * MS, 1 * MS)
        picked = scheduler._pick()
        assert picked == [*decoding, resumed]  # the budget is spent: the older new prompt waits
        assert resumed.segment.num_tokens == 512 - 8 and resumed.segment.num_logits == 0

        new_prompt = _waiting(list(range(200)), 1, fill=True)
        resumed = _waiting(list(range(100)), 1, fill=True, resumes=True)  # all of it fits
        scheduler._jobs = [*decoding, resumed, new_prompt]
        picked = scheduler._pick()
        assert picked == [*decoding, resumed, new_prompt]
        assert resumed.segment.num_tokens == 100 and new_prompt.segment.num_tokens == 35
    finally:
        scheduler.stop()


@pytest.fixture(scope="module")
def target(tiny_target):
    """A target worker over real gRPC whose scheduler records each job's `resumes`."""
    with serving_target(tiny_target, "target-resume") as stub:
        yield stub


def test_the_target_runs_a_prefill_marked_as_resuming_a_stream_as_such(
    target, tiny_target, monkeypatch
):
    """OpenSession and Extend with resumes_stream submit resumed prefills, without it new
    ones; the resumed session then decodes exactly as target-only."""
    seen = []
    submit = StepScheduler.submit

    def recording_submit(self, steps, key=None, resumes=False):
        seen.append(resumes)
        return submit(self, steps, key, resumes)

    monkeypatch.setattr(StepScheduler, "submit", recording_submit)
    prompt = list(b"The failed-over session resumes here")
    new = target.OpenSession(
        target_pb2.OpenSessionRequest(prompt_token_ids=prompt[:4]), timeout=DEADLINE_S
    )
    handle = target.OpenSession(
        target_pb2.OpenSessionRequest(prompt_token_ids=prompt[:10], resumes_stream=True),
        timeout=DEADLINE_S,
    ).handle
    target.Extend(
        common_pb2.ExtendRequest(
            session_id=handle.session_id, base_len=10, token_ids=prompt[10:], resumes_stream=True
        ),
        timeout=DEADLINE_S,
    )
    assert seen == [False, True, True]
    tokens = [
        t.token_id
        for t in target.Decode(
            target_pb2.DecodeRequest(
                session_id=handle.session_id, base_len=len(prompt), max_tokens=12
            ),
            timeout=DEADLINE_S,
        )
    ]
    expected = (
        SpeculativeGenerator(tiny_target)
        .generate(prompt, SamplingParams(max_new_tokens=12), k=0)
        .token_ids
    )
    assert tokens == expected
    target.CloseSession(
        common_pb2.CloseSessionRequest(session_id=new.handle.session_id), timeout=DEADLINE_S
    )


class Lost(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "stream removed"


class Worker_:
    """A worker stub recording each call with whether it resumed a stream."""

    def __init__(self, name: str):
        self.name, self.calls = name, []

    def Truncate(self, request, timeout, **kwargs):
        self.calls.append(("Truncate", False))
        return common_pb2.TruncateResponse(committed_len=request.length)

    def Extend(self, request, timeout, **kwargs):
        self.calls.append(("Extend", request.resumes_stream))
        return common_pb2.ExtendResponse(committed_len=request.base_len + len(request.token_ids))

    def Info(self, request, timeout):
        return common_pb2.InfoResponse(worker_id=self.name)


def test_only_the_failover_re_sync_marks_the_targets_prefill(monkeypatch):
    """The call's first sync is a new turn (its prefill is the time to first token);
    after a lost stream the re-sync resumes the client's stream: its target Extend
    carries resumes_stream, the draft's not."""
    target, draft = Worker_(TARGET), Worker_(DRAFT)
    generation = Generation(
        OrchestratorConfig(),
        WorkerPool(lambda: [], refresh_s=60),
        None,
        None,
        orchestrator_pb2.GenerateRequest(),
        _Active(),
    )
    generation.placement.target = Worker(
        TARGET, common_pb2.Worker(worker_id=TARGET, address="t:1"), target
    )
    generation.placement.draft = Worker(
        DRAFT, common_pb2.Worker(worker_id=DRAFT, address="d:1"), draft
    )
    record = SessionRecord(
        "s",
        [1, 2, 3],
        target=WorkerHandle(TARGET, "t:1", "ts", 3),
        draft=WorkerHandle(DRAFT, "d:1", "ds", 3, ""),
    )
    plan = Plan(record, [1, 2, 3, 4, 5], 3, SamplingParams(max_new_tokens=8), 4, "", False)
    generation.failover.sync(plan, 3)
    assert ("Extend", False) in target.calls and ("Extend", False) in draft.calls
    target.calls.clear(), draft.calls.clear()

    def rounds(plan):  # the first stream is lost after a round, the next one ends the call
        if not rounds.lost:
            rounds.lost = True
            generation.generated.token_ids.extend([6, 7])
            raise Lost()
        yield [8], 1

    rounds.lost = False
    monkeypatch.setattr(generation.streams, "rounds", rounds)
    assert list(generation.failover.rounds(plan)) == [([8], 1)]
    assert ("Extend", True) in target.calls
    assert not any(resumes for _, resumes in draft.calls)


class _Active:
    def is_active(self):
        return True

    def time_remaining(self):
        return None
