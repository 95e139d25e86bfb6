"""The three services as separate processes over loopback gRPC, tiny fp32 models.

Target: tiny-random:1. Draft worker: tiny-random:2 as its "model" drafter (mostly
rejected), and the n-gram drafter. Outputs are compared token for token with the
in-process target-only reference.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from specdec.v1 import common_pb2, orchestrator_pb2
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams
from tests.local_system import LocalSystem

MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def system():
    with LocalSystem() as local:
        yield local


def _request(
    ids=None,
    k=4,
    drafter="ngram",
    max_new_tokens=MAX_NEW_TOKENS,
    session_id="",
    draft=None,
    **sampling,
):
    """draft: the draft worker's settings a request overrides (prompt_lookup_min, draft_top_k, ...)."""
    request = orchestrator_pb2.GenerateRequest(session_id=session_id, include_stats=True)
    if ids is not None:
        request.token_ids.ids.extend(ids)
    request.sampling.CopyFrom(common_pb2.SamplingParams(max_new_tokens=max_new_tokens, **sampling))
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=k, drafter=drafter, **(draft or {}))
    )
    return request


def _reference(tiny_target, ids, max_new_tokens=MAX_NEW_TOKENS):
    """Target-only greedy; the orchestrator always stops at the end-of-text token."""
    params = SamplingParams(
        max_new_tokens=max_new_tokens, stop_token_ids=(tiny_target.eos_token_id,)
    )
    return SpeculativeGenerator(tiny_target).generate(ids, params, k=0).token_ids


def test_greedy_output_equals_target_only(system, tiny_target, prompt_ids):
    mismatches = []
    for index, ids in enumerate(prompt_ids[:10]):
        reference = _reference(tiny_target, ids)
        for k in (0, 1, 4, 8):
            for drafter in ("model", "ngram", "ngram+model"):
                response = system.stub.Generate(_request(ids, k, drafter), timeout=60)
                if list(response.token_ids) != reference:
                    mismatches.append((index, k, drafter))
                assert response.finish_reason in (
                    common_pb2.FINISH_REASON_LENGTH,
                    common_pb2.FINISH_REASON_STOP_TOKEN,
                )
    assert not mismatches, f"(prompt, k, drafter) differing from target-only: {mismatches}"


def test_stream_delivers_the_same_tokens_and_text(system, tiny_target, prompt_ids):
    ids = prompt_ids[3]
    chunks = list(system.stub.GenerateStream(_request(ids, 4, "ngram"), timeout=60))
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    assert tokens == _reference(tiny_target, ids)
    assert "".join(c.text_delta for c in chunks) == tiny_target.tokenizer.decode(
        tokens, skip_special_tokens=True
    )
    assert chunks[0].session_id and chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    stats = chunks[-1].stats
    assert stats.num_generated_tokens == MAX_NEW_TOKENS and stats.num_rounds >= 1


def test_seeded_sampling_reproduces(system, prompt_ids):
    def run(seed):
        request = _request(
            prompt_ids[7], 3, "model", max_new_tokens=24, temperature=0.9, top_p=0.95, seed=seed
        )
        return list(system.stub.Generate(request, timeout=60).token_ids)

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_multi_turn_reuses_the_caches(system, tiny_target, prompt_ids):
    first = system.stub.Generate(_request(prompt_ids[0], 4, "model"), timeout=60)
    follow_up = prompt_ids[1]
    second = system.stub.Generate(
        _request(follow_up, 4, "model", session_id=first.session_id), timeout=60
    )
    # Only the new input was prefilled: the committed tokens stayed cached on both workers.
    assert second.stats.num_prefill_tokens == len(follow_up)
    history = prompt_ids[0] + list(first.token_ids) + follow_up
    assert list(second.token_ids) == _reference(tiny_target, history)
    session = system.stub.GetSession(
        orchestrator_pb2.GetSessionRequest(session_id=first.session_id)
    )
    assert session.num_committed_tokens == len(history) + len(second.token_ids)
    assert session.target.committed_len == session.num_committed_tokens


@pytest.mark.parametrize("k", [0, 4])
def test_a_session_continues_with_no_new_input(system, tiny_target, prompt_ids, k):
    """orchestrator.proto: "With a session the prompt may be empty: generation then
    just continues", whatever k (the draft used to refuse an Extend of no tokens)."""
    first = system.stub.Generate(_request(prompt_ids[4], k, "ngram", max_new_tokens=8), timeout=60)
    more = system.stub.Generate(
        _request(None, k, "ngram", max_new_tokens=8, session_id=first.session_id), timeout=60
    )
    reference = _reference(tiny_target, prompt_ids[4], max_new_tokens=16)
    assert (
        list(first.token_ids) + list(more.token_ids)
        == reference[: len(first.token_ids) + len(more.token_ids)]
    )
    assert len(more.token_ids) == 8 or more.finish_reason == common_pb2.FINISH_REASON_STOP_TOKEN


