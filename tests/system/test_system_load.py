"""More concurrent sessions than the target admits, through the whole system (separate
processes): every request either completes with output equal to target-only greedy or
is refused at once with RESOURCE_EXHAUSTED; none times out; every completed session
continues exactly afterwards."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from specdec.v1 import common_pb2, orchestrator_pb2
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams
from tests.conftest import PROMPTS
from tests.local_system import LocalSystem

MAX_RUNNING, MAX_QUEUED = 2, 2
NUM_SESSIONS = 10
NUM_TOKENS = 16
DEADLINE_S = 120


@pytest.fixture(scope="module")
def system():
    """A target that runs 2 calls and queues 2 (the settings reach the target process
    through its environment)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TARGET_MAX_RUNNING", str(MAX_RUNNING))
        patch.setenv("TARGET_MAX_QUEUED", str(MAX_QUEUED))
        with LocalSystem() as local:
            yield local


@pytest.fixture(scope="module")
def greedy(tiny_target):
    """Target-only greedy, ending at end-of-text as the orchestrator does."""
    generator = SpeculativeGenerator(tiny_target)
    params = SamplingParams(max_new_tokens=NUM_TOKENS, stop_token_ids=(tiny_target.eos_token_id,))
    return lambda ids: generator.generate(ids, params, k=0).token_ids


def _generate(stub, ids: list[int], k: int, session_id: str = ""):
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=ids),
        session_id=session_id,
        sampling=common_pb2.SamplingParams(max_new_tokens=NUM_TOKENS),
        speculation=common_pb2.SpeculationParams(num_speculative_tokens=k),
    )
    return stub.Generate(request, timeout=DEADLINE_S)


def test_every_request_completes_exactly_or_is_refused_at_once(system, greedy):
    prompts = [list(p.encode()) for p in PROMPTS[:NUM_SESSIONS]]
    ks = [0, 4, 2, 0, 4, 1, 0, 4, 3, 0]

    def run(index: int):
        start = time.monotonic()
        try:
            return _generate(system.stub, prompts[index], ks[index])
        except grpc.RpcError as error:
            return error.code(), error.details(), time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(NUM_SESSIONS) as pool:
        outcomes = list(pool.map(run, range(NUM_SESSIONS)))
    completed = [(i, o) for i, o in enumerate(outcomes) if not isinstance(o, tuple)]
    refused = [o for o in outcomes if isinstance(o, tuple)]
    assert len(completed) >= MAX_RUNNING + MAX_QUEUED, system.logs()
    for code, details, seconds in refused:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert f"max_running={MAX_RUNNING}" in details and f"max_queued={MAX_QUEUED}" in details
        assert seconds < 10.0  # at once, not after the others' work
    for index, response in completed:
        assert list(response.token_ids) == greedy(prompts[index])
    # No session was corrupted: each completed one continues exactly, one at a time.
    for index, response in completed:
        more = _generate(system.stub, [10], ks[index], session_id=response.session_id)
        history = prompts[index] + list(response.token_ids) + [10]
        assert list(more.token_ids) == greedy(history)
