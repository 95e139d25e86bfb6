"""The target service over real gRPC on loopback, with the tiny fp32 target model.

Greedy results are compared token for token with target-only decoding in process
(`SpeculativeGenerator(..., k=0)`), the reference the services must equal exactly.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service_common.convert import lookup_rounds_to_proto
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.sampling import SamplingParams, SparseProbs
from speculative.target import TargetSession
from target_service.server import SERVICE_NAME
from tests.polling import settled
from tests.target_worker import serving_target, target_channel

DEADLINE_S = 10  # on every call: a hung server fails the test instead of hanging it
REPO = Path(__file__).resolve().parents[2]
BONUS, RECOVERED = common_pb2.NEXT_TOKEN_KIND_BONUS, common_pb2.NEXT_TOKEN_KIND_RECOVERED


@pytest.fixture(scope="module")
def channel(tiny_target):
    with target_channel(tiny_target, "target-test") as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel) -> target_pb2_grpc.TargetServiceStub:
    return target_pb2_grpc.TargetServiceStub(channel)


@pytest.fixture(scope="module")
def greedy(tiny_target):
    """greedy(prompt_ids, n): the target's own first n greedy tokens."""
    generator = SpeculativeGenerator(tiny_target)
    return lambda ids, n: generator.generate(ids, SamplingParams(max_new_tokens=n), k=0).token_ids


def _open(stub, ids, session_id="", **sampling) -> common_pb2.KvHandle:
    request = target_pb2.OpenSessionRequest(
        session_id=session_id, prompt_token_ids=ids, sampling=common_pb2.SamplingParams(**sampling)
    )
    return stub.OpenSession(request, timeout=DEADLINE_S).handle


def _proposal(
    session_id, base_len, draft_token_ids=(), distributions=(), **fields
) -> target_pb2.Proposal:
    if "stretch" not in fields:
        fields["draft"] = target_pb2.Draft(token_ids=draft_token_ids, distributions=distributions)
    return target_pb2.Proposal(session_id=session_id, base_len=base_len, **fields)


def _decided(verdict: target_pb2.Verdict) -> target_pb2.Decision:
    """The decision of a verdict on a draft or on a stretch's pass."""
    return (
        verdict.stretch_pass.decision
        if verdict.WhichOneof("kind") == "stretch_pass"
        else verdict.decision
    )


def _verify(stub, *proposals: target_pb2.Proposal) -> list[target_pb2.Verdict]:
    """Sends all proposals on one stream (all in flight at once); returns the verdicts."""
    return list(stub.Verify(iter(proposals), timeout=DEADLINE_S))


def _decode(stub, session_id, base_len, **sampling) -> list[target_pb2.DecodeToken]:
    request = target_pb2.DecodeRequest(
        session_id=session_id,
        base_len=base_len,
        sampling=common_pb2.SamplingParams(**sampling) if sampling else None,
    )
    return list(stub.Decode(request, timeout=DEADLINE_S))


def _truncate(stub, session_id, length) -> common_pb2.TruncateResponse:
    return stub.Truncate(
        common_pb2.TruncateRequest(session_id=session_id, length=length), timeout=DEADLINE_S
    )


def _close(stub, session_id) -> None:
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=DEADLINE_S)


def _info(stub) -> common_pb2.InfoResponse:
    return stub.Info(common_pb2.InfoRequest(), timeout=DEADLINE_S)