def test_stop_string_rolls_both_caches_back(system, tiny_target, prompt_ids):
    ids = prompt_ids[2]
    reference = _reference(tiny_target, ids)
    text = tiny_target.tokenizer.decode(reference)
    stop = text[6:8]
    request = _request(ids, 4, "model")
    request.stop.append(stop)
    response = system.stub.Generate(request, timeout=60)
    assert response.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert response.text == text[: text.find(stop)]
    kept = list(response.token_ids)
    assert kept == reference[: len(kept)]
    # The next turn continues from the rolled-back state exactly as a fresh session would.
    follow_up = prompt_ids[4]
    second = system.stub.Generate(
        _request(follow_up, 4, "model", session_id=response.session_id), timeout=60
    )
    assert list(second.token_ids) == _reference(tiny_target, ids + kept + follow_up)


def _target_sessions(system) -> int:
    workers = system.stub.ListWorkers(orchestrator_pb2.ListWorkersRequest()).workers
    return sum(w.load.active_sessions for w in workers if w.pool == common_pb2.WORKER_POOL_TARGET)


def test_cancelled_stream_frees_the_workers_sessions(system, prompt_ids):
    before = _target_sessions(system)
    stream = system.stub.GenerateStream(
        _request(prompt_ids[5], 1, "model", max_new_tokens=400), timeout=60
    )
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 10
    while _target_sessions(system) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _target_sessions(system) == before


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (_request([]), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (
            _request([1, 2], max_new_tokens=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_new_tokens must be >= 1",
        ),
        (
            _request([1, 2], max_new_tokens=2000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "above the room left in the context",
        ),
        (
            _request([1, 2], max_new_tokens=5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "(max_new_tokens_limit)",
        ),
        (
            _request([1] * 2000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt of 2000 tokens does not fit the model's context length of 1024",
        ),
        (
            _request([1, 2], session_id="nope"),
            grpc.StatusCode.NOT_FOUND,
            "session 'nope' not found",
        ),
        (
            _request([1, 2], temperature=-1.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature must be finite and >= 0",
        ),
        (_request([1, 2], top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
        (
            _request([1, 2], k=99),
            grpc.StatusCode.INVALID_ARGUMENT,
            "num_speculative_tokens (k) must be in [0, 16]",
        ),
        (
            _request([1, 999]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token id 999 is outside the vocabulary",
        ),
        (_request([1, 2], drafter="magic"), grpc.StatusCode.INVALID_ARGUMENT, "drafter must be"),
        (
            _request([1, 2], draft={"prompt_lookup_min": 40}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt_lookup_min must be in 1..32",
        ),
        (
            _request([1, 2], draft={"prompt_lookup_min": 5, "prompt_lookup_max": 3}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt lookup sizes need 1 <= prompt_lookup_min <= prompt_lookup_max",
        ),
        (
            _request([1, 2], draft={"draft_top_k": -1}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "draft_top_k must be >= 0",
        ),
    ],
)
def test_bad_input_gets_a_precise_status_and_the_system_keeps_serving(
    system, tiny_target, prompt_ids, request_, code, message
):
    with pytest.raises(grpc.RpcError) as error:
        system.stub.Generate(request_, timeout=30)
    assert error.value.code() == code
    assert message in error.value.details()
    assert list(system.stub.Generate(_request(prompt_ids[0]), timeout=60).token_ids) == _reference(
        tiny_target, prompt_ids[0]
    )


def test_the_requests_lookup_sizes_reach_the_draft_worker(system, tiny_target):
    ids = [
        5,
        6,
        7,
        8,
        9,
    ] * 4  # copies itself every 5 tokens: prompt lookup finds the repeat at any size up to 15
    found = system.stub.Generate(
        _request(ids, draft={"prompt_lookup_min": 2, "prompt_lookup_max": 3}), timeout=60
    )
    # No suffix of 32 tokens repeats in a sequence this short: nothing to copy, nothing drafted.
    none = system.stub.Generate(
        _request(ids, draft={"prompt_lookup_min": 32, "prompt_lookup_max": 32}), timeout=60
    )
    assert found.stats.num_drafted > 0 and none.stats.num_drafted == 0
    assert list(found.token_ids) == list(none.token_ids) == _reference(tiny_target, ids)


def test_oversized_message_is_refused(system):
    request = _request(
        [1] * (20 * 1024 * 1024)
    )  # 20 MiB of one-byte varints, over the 16 MiB limit
    with pytest.raises(grpc.RpcError) as error:
        system.stub.Generate(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_sixteen_concurrent_streams(system, tiny_target, prompt_ids):
    results, errors = {}, []

    def client(index):
        ids = prompt_ids[index % len(prompt_ids)]
        try:
            chunks = system.stub.GenerateStream(
                _request(ids, 4, ("model", "ngram")[index % 2]), timeout=120
            )
            results[index] = [t for c in chunks for t in c.token_ids]
        except grpc.RpcError as error:
            errors.append((index, error.code(), error.details()))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, tokens in results.items():
        assert tokens == _reference(tiny_target, prompt_ids[index % len(prompt_ids)]), index
