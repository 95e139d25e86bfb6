"""The target worker under load, over real gRPC: batched steps, admission, queueing.

More concurrent sessions than the worker admits: every call either completes with
output equal to target-only greedy, or is refused at once with RESOURCE_EXHAUSTED
naming the limit; none times out, and no session is corrupted.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from specdec.v1 import common_pb2, target_pb2
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams
from tests.conftest import PROMPTS
from tests.target_worker import serving_target

DEADLINE_S = 60
NUM_TOKENS = 12


def _ids(text: str) -> list[int]:
    return list(text.encode())


@pytest.fixture(scope="module")
def greedy(tiny_target):
    generator = SpeculativeGenerator(tiny_target)
    return lambda ids, n: generator.generate(ids, SamplingParams(max_new_tokens=n), k=0).token_ids


def _generate_by_verify(stub, ids: list[int], drafts: list[int]) -> list[int]:
    """Opens a session and runs NUM_TOKENS tokens through one Verify stream, proposing
    `drafts` (a wrong guess) each round: a speculating session, one round at a time."""
    handle = stub.OpenSession(
        target_pb2.OpenSessionRequest(
            prompt_token_ids=ids, sampling=common_pb2.SamplingParams(max_new_tokens=64)
        ),
        timeout=DEADLINE_S,
    ).handle
    requests: list = []
    ready = threading.Condition()
    output: list[int] = []

    def proposals():
        base_len = len(ids)
        while len(output) < NUM_TOKENS:
            yield target_pb2.Proposal(
                session_id=handle.session_id,
                round=len(requests),
                base_len=base_len,
                draft=target_pb2.Draft(token_ids=drafts),
            )
            requests.append(base_len)
            with ready:
                ready.wait_for(lambda: len(requests) == len(verdicts))
            base_len = verdicts[-1].decision.committed_len

    verdicts: list = []
    try:
        for verdict in stub.Verify(proposals(), timeout=DEADLINE_S):
            decision = verdict.decision
            assert verdict.WhichOneof("kind") == "decision"
            assert (
                decision.step.batch_sessions >= 1 and decision.step.batch_tokens >= len(drafts) + 1
            )
            output.extend([*drafts[: decision.num_accepted], decision.next_token_id])
            with ready:
                verdicts.append(verdict)
                ready.notify_all()
    finally:
        stub.CloseSession(
            common_pb2.CloseSessionRequest(session_id=handle.session_id), timeout=DEADLINE_S
        )
    return output[:NUM_TOKENS]


def test_sessions_share_steps_and_each_equals_target_only(tiny_target, greedy):
    prompts = [_ids(p) for p in PROMPTS[:8]]
    drafts = [[], [1, 2], [200], [3, 3, 3, 3], [], [65], [9, 9], []]
    with serving_target(tiny_target, "target-load", max_running=8, max_queued=0) as stub:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda a: _generate_by_verify(stub, *a), zip(prompts, drafts)))
        info = stub.Info(common_pb2.InfoRequest(), timeout=DEADLINE_S).load
    assert outputs == [greedy(p, NUM_TOKENS) for p in prompts]
    assert info.mean_batch_tokens > 1.0  # steps ran more than one session's token
    assert (info.running_calls, info.queued_calls) == (0, 0)


def test_past_the_queue_calls_are_refused_at_once_and_the_rest_are_exact(tiny_target, greedy):
    """2 running, 2 queued, 10 sessions at once: each is exact or RESOURCE_EXHAUSTED."""
    prompts = [_ids(p) for p in PROMPTS[:10]]
    outcomes: list = [None] * len(prompts)

    def run(index: int) -> None:
        start = time.monotonic()
        try:
            outcomes[index] = _generate_by_verify(stub, prompts[index], [7, 7])
        except grpc.RpcError as error:
            outcomes[index] = (error.code(), error.details(), time.monotonic() - start)

    with serving_target(tiny_target, "target-load", max_running=2, max_queued=2) as stub:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(run, range(len(prompts))))
        # The worker still serves a normal request afterwards, exactly.
        after = _generate_by_verify(stub, prompts[0], [])
        load = stub.Info(common_pb2.InfoRequest(), timeout=DEADLINE_S).load
    refused = [o for o in outcomes if isinstance(o, tuple)]
    completed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, list)]
    assert refused and len(completed) >= 4
    for code, details, seconds in refused:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued=2" in details and "max_running=2" in details
        assert seconds < 5.0  # at once, not after the others' work
    for index, output in completed:
        assert output == greedy(prompts[index], NUM_TOKENS)
    assert after == greedy(prompts[0], NUM_TOKENS)
    assert (load.running_calls, load.queued_calls, load.active_sessions) == (0, 0, 0)


def _queued_behind_a_held_slot(stub, queued_call) -> None:
    """Holds the worker's only running slot with a Verify stream, runs queued_call on a
    thread, waits until the worker reports it queued, then frees the slot and waits for
    the call to finish."""
    first = _ids(PROMPTS[0])
    holder = stub.OpenSession(
        target_pb2.OpenSessionRequest(prompt_token_ids=first), timeout=DEADLINE_S
    ).handle
    release = threading.Event()

    def held_stream():
        yield target_pb2.Proposal(session_id=holder.session_id, base_len=len(first))
        release.wait(DEADLINE_S)

    stream = stub.Verify(held_stream(), timeout=DEADLINE_S)
    next(stream)  # the first stream holds the only slot
    waiter = threading.Thread(target=queued_call)
    waiter.start()
    deadline = time.monotonic() + DEADLINE_S
    while stub.Info(common_pb2.InfoRequest(), timeout=DEADLINE_S).load.queued_calls < 1:
        assert time.monotonic() < deadline, "the call never queued"
        time.sleep(0.01)
    release.set()
    list(stream)
    waiter.join(DEADLINE_S)


def test_a_queued_call_waits_for_the_running_one_then_runs_exactly(tiny_target, greedy):
    """One running slot: a second session's calls wait for the first stream to end,
    then run, exactly."""
    second = _ids(PROMPTS[1])
    result: dict = {}
    with serving_target(tiny_target, "target-load", max_running=1, max_queued=4) as stub:
        _queued_behind_a_held_slot(
            stub, lambda: result.update(output=_generate_by_verify(stub, second, []))
        )
    assert result["output"] == greedy(second, NUM_TOKENS)


def test_a_queued_call_without_a_deadline_waits_for_its_slot(tiny_target):
    """A client that sets no deadline (gRPC reports ~9.2e18 s left) queues like any
    other: it is not refused, and gets its slot once one frees."""
    second = _ids(PROMPTS[1])
    opened: dict = {}
    with serving_target(tiny_target, "target-load", max_running=1, max_queued=1) as stub:
        _queued_behind_a_held_slot(
            stub,
            lambda: opened.update(
                handle=stub.OpenSession(
                    target_pb2.OpenSessionRequest(prompt_token_ids=second)
                ).handle
            ),
        )  # no deadline
    assert opened["handle"].committed_len == len(second)