def _status(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def test_open_returns_handle_and_verify_accepts_the_targets_own_tokens(stub, greedy, prompt_ids):
    ids = prompt_ids[0]
    reference = greedy(ids, 5)
    response = stub.OpenSession(
        target_pb2.OpenSessionRequest(prompt_token_ids=ids), timeout=DEADLINE_S
    )
    handle = response.handle
    assert len(handle.session_id) == 32 and handle.worker_id == "target-test"
    assert handle.worker_address.startswith("127.0.0.1:") and handle.committed_len == len(ids)
    assert response.prefill_ns > 0
    [verdict] = _verify(stub, _proposal(handle.session_id, len(ids), reference[:4], round=7))
    assert (verdict.session_id, verdict.round, verdict.base_len) == (handle.session_id, 7, len(ids))
    decision = verdict.decision
    assert (decision.num_accepted, decision.next_token_id, decision.next_token_kind) == (
        4,
        reference[4],
        BONUS,
    )
    assert decision.committed_len == len(ids) + 5 and verdict.WhichOneof("kind") == "decision"
    assert (
        decision.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        and decision.target_compute_ns > 0
    )


def test_wrong_token_is_recovered_and_stale_proposals_are_discarded_in_band(
    stub, greedy, tiny_target, prompt_ids
):
    ids = prompt_ids[1]
    n = len(ids)
    reference = greedy(ids, 6)
    wrong = (reference[2] + 1) % tiny_target.vocab_size
    session_id = _open(stub, ids).session_id
    first = _proposal(session_id, n, [*reference[:2], wrong, 9], round=0)
    # Drafted before the first verdict arrived, assuming `wrong` was kept.
    guessed_wrong = _proposal(
        session_id, n + 3, reference[3:5], round=1, expected_last_token_id=wrong
    )
    second = _proposal(
        session_id, n + 3, reference[3:5], round=1, expected_last_token_id=reference[2]
    )
    verdicts = _verify(stub, first, first, guessed_wrong, second)
    recovered = verdicts[0].decision
    assert (recovered.num_accepted, recovered.next_token_id, recovered.next_token_kind) == (
        2,
        reference[2],
        RECOVERED,
    )
    assert recovered.committed_len == n + 3
    for discarded in verdicts[1:3]:  # the duplicate, the wrong guess: nothing applied
        assert (
            discarded.WhichOneof("kind") == "discarded"
            and discarded.discarded.committed_len == n + 3
        )
    last = verdicts[3].decision
    assert (last.num_accepted, last.next_token_id, last.committed_len) == (2, reference[5], n + 6)
    assert [v.round for v in verdicts] == [0, 0, 1, 1]


def test_stop_token_cuts_the_round_and_finishes(stub, greedy, prompt_ids):
    ids = prompt_ids[2]
    reference = greedy(ids, 8)
    stop = next(i for i in range(1, 8) if reference[i] not in reference[:i])
    session_id = _open(stub, ids, stop_token_ids=[reference[stop]]).session_id
    [verdict] = _verify(stub, _proposal(session_id, len(ids), reference[:7]))
    assert verdict.decision.finish_reason == common_pb2.FINISH_REASON_STOP_TOKEN
    assert verdict.decision.committed_len == len(ids) + stop + 1
    session_id = _open(stub, ids).session_id
    tokens = _decode(
        stub, session_id, len(ids), stop_token_ids=[reference[stop]], max_new_tokens=20
    )
    assert [t.token_id for t in tokens] == reference[: stop + 1]


def test_sampled_verdict_equals_the_core_with_the_same_seed(stub, tiny_target, prompt_ids):
    ids = prompt_ids[3]
    params = SamplingParams(temperature=0.8, top_k=50, seed=123)
    drafts = [SparseProbs(torch.tensor([5, 6, 7]), torch.tensor([0.5, 0.3, 0.2])) for _ in range(3)]
    draft_token_ids = [5, 6, 7]
    expected = TargetSession(tiny_target, ids, params).verify(len(ids), draft_token_ids, drafts)
    session_id = _open(stub, ids).session_id  # greedy until the proposal sets sampling
    proposal = _proposal(
        session_id,
        len(ids),
        draft_token_ids,
        distributions=[common_pb2.SparseDistribution(token_ids=[5, 6, 7], probs=[0.5, 0.3, 0.2])]
        * 3,
        sampling=common_pb2.SamplingParams(temperature=0.8, top_k=50, seed=123),
    )
    [verdict] = _verify(stub, proposal)
    decision = verdict.decision
    assert (decision.num_accepted, decision.next_token_id, decision.committed_len) == (
        expected.verdict.num_accepted,
        expected.verdict.next_token_id,
        expected.committed_len,
    )


def test_decode_streams_exactly_the_greedy_reference(stub, greedy, prompt_ids):
    ids = prompt_ids[4]
    reference = greedy(ids, 12)
    session_id = _open(stub, ids, max_new_tokens=12).session_id
    tokens = _decode(stub, session_id, len(ids))  # the session's params from OpenSession
    assert [t.token_id for t in tokens] == reference
    assert [t.committed_len for t in tokens] == list(range(len(ids) + 1, len(ids) + 13))
    # The first token's logits were kept from the prompt's prefill: no pass ran for it.
    assert tokens[0].compute_ns == 0 and all(t.compute_ns > 0 for t in tokens[1:])


def _stretch(
    session_id, base_len, max_tokens, until: LookupStop | None = None, **fields
) -> target_pb2.Proposal:
    until_lookup = (
        common_pb2.LookupStop(min_ngram=until.min_ngram, max_ngram=until.max_ngram)
        if until
        else None
    )
    return _proposal(
        session_id,
        base_len,
        stretch=target_pb2.Stretch(max_tokens=max_tokens, until_lookup=until_lookup),
        **fields,
    )


def test_a_stretch_on_the_verify_stream_ends_where_the_core_does(
    stub, greedy, tiny_target, prompt_ids
):
    """A stretch proposal: one verdict per token the target decodes alone, ending after
    max_tokens, or (until_lookup, an n-gram drafter's stretch) after the first token that
    gives prompt lookup text to copy, as TargetSession.decode does; proposals after it
    on the same stream are verified as usual."""
    ids = prompt_ids[3]
    core = TargetSession(tiny_target, ids, SamplingParams(max_new_tokens=20))
    until = LookupStop(1, 2)
    expected = [r.token_ids[0] for r in core.decode(len(ids), 20, until=until)]
    assert len(expected) < 20
    session_id = _open(stub, ids, max_new_tokens=40).session_id
    reference = greedy(ids, len(expected) + 6)
    after = len(ids) + len(expected)
    verdicts = _verify(
        stub,
        _stretch(session_id, len(ids), 20, until, round=0),
        _stretch(session_id, after, 3, round=1),
        _proposal(session_id, after + 3, reference[len(expected) + 3 : len(expected) + 5], round=2),
    )
    stretch, plain, verified = verdicts[: len(expected)], verdicts[len(expected) : -1], verdicts[-1]
    passes = [_decided(v) for v in stretch]
    assert [p.next_token_id for p in passes] == expected
    assert [v.base_len for v in stretch] == list(range(len(ids), after))
    assert [p.committed_len for p in passes] == list(range(len(ids) + 1, after + 1))
    assert [v.stretch_pass.ended for v in stretch] == [False] * (len(expected) - 1) + [True]
    assert all(
        v.round == 0 and _decided(v).num_accepted == 0 and _decided(v).step.batch_sessions
        for v in stretch
    )
    # The first token's logits were kept from the prompt's prefill: no pass ran for it.
    assert passes[0].target_compute_ns == 0 and all(p.target_compute_ns > 0 for p in passes[1:])
    assert [(_decided(v).next_token_id, v.round, v.stretch_pass.ended) for v in plain] == [
        (t, 1, i == 2) for i, t in enumerate(reference[len(expected) : len(expected) + 3])
    ]
    assert (verified.decision.num_accepted, verified.decision.committed_len) == (2, after + 6)


def test_a_stretch_that_verifies_prompt_lookup_sends_the_tokens_it_accepted(
    tiny_bigram, prompt_ids
):
    """Stretch.lookup_rounds over a real socket: one verdict per pass, each carrying the
    looked-up tokens it accepted before its own token, ending with StretchPass.ended once
    max_tokens tokens came; the tokens are the target's greedy ones, as in the core
    (a target whose text repeats, so lookup is right often)."""
    with serving_target(tiny_bigram, "target-test") as stub:
        accepted = 0
        # max_tokens 30; and 6, with a room of 30 its last pass's lookup may fill past 6
        for ids, (max_tokens, room) in itertools.product(prompt_ids[:3], ((30, 0), (6, 30))):
            lookup = LookupRounds(LookupStop(1, 3), 4, room)
            core = TargetSession(tiny_bigram, ids, SamplingParams(max_new_tokens=30))
            expected = list(core.decode(len(ids), max_tokens, lookup=lookup))
            session_id = _open(stub, ids, max_new_tokens=30).session_id
            stretch = target_pb2.Stretch(
                max_tokens=max_tokens, lookup_rounds=lookup_rounds_to_proto(lookup)
            )
            verdicts = _verify(stub, _proposal(session_id, len(ids), stretch=stretch))
            passes = [v.stretch_pass for v in verdicts]
            assert [
                (list(p.accepted_token_ids) + [p.decision.next_token_id], p.num_looked_up)
                for p in passes
            ] == [(r.token_ids, r.num_drafted) for r in expected]
            assert [p.decision.num_accepted for p in passes] == [
                len(p.accepted_token_ids) for p in passes
            ]
            assert [p.ended for p in passes] == [False] * (len(passes) - 1) + [True]
            assert (
                passes[-1].decision.committed_len
                == expected[-1].committed_len
                >= len(ids) + max_tokens
            )
            accepted += sum(p.decision.num_accepted for p in passes)
        assert accepted > 0


def test_a_stale_stretch_is_discarded_and_a_bad_one_refused(stub, prompt_ids):
    ids = prompt_ids[0]
    session_id = _open(stub, ids).session_id
    [stale] = _verify(stub, _stretch(session_id, len(ids) + 1, 4))
    assert (stale.WhichOneof("kind"), stale.discarded.committed_len) == ("discarded", len(ids))
    [wrong_last] = _verify(
        stub, _stretch(session_id, len(ids), 4, expected_last_token_id=(ids[-1] + 1) % 64)
    )
    assert wrong_last.WhichOneof("kind") == "discarded"
    code = grpc.StatusCode.INVALID_ARGUMENT
    sizes = common_pb2.LookupStop(min_ngram=1, max_ngram=2)
    for proposal, message in (
        (_stretch(session_id, len(ids), 0), "stretch.max_tokens must be >= 1"),
        (
            _proposal(
                session_id,
                len(ids),
                stretch=target_pb2.Stretch(
                    max_tokens=2, lookup_rounds=target_pb2.LookupRounds(sizes=sizes)
                ),
            ),
            "max_draft_tokens must be in [1, 16]",
        ),
        (
            _proposal(
                session_id,
                len(ids),
                stretch=target_pb2.Stretch(
                    max_tokens=2, lookup_rounds=target_pb2.LookupRounds(max_draft_tokens=2)
                ),
            ),
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        (
            _proposal(
                session_id,
                len(ids),
                stretch=target_pb2.Stretch(
                    max_tokens=2,
                    lookup_rounds=target_pb2.LookupRounds(sizes=sizes, max_draft_tokens=2, room=-1),
                ),
            ),
            "lookup_rounds.room must be >= 0",
        ),
    ):
        error = _status(lambda proposal=proposal: _verify(stub, proposal))
        assert error.code() == code and message in error.details()
    assert _truncate(stub, session_id, len(ids)).committed_len == len(ids)  # nothing was applied


def test_extend_reuses_the_session_like_a_fresh_concatenated_prompt(stub, greedy, prompt_ids):
    first, turn = prompt_ids[5], prompt_ids[6]
    session_id = _open(stub, first).session_id
    answer = [t.token_id for t in _decode(stub, session_id, len(first), max_new_tokens=3)]
    base_len = len(first) + 3
    request = common_pb2.ExtendRequest(session_id=session_id, base_len=base_len, token_ids=turn)
    response = stub.Extend(request, timeout=DEADLINE_S)
    assert response.committed_len == base_len + len(turn) and response.prefill_ns > 0
    tokens = _decode(stub, session_id, response.committed_len, max_new_tokens=8)
    assert [t.token_id for t in tokens] == greedy([*first, *answer, *turn], 8)


def test_truncate_then_decode_regenerates_the_same_tokens(stub, greedy, prompt_ids):
    ids = prompt_ids[7]
    reference = greedy(ids, 10)
    session_id = _open(stub, ids).session_id
    assert [t.token_id for t in _decode(stub, session_id, len(ids), max_new_tokens=10)] == reference
    for _ in range(2):  # absolute rollback: a repeat is harmless
        assert _truncate(stub, session_id, len(ids) + 2).committed_len == len(ids) + 2
    assert [
        t.token_id for t in _decode(stub, session_id, len(ids) + 2, max_new_tokens=8)
    ] == reference[2:]


def test_concurrent_sessions_each_equal_their_reference(stub, greedy, prompt_ids):
    prompts = prompt_ids[8:12]
    results: dict[int, list[int]] = {}

    def run(index: int) -> None:
        session_id = _open(stub, prompts[index]).session_id
        results[index] = [
            t.token_id for t in _decode(stub, session_id, len(prompts[index]), max_new_tokens=10)
        ]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
    assert results == {i: greedy(ids, 10) for i, ids in enumerate(prompts)}


def test_bad_requests_get_precise_statuses_and_the_server_keeps_serving(
    stub, tiny_target, greedy, prompt_ids
):
    ids = prompt_ids[12]
    n = len(ids)
    session_id = _open(stub, ids, session_id="errors").session_id
    reference = greedy(ids, 1)
    one_hot_4 = common_pb2.SparseDistribution(token_ids=[4], probs=[1.0])
    extend_stale = common_pb2.ExtendRequest(session_id=session_id, base_len=n + 1, token_ids=[1])
    code = grpc.StatusCode
    cases = [
        (
            lambda: _decode(stub, "no-such-session", 1),
            code.NOT_FOUND,
            "'no-such-session' not found",
        ),
        (lambda: _verify(stub, _proposal("nope", 1)), code.NOT_FOUND, "open it again"),
        (lambda: _truncate(stub, "nope", 1), code.NOT_FOUND, "not found"),
        (lambda: _open(stub, []), code.INVALID_ARGUMENT, "prompt is empty"),
        (lambda: _open(stub, ids, temperature=-1.0), code.INVALID_ARGUMENT, "temperature"),
        (lambda: _open(stub, ids, top_p=1.5), code.INVALID_ARGUMENT, "top_p"),
        (lambda: _open(stub, ids, max_new_tokens=-3), code.INVALID_ARGUMENT, "max_new_tokens"),
        (lambda: _open(stub, [1, 10**6]), code.INVALID_ARGUMENT, "outside the vocabulary"),
        (
            lambda: _open(stub, [1] * tiny_target.context_length),
            code.INVALID_ARGUMENT,
            "context length",
        ),
        (
            lambda: _verify(stub, _proposal(session_id, n, [3, 10**6])),
            code.INVALID_ARGUMENT,
            "outside the target",
        ),
        (
            lambda: _verify(
                stub,
                _proposal(
                    session_id,
                    n,
                    [3],
                    distributions=[one_hot_4],
                    sampling=common_pb2.SamplingParams(temperature=1.0),
                ),
            ),
            code.INVALID_ARGUMENT,
            "probability 0",
        ),
        (
            lambda: _verify(
                stub, _proposal(session_id, n, sampling=common_pb2.SamplingParams(top_k=-1))
            ),
            code.INVALID_ARGUMENT,
            "top_k",
        ),
        (lambda: _truncate(stub, session_id, 0), code.INVALID_ARGUMENT, f"in [1, {n}]"),
        (lambda: _truncate(stub, session_id, n + 1), code.INVALID_ARGUMENT, f"in [1, {n}]"),
        (
            lambda: _open(stub, ids, session_id="errors"),
            code.ALREADY_EXISTS,
            "'errors' already exists",
        ),
        (
            lambda: stub.Extend(extend_stale, timeout=DEADLINE_S),
            code.FAILED_PRECONDITION,
            f"has {n} committed tokens",
        ),
        (
            lambda: _decode(stub, session_id, n - 1),
            code.FAILED_PRECONDITION,
            f"has {n} committed tokens",
        ),
        (
            lambda: _verify(
                stub,
                _proposal(
                    session_id,
                    n,
                    stretch=target_pb2.Stretch(
                        max_tokens=2, until_lookup=common_pb2.LookupStop(min_ngram=3, max_ngram=2)
                    ),
                ),
            ),
            code.INVALID_ARGUMENT,
            "prompt_lookup_min <= prompt_lookup_max",
        ),
    ]
    for call, status, message in cases:
        error = _status(call)
        assert (error.code(), message in error.details()) == (status, True), (
            message,
            error.details(),
        )
        assert "Traceback" not in error.details()
        # A valid request right after succeeds, greedy: the refused one changed nothing.
        [verdict] = _verify(stub, _proposal(session_id, n))
        assert (verdict.decision.committed_len, verdict.decision.next_token_id) == (
            n + 1,
            reference[0],
        )
        _truncate(stub, session_id, n)
    # Closing is idempotent (common.proto): an unknown or already closed id is not an error.
    for _ in range(2):
        _close(stub, session_id)
    assert _status(lambda: _decode(stub, session_id, n)).code() == code.NOT_FOUND


def test_info_reports_model_and_load(stub, tiny_target, prompt_ids):
    before = _info(stub)
    assert before.worker_id == "target-test"
    assert before.model == common_pb2.ModelInfo(
        model_id="tiny-random:1",
        tokenizer_fingerprint=tiny_target.fingerprint,
        vocab_size=257,
        context_length=1024,
        device="cpu",
        dtype="float32",
        row_invariance="off",
    )
    assert (before.load.max_sessions, before.load.max_cached_tokens) == (64, 262144)
    ids = prompt_ids[13]
    session_id = _open(stub, ids).session_id
    after = _info(stub).load
    assert after.active_sessions == before.load.active_sessions + 1
    assert after.cached_tokens == before.load.cached_tokens + len(ids)
    assert (after.max_running, after.max_batch_tokens) == (32, 512)
    assert after.mean_batch_tokens > 0  # the prefill ran as a step
    _close(stub, session_id)
    closed = _info(stub).load
    assert (closed.active_sessions, closed.cached_tokens) == (
        before.load.active_sessions,
        before.load.cached_tokens,
    )


def test_decode_stops_when_the_client_cancels(stub, prompt_ids):
    def cached_tokens() -> int:
        return _info(stub).load.cached_tokens

    ids = prompt_ids[14]
    before = cached_tokens()
    session_id = _open(stub, ids).session_id
    call = stub.Decode(
        target_pb2.DecodeRequest(
            session_id=session_id,
            base_len=len(ids),
            sampling=common_pb2.SamplingParams(max_new_tokens=900),
        ),
        timeout=DEADLINE_S,
    )
    next(call), next(call)
    call.cancel()
    stopped_at = settled(cached_tokens, "the cancelled stream's cached tokens")
    assert stopped_at < before + len(ids) + 900  # nothing computed for a gone client
    _close(stub, session_id)


def test_closing_a_session_mid_stream_ends_the_stream_with_not_found(stub, prompt_ids):
    """A Decode run holds its session for many tokens; closing the session stops it
    within a step: Close does not wait for the run, the stream ends with NOT_FOUND."""
    ids = prompt_ids[13]
    session_id = _open(stub, ids).session_id
    call = stub.Decode(
        target_pb2.DecodeRequest(
            session_id=session_id,
            base_len=len(ids),
            sampling=common_pb2.SamplingParams(max_new_tokens=900),
        ),
        timeout=DEADLINE_S,
    )
    next(call), next(call)
    _close(stub, session_id)  # within the call's deadline, long before 900 tokens
    with pytest.raises(grpc.RpcError) as raised:
        for _ in call:
            pass
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND and session_id in raised.value.details()


def test_a_full_context_finishes_with_length(stub, tiny_target):
    ids = [65] * (tiny_target.context_length - 3)
    decoded = _open(stub, ids).session_id
    tokens = _decode(stub, decoded, len(ids), max_new_tokens=10)  # the context has room for 3
    assert [t.committed_len for t in tokens] == [len(ids) + 1, len(ids) + 2, len(ids) + 3]
    verified = _open(stub, ids).session_id
    [verdict] = _verify(stub, _proposal(verified, len(ids), [t.token_id for t in tokens[:2]]))
    assert (verdict.decision.num_accepted, verdict.decision.committed_len) == (
        2,
        tiny_target.context_length,
    )
    assert verdict.decision.finish_reason == common_pb2.FINISH_REASON_LENGTH
    for session_id in (decoded, verified):
        _close(stub, session_id)


def test_least_recently_used_session_is_evicted(tiny_target, prompt_ids):
    with serving_target(tiny_target, "target-test", max_sessions=2, max_cached_tokens=64) as stub:
        ids = (prompt_ids[15] * 2)[:20]
        a, b = _open(stub, ids).session_id, _open(stub, ids).session_id
        _verify(stub, _proposal(a, 20))  # a is now used after b
        c = _open(stub, ids).session_id  # a third session: b, least recently used, goes
        error = _status(lambda: _decode(stub, b, 20))
        assert error.code() == grpc.StatusCode.NOT_FOUND and "evicted" in error.details()
        # Growth past the token budget (21 + 20 + 24 > 64) evicts a, the least recently used.
        assert len(_decode(stub, c, 20, max_new_tokens=24)) == 24
        assert _status(lambda: _decode(stub, a, 21)).code() == grpc.StatusCode.NOT_FOUND
        load = _info(stub).load
        assert (load.active_sessions, load.cached_tokens) == (1, 44)
        error = _status(lambda: _open(stub, [1] * 65))
        assert (
            error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "budget of 64 tokens" in error.details()
        )
        assert _open(stub, ids).committed_len == 20  # an evicted owner re-opens


def test_eviction_under_concurrent_use_is_not_found_never_a_crash(tiny_target, greedy, prompt_ids):
    """Six clients on a two-session worker: each either gets the exact greedy tokens or
    NOT_FOUND (evicted mid-stream); no INTERNAL, no deadlock, consistent accounting."""
    prompts = prompt_ids[:6]
    outcomes: dict[int, object] = {}

    def run(index: int) -> None:
        try:
            session_id = _open(stub, prompts[index]).session_id
            outcomes[index] = [
                t.token_id
                for t in _decode(stub, session_id, len(prompts[index]), max_new_tokens=10)
            ]
        except grpc.RpcError as error:
            outcomes[index] = error.code()

    with serving_target(tiny_target, "target-test", max_sessions=2) as stub:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * DEADLINE_S)
        assert len(outcomes) == len(prompts)
        for index, outcome in outcomes.items():
            assert outcome in (greedy(prompts[index], 10), grpc.StatusCode.NOT_FOUND), (
                index,
                outcome,
            )
        load = _info(stub).load
        finished = [len(prompts[i]) + 10 for i, o in outcomes.items() if isinstance(o, list)]
        assert load.active_sessions <= 2 and load.cached_tokens <= sum(finished)


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE_S)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    [response] = reflection.ServerReflectionInfo(iter([request]), timeout=DEADLINE_S)
    assert SERVICE_NAME in {s.name for s in response.list_services_response.service}


def test_main_logs_its_port_serves_and_exits_cleanly_on_sigterm():
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "target_service",
            "--model",
            "tiny-random:1",
            "--address",
            "127.0.0.1:0",
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TARGET_THREADS": "1"},
    )
    try:
        port = _read_port(process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = target_pb2_grpc.TargetServiceStub(channel).Info(
                common_pb2.InfoRequest(), timeout=DEADLINE_S
            )
            assert info.model.model_id == "tiny-random:1"
            request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            health = health_pb2_grpc.HealthStub(channel).Check(request, timeout=DEADLINE_S)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _read_port(process: subprocess.Popen) -> int:
    """The port from the JSON log line {"message": "serving", "port": ...} on stderr."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in process.stderr], daemon=True
    ).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=deadline - time.monotonic())
        except queue.Empty:
            break
        entry = json.loads(line) if line.startswith("{") else {}
        if "port" in entry:
            return entry["port"]
    raise AssertionError(f"no port logged; exit code {process.poll()}")
