"""The draft service over real gRPC on loopback, against a real target service.

Both servers run in process on port 0 with tiny fp32 models. Greedy speculation through
draft + target must equal target-only decoding token for token; a seeded sampled run
must equal the in-process SpeculativeGenerator's, draw for draw; errors are statuses,
and each leaves the worker (and the session) usable.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.delay_proxy import DelayProxy
from draft_service.config import DraftConfig
from draft_service.draft_model import DraftModel
from draft_service.drafting import Drafters, DraftSettings
from draft_service.server import create_server as create_draft_server
from draft_service.sessions import SessionEntry
from draft_service.speculation import SpeculatePlan, check_start, plan_call, run_rounds
from draft_service.target_connections import TargetInfo
from foundation.errors import IncompatibleModels
from model_runtime.fingerprint import ANY_VOCABULARY
from orchestrator.rounds import token_sources
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from speculative.drafters import ModelDrafter
from speculative.estimator import MeasuredCosts
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK
from speculative.prompt_lookup import LookupStop, LookupThenModelDrafter, NgramDrafter
from speculative.rejection import NextTokenKind, Verdict
from speculative.sampling import SamplingParams
from speculative.speculation_loop import Features
from speculative.target import VerifyResult
from target_service.config import TargetConfig
from target_service.server import create_server as create_target_server
from tests.polling import wait_until

MAX_NEW_TOKENS = 16
K_VALUES = [1, 4, 8]
NUM_PROMPTS = 4  # of conftest.PROMPTS: prose, code, n-gram-friendly repetition
TIMEOUT_S = 30  # deadline of every test call
REPO_ROOT = Path(__file__).resolve().parents[2]


# --- servers ---------------------------------------------------------------------------


def _start(service):
    service.start()
    return service.server, f"127.0.0.1:{service.port}"


@pytest.fixture(scope="module")
def target_address(tiny_target):
    server, address = _start(
        create_target_server(TargetConfig(address="127.0.0.1:0"), loaded_model=tiny_target)
    )
    yield address
    server.stop(0)


def _draft_server(loaded_model, **config):
    return _start(
        create_draft_server(DraftConfig(address="127.0.0.1:0", **config), loaded_model=loaded_model)
    )


@pytest.fixture(scope="module")
def drafts(tiny_target, tiny_unrelated, tiny_perturbed):
    """Draft workers by name: "same" drafts with the target's own weights (every draft
    accepted), "unrelated" with other weights (rejected), "perturbed" with noisy target
    weights (partly accepted), "synchronous" the same without pipelining, "ngram" has
    no model."""
    servers = {
        "same": _draft_server(tiny_target, default_drafter="model"),
        "unrelated": _draft_server(tiny_unrelated, default_drafter="model"),
        "perturbed": _draft_server(tiny_perturbed, default_drafter="model"),
        "synchronous": _draft_server(tiny_perturbed, default_drafter="model", disable="pipeline"),
        "ngram": _draft_server(None),
    }
    yield {name: address for name, (_, address) in servers.items()}
    for server, _ in servers.values():
        server.stop(0)


@pytest.fixture(scope="module")
def channels(target_address, drafts):
    opened = {
        name: grpc.insecure_channel(address)
        for name, address in {"target": target_address, **drafts}.items()
    }
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture(scope="module")
def target(channels):
    return target_pb2_grpc.TargetServiceStub(channels["target"])


@pytest.fixture(scope="module")
def draft_stubs(channels, drafts):
    return {name: draft_pb2_grpc.DraftServiceStub(channels[name]) for name in drafts}


@pytest.fixture(scope="module")
def references(tiny_target, prompt_ids):
    """Target-only greedy outputs, in process."""
    generator = SpeculativeGenerator(tiny_target)
    return [
        generator.generate(ids, SamplingParams(max_new_tokens=MAX_NEW_TOKENS), k=0).token_ids
        for ids in prompt_ids[:NUM_PROMPTS]
    ]


# --- helpers ---------------------------------------------------------------------------


class Pair:
    """A draft session and a target session holding the same prompt."""

    def __init__(self, draft, target, target_address, prompt, drafter=""):
        self.draft, self.target = draft, target
        self.target_handle = target.OpenSession(
            target_pb2.OpenSessionRequest(prompt_token_ids=prompt), timeout=TIMEOUT_S
        ).handle
        self.target_handle.worker_address = target_address
        self.draft_handle = draft.OpenSession(
            draft_pb2.DraftOpenSessionRequest(prompt_token_ids=prompt, drafter=drafter),
            timeout=TIMEOUT_S,
        ).handle
        self.committed_len = len(prompt)

    def request(self, sampling=None, base_len=None, **speculation) -> draft_pb2.SpeculateRequest:
        base_len = self.committed_len if base_len is None else base_len
        target = common_pb2.KvHandle()
        target.CopyFrom(self.target_handle)
        target.committed_len = base_len
        return draft_pb2.SpeculateRequest(
            session_id=self.draft_handle.session_id,
            base_len=base_len,
            target=target,
            sampling=sampling or common_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
            speculation=common_pb2.SpeculationParams(**speculation),
        )

    def speculate(self, sampling=None, **speculation) -> list[draft_pb2.SpeculateUpdate]:
        updates = list(
            self.draft.Speculate(self.request(sampling, **speculation), timeout=TIMEOUT_S)
        )
        if updates:
            self.committed_len = updates[-1].committed_len
        return updates

    def truncate(self, length: int) -> None:
        for stub, handle in ((self.draft, self.draft_handle), (self.target, self.target_handle)):
            response = stub.Truncate(
                common_pb2.TruncateRequest(session_id=handle.session_id, length=length),
                timeout=TIMEOUT_S,
            )
            assert response.committed_len == length
        self.committed_len = length

    def close(self) -> None:
        self.draft.CloseSession(
            common_pb2.CloseSessionRequest(session_id=self.draft_handle.session_id),
            timeout=TIMEOUT_S,
        )
        self.target.CloseSession(
            common_pb2.CloseSessionRequest(session_id=self.target_handle.session_id),
            timeout=TIMEOUT_S,
        )


def tokens_of(updates) -> list[int]:
    return [t for update in updates for t in update.token_ids]


def check_accounting(updates, base_len: int, num_tokens: int, finish_reason) -> None:
    """Per-round updates add up: lengths, token counts, round indices, wire sizes."""
    length = base_len
    for index, update in enumerate(updates):
        stats = update.round
        assert stats.base_len == length
        assert 1 <= len(update.token_ids) <= stats.num_accepted + 1
        assert 0 <= stats.num_accepted <= stats.num_drafted
        length += len(update.token_ids)
        assert update.committed_len == length
        assert stats.proposal_bytes > 0 and stats.verdict_bytes > 0
        # 0 only where no pass ran: a plain step on the logits kept from the prefill.
        assert stats.verify_rtt_ns >= stats.target_compute_ns > 0 or (
            index == 0 and stats.num_drafted == 0
        )
        assert update.finished == (index == len(updates) - 1)
    # Round indices are Proposal.round: increasing, with gaps where a proposal sent ahead was discarded.
    indices = [u.round.round for u in updates]
    assert indices == sorted(set(indices))
    assert length == base_len + num_tokens
    assert updates[-1].finish_reason == finish_reason


def expect_error(code, call, *args, match: str = "", **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call(*args, timeout=TIMEOUT_S, **kwargs)
        if isinstance(result, grpc.Call):  # a stream: errors come while reading it
            list(result)
    assert caught.value.code() == code, caught.value.details()
    assert match in caught.value.details()
    return caught.value


# --- equivalence -----------------------------------------------------------------------

DRAFTERS = [
    ("same", "model"),
    ("unrelated", "model"),
    ("perturbed", "model"),
    ("same", "ngram"),
    ("perturbed", "ngram+model"),
    ("synchronous", "model"),
    ("synchronous", "ngram+model"),
]


def test_greedy_speculation_equals_target_only(
    draft_stubs, target, target_address, prompt_ids, references
):
    mismatches, partly_accepted = [], 0
    for worker, drafter in DRAFTERS:
        for prompt_index, (ids, reference) in enumerate(zip(prompt_ids, references)):
            for k in K_VALUES:
                pair = Pair(draft_stubs[worker], target, target_address, ids, drafter)
                updates = pair.speculate(num_speculative_tokens=k)
                pair.close()
                if tokens_of(updates) != reference:
                    mismatches.append((worker, drafter, prompt_index, k))
                check_accounting(updates, len(ids), MAX_NEW_TOKENS, common_pb2.FINISH_REASON_LENGTH)
                assert max(u.round.num_drafted for u in updates) <= k
                if worker == "same" and drafter == "model":  # its own weights: all accepted
                    assert all(u.round.num_accepted == u.round.num_drafted for u in updates)
                    # The first proposal is drafted whole; one drafted ahead ends where its
                    # predecessor's verdict comes.
                    assert updates[0].round.num_drafted == min(k, MAX_NEW_TOKENS - 1)
                partly_accepted += sum(
                    0 < u.round.num_accepted < u.round.num_drafted for u in updates
                )
    assert not mismatches
    assert partly_accepted > 0  # the rollback of a partly accepted proposal was exercised


def test_target_only_and_adaptive_k(draft_stubs, target, target_address, prompt_ids, references):
    pair = Pair(draft_stubs["unrelated"], target, target_address, prompt_ids[0])
    updates = pair.speculate(num_speculative_tokens=0)
    assert tokens_of(updates) == references[0]
    assert all(u.round.num_drafted == 0 and len(u.token_ids) == 1 for u in updates)
    pair.close()
    for worker in ("same", "unrelated"):  # the unrelated draft's calls may decode stretches
        pair = Pair(draft_stubs[worker], target, target_address, prompt_ids[1])
        updates = pair.speculate(num_speculative_tokens=8, adaptive=True)
        assert tokens_of(updates) == references[1]
        assert all(1 <= len(u.token_ids) <= u.round.num_accepted + 1 for u in updates)
        pair.close()


@pytest.mark.parametrize(
    ("worker", "drafter"),
    [("same", "model"), ("perturbed", "model"), ("same", "ngram"), ("perturbed", "ngram+model")],
)
def test_seeded_sampling_equals_in_process(
    worker, drafter, draft_stubs, target, target_address, prompt_ids, tiny_target, tiny_perturbed
):
    """Same seed, same draws: the service's output is the in-process generator's (the
    draft's sparse distributions cross the wire exactly)."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=24)
    model = ModelDrafter(tiny_target if worker == "same" else tiny_perturbed)
    in_process = {
        "ngram": NgramDrafter(),
        "model": model,
        "ngram+model": LookupThenModelDrafter(model, NgramDrafter()),
    }[drafter]
    expected = (
        SpeculativeGenerator(tiny_target, in_process, pipelined=True)
        .generate(prompt_ids[2], params, k=4)
        .token_ids
    )
    sampling = common_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=24)
    for _ in range(2):  # and again: a seed reproduces the run
        pair = Pair(draft_stubs[worker], target, target_address, prompt_ids[2], drafter)
        updates = pair.speculate(sampling, num_speculative_tokens=4)
        pair.close()
        assert tokens_of(updates) == expected
        check_accounting(updates, len(prompt_ids[2]), 24, common_pb2.FINISH_REASON_LENGTH)


def test_stop_token_ends_the_stream(draft_stubs, target, target_address, prompt_ids, references):
    reference = references[0]
    stop = reference[5]
    expected = reference[: reference.index(stop) + 1]
    pair = Pair(draft_stubs["same"], target, target_address, prompt_ids[0])
    updates = pair.speculate(
        common_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[stop]),
        num_speculative_tokens=4,
    )
    assert tokens_of(updates) == expected
    check_accounting(
        updates, len(prompt_ids[0]), len(expected), common_pb2.FINISH_REASON_STOP_TOKEN
    )
    pair.close()


def test_extend_continues_a_session(draft_stubs, target, target_address, prompt_ids, tiny_target):
    """Multi-turn: the next turn is appended to both sessions, their state reused."""
    ids = prompt_ids[1]
    pair = Pair(draft_stubs["unrelated"], target, target_address, ids)
    first = tokens_of(pair.speculate(num_speculative_tokens=4))
    turn = prompt_ids[3][:5]
    for stub, handle in ((pair.draft, pair.draft_handle), (pair.target, pair.target_handle)):
        response = stub.Extend(
            common_pb2.ExtendRequest(
                session_id=handle.session_id, base_len=pair.committed_len, token_ids=turn
            ),
            timeout=TIMEOUT_S,
        )
        assert response.committed_len == pair.committed_len + len(turn)
    pair.committed_len += len(turn)
    second = tokens_of(pair.speculate(num_speculative_tokens=4))
    pair.close()
    expected = (
        SpeculativeGenerator(tiny_target)
        .generate(ids + first + turn, SamplingParams(max_new_tokens=MAX_NEW_TOKENS), k=0)
        .token_ids
    )
    assert second == expected


def test_concurrent_sessions_share_workers(
    draft_stubs, target, target_address, prompt_ids, references
):
    """Sessions of several callers at once: one channel and one model per worker."""
    results: dict[tuple[str, int], list[int]] = {}

    def run(worker: str, index: int) -> None:
        pair = Pair(draft_stubs[worker], target, target_address, prompt_ids[index])
        results[worker, index] = tokens_of(pair.speculate(num_speculative_tokens=3))
        pair.close()

    threads = [
        threading.Thread(target=run, args=(worker, index))
        for worker in ("perturbed", "unrelated")
        for index in range(NUM_PROMPTS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert results == {
        (worker, index): references[index]
        for worker in ("perturbed", "unrelated")
        for index in range(NUM_PROMPTS)
    }


# --- cancellation ----------------------------------------------------------------------


def test_cancel_midway_leaves_both_sessions_consistent(
    draft_stubs, target, target_address, prompt_ids, tiny_target
):
    ids, total = prompt_ids[0], 40
    reference = (
        SpeculativeGenerator(tiny_target)
        .generate(ids, SamplingParams(max_new_tokens=total), k=0)
        .token_ids
    )
    pair = Pair(draft_stubs["unrelated"], target, target_address, ids)
    call = pair.draft.Speculate(
        pair.request(common_pb2.SamplingParams(max_new_tokens=total), num_speculative_tokens=2),
        timeout=TIMEOUT_S,
    )
    received = [next(call) for _ in range(3)]
    call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    # The caller knows the last update it received; rollback is absolute, on both sides
    # (the draft's Truncate waits for the round that was in flight).
    pair.truncate(received[-1].committed_len)
    updates = pair.speculate(
        common_pb2.SamplingParams(max_new_tokens=total - len(tokens_of(received))),
        num_speculative_tokens=2,
    )
    assert tokens_of(received) + tokens_of(updates) == reference
    assert updates[0].round.round > received[-1].round.round  # round indices per session
    pair.close()


# --- errors, each followed by a successful request --------------------------------------


def test_unknown_session_is_not_found(draft_stubs, target, target_address, prompt_ids, references):
    draft = draft_stubs["ngram"]
    pair = Pair(draft, target, target_address, prompt_ids[0])
    request = pair.request(num_speculative_tokens=4)
    request.session_id = "no-such-session"
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        draft.Speculate,
        request,
        match="evicted or never opened: open it again",
    )
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        draft.Truncate,
        common_pb2.TruncateRequest(session_id="no-such-session", length=1),
    )
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        draft.Extend,
        common_pb2.ExtendRequest(session_id="no-such-session", base_len=1, token_ids=[1]),
    )
    draft.CloseSession(
        common_pb2.CloseSessionRequest(session_id="no-such-session"), timeout=TIMEOUT_S
    )  # idempotent
    assert tokens_of(pair.speculate(num_speculative_tokens=4)) == references[0]
    pair.close()


def test_base_len_mismatch_is_failed_precondition(
    draft_stubs, target, target_address, prompt_ids, references
):
    pair = Pair(draft_stubs["same"], target, target_address, prompt_ids[1])
    expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        pair.draft.Speculate,
        pair.request(base_len=pair.committed_len - 1),
        match="truncate both",
    )
    request = pair.request()
    request.target.committed_len += 1  # the draft agrees, the target handle does not
    expect_error(grpc.StatusCode.FAILED_PRECONDITION, pair.draft.Speculate, request)
    expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        pair.draft.Extend,
        common_pb2.ExtendRequest(
            session_id=pair.draft_handle.session_id, base_len=pair.committed_len + 3, token_ids=[1]
        ),
    )
    assert tokens_of(pair.speculate(num_speculative_tokens=4)) == references[1]
    pair.close()


@pytest.mark.parametrize("k", [-1, 17])
def test_bad_k_is_invalid_argument(k, draft_stubs, target, target_address, prompt_ids, references):
    pair = Pair(draft_stubs["same"], target, target_address, prompt_ids[2])
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pair.draft.Speculate,
        pair.request(num_speculative_tokens=k),
        match="num_speculative_tokens",
    )
    assert tokens_of(pair.speculate(num_speculative_tokens=4)) == references[2]
    pair.close()


def test_bad_requests_are_invalid_argument(
    draft_stubs, target, target_address, prompt_ids, references
):
    ngram_only = draft_stubs["ngram"]
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        ngram_only.OpenSession,
        draft_pb2.DraftOpenSessionRequest(prompt_token_ids=[1, 2], drafter="model"),
        match="needs a draft model",
    )
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        ngram_only.OpenSession,
        draft_pb2.DraftOpenSessionRequest(prompt_token_ids=[1, 2], drafter="eagle"),
        match="unknown drafter 'eagle'",
    )
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        ngram_only.OpenSession,
        draft_pb2.DraftOpenSessionRequest(prompt_token_ids=[]),
    )
    pair = Pair(draft_stubs["same"], target, target_address, prompt_ids[3], drafter="ngram")
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pair.draft.Speculate,
        pair.request(num_speculative_tokens=4, drafter="model"),
        match="opened with drafter 'ngram'",
    )
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pair.draft.Speculate,
        pair.request(common_pb2.SamplingParams(temperature=-1.0)),
        match="temperature",
    )
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        pair.draft.Truncate,
        common_pb2.TruncateRequest(
            session_id=pair.draft_handle.session_id, length=pair.committed_len + 1
        ),
    )
    expect_error(
        grpc.StatusCode.ALREADY_EXISTS,
        pair.draft.OpenSession,
        draft_pb2.DraftOpenSessionRequest(
            session_id=pair.draft_handle.session_id, prompt_token_ids=[1]
        ),
    )
    assert tokens_of(pair.speculate(num_speculative_tokens=4)) == references[3]
    pair.close()


def test_unknown_target_address_is_unavailable(
    draft_stubs, target, target_address, prompt_ids, references
):
    pair = Pair(draft_stubs["unrelated"], target, target_address, prompt_ids[0])
    request = pair.request(num_speculative_tokens=4)
    request.target.worker_address = "127.0.0.1:1"  # nothing listens on port 1
    expect_error(grpc.StatusCode.UNAVAILABLE, pair.draft.Speculate, request, match="127.0.0.1:1")
    assert tokens_of(pair.speculate(num_speculative_tokens=4)) == references[0]
    pair.close()


def test_target_error_is_passed_on_and_the_draft_rolled_back(
    draft_stubs, target, target_address, prompt_ids, references
):
    """The target's NOT_FOUND comes back as NOT_FOUND; the draft had drafted k tokens for
    the failed round and is back at its committed length, so the session goes on."""
    pair = Pair(draft_stubs["same"], target, target_address, prompt_ids[1])
    request = pair.request(num_speculative_tokens=4)
    request.target.session_id = "no-such-target-session"
    expect_error(grpc.StatusCode.NOT_FOUND, pair.draft.Speculate, request, match=target_address)
    assert tokens_of(pair.speculate(num_speculative_tokens=4)) == references[1]
    pair.close()


def test_incompatible_target_vocabulary_is_refused(tiny_target):
    """A model draft only serves a target with its tokenizer; n-gram lookup serves any."""
    drafters = Drafters(DraftModel.of(tiny_target), "model", min_ngram=2, max_ngram=4)
    request = draft_pb2.SpeculateRequest(
        session_id="s",
        base_len=3,
        target=common_pb2.KvHandle(
            worker_address="elsewhere:50051", session_id="t", committed_len=3
        ),
    )
    plan = plan_call(request, DraftConfig())
    other = TargetInfo("other-family", "0123456789abcdef", context_length=100)
    model_entry = SessionEntry("s", "model", drafters.open("model", [1, 2, 3]))
    with pytest.raises(IncompatibleModels, match="share one vocabulary"):
        check_start(model_entry, request, plan, drafters, other)
    ngram_entry = SessionEntry("s", "ngram", drafters.open("ngram", [1, 2, 3]))
    assert check_start(ngram_entry, request, plan, drafters, other) == 100  # the target's context


# --- Info, the session cache, the command line -------------------------------------------


def test_info(draft_stubs, tiny_target):
    same = draft_stubs["same"].Info(common_pb2.InfoRequest(), timeout=TIMEOUT_S)
    assert same.worker_id.startswith("draft-")
    assert (same.model.model_id, same.model.tokenizer_fingerprint) == (
        tiny_target.name,
        tiny_target.fingerprint,
    )
    assert same.model.vocab_size == tiny_target.vocab_size and same.model.dtype == "float32"
    assert same.load.max_sessions == DraftConfig.max_sessions
    ngram = draft_stubs["ngram"].Info(common_pb2.InfoRequest(), timeout=TIMEOUT_S)
    assert (ngram.model.model_id, ngram.model.tokenizer_fingerprint) == ("ngram", ANY_VOCABULARY)
    opened = draft_stubs["ngram"].OpenSession(
        draft_pb2.DraftOpenSessionRequest(prompt_token_ids=[1, 2, 3]), timeout=TIMEOUT_S
    )
    load = draft_stubs["ngram"].Info(common_pb2.InfoRequest(), timeout=TIMEOUT_S).load
    assert load.active_sessions == ngram.load.active_sessions + 1
    assert load.cached_tokens == ngram.load.cached_tokens + 3
    draft_stubs["ngram"].CloseSession(
        common_pb2.CloseSessionRequest(session_id=opened.handle.session_id), timeout=TIMEOUT_S
    )


class _StretchOnly:
    """A verifier that records the stretch it is asked for and decodes tokens 100, 101, ..."""

    round = proposal_bytes = verdict_bytes = 0
    overlaps = runs_lookup = False

    def __init__(self):
        self.stretches = []

    def decode(self, base_len, max_tokens, until=None, lookup=None):
        self.stretches.append((base_len, max_tokens, until))
        for offset in range(max_tokens):
            yield VerifyResult(
                Verdict(0, 100 + offset, NextTokenKind.BONUS),
                [100 + offset],
                base_len + offset + 1,
                False,
                1,
            )


def test_an_ngram_drafters_stretch_ends_where_it_would_propose_again():
    """Over a slow link where its proposals still pay, an empty turn has the target
    decode the rest of the call alone until prompt lookup finds text to copy: the
    stretch goes to the target on the Verify stream with the lookup sizes, and each of
    its tokens comes back as an update, the draft following it."""
    ms = 1_000_000
    slow_link = MeasuredCosts(
        one_token_ns=10 * ms,
        per_token_ns=1 * ms,
        overhead_ns=20 * ms,
        solo_token_ns=10 * ms,
        stream_start_ns=20 * ms,
        draft_token_ns=0.0,
        acceptance=0.9,
        one_token_measured=True,
    )
    prompt = list(range(10))  # nothing to copy yet
    entry = SessionEntry("s", "ngram", NgramDrafter(2, 3).open(prompt, SamplingParams()))
    params = SamplingParams(max_new_tokens=16)
    plan = SpeculatePlan(
        DraftSettings(params, 32, 2, 3),
        AdaptiveK(4, costs=slow_link),
        "ngram",
        "target:1",
        "t",
        Features(),
    )
    verifier = _StretchOnly()
    updates = list(run_rounds(entry, verifier, plan, len(prompt), 1000, cancelled=lambda: False))
    assert verifier.stretches == [(10, 16, LookupStop(2, 3))]
    assert [list(u.token_ids) for u in updates] == [[100 + i] for i in range(16)]
    assert all(u.round.stretch and u.round.num_drafted == 0 for u in updates)
    assert [u.committed_len for u in updates] == list(range(11, 27)) and updates[-1].finished
    assert entry.length == 26


def test_main_logs_the_bound_port():
    process = subprocess.Popen(
        [sys.executable, "-m", "draft_service", "--address", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        line = json.loads(process.stderr.readline())
        assert line["port"] > 0
        with grpc.insecure_channel(f"127.0.0.1:{line['port']}") as channel:
            info = draft_pb2_grpc.DraftServiceStub(channel).Info(
                common_pb2.InfoRequest(), timeout=TIMEOUT_S
            )
        assert info.model.model_id == "ngram"
    finally:
        process.terminate()
        process.wait(10)


# The worker's command, reporting on stdout at exit which of torch and transformers it imported.
MAIN_REPORTING_IMPORTS = (
    "import atexit, sys\n"
    "atexit.register(lambda: print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'})))\n"
    "from draft_service.server import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_an_ngram_worker_serves_speculation_without_importing_torch(
    target, target_address, prompt_ids, references
):
    """A draft worker process without a model serves greedy and sampled Speculate calls
    against a real target, and never imports torch nor transformers: they would cost
    seconds of its start."""
    process = subprocess.Popen(
        [sys.executable, "-c", MAIN_REPORTING_IMPORTS, "--address", "127.0.0.1:0", "--model", ""],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        port = json.loads(process.stderr.readline())["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            wait_until(
                lambda: (
                    health.Check(
                        health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S, wait_for_ready=True
                    ).status
                    == health_pb2.HealthCheckResponse.SERVING
                ),
                "the n-gram worker serves",
            )
            pair = Pair(
                draft_pb2_grpc.DraftServiceStub(channel), target, target_address, prompt_ids[3]
            )
            greedy = pair.speculate(num_speculative_tokens=4)
            sampled = pair.speculate(
                common_pb2.SamplingParams(temperature=0.9, seed=7, max_new_tokens=MAX_NEW_TOKENS),
                num_speculative_tokens=4,
                adaptive=True,
            )
            pair.close()
    finally:
        process.terminate()  # a graceful stop: the report is printed at exit
        imported, errors = process.communicate(timeout=30)
    assert tokens_of(greedy) == references[3]
    # lookup proposed, the target verified
    assert any(update.round.num_drafted for update in greedy)
    assert len(tokens_of(sampled)) == MAX_NEW_TOKENS
    assert process.returncode == 0, errors[-2000:]
    assert imported.splitlines()[-1] == "[]"


def test_an_ngram_call_has_the_target_run_its_rounds_and_stays_exact(
    tiny_bigram, prompt_ids, draft_stubs
):
    """Adaptive n-gram calls across real sockets to a target whose text repeats: the
    whole call is stretches whose passes verify what prompt lookup finds, looked-up
    tokens accepted, no round trip per round; greedy output equals target-only, the
    committed lengths add up, and each token gets a source (the orchestrator's
    token_sources)."""
    server, address = _start(
        create_target_server(TargetConfig(address="127.0.0.1:0"), loaded_model=tiny_bigram)
    )
    try:
        with grpc.insecure_channel(address) as channel:
            target = target_pb2_grpc.TargetServiceStub(channel)
            accepted = 0
            for ids in prompt_ids[:4]:
                reference = (
                    SpeculativeGenerator(tiny_bigram)
                    .generate(ids, SamplingParams(max_new_tokens=MAX_NEW_TOKENS), k=0)
                    .token_ids
                )
                pair = Pair(draft_stubs["ngram"], target, address, ids, "ngram")
                updates = pair.speculate(num_speculative_tokens=4, adaptive=True)
                pair.close()
                assert tokens_of(updates) == reference
                assert [u.committed_len for u in updates] == [
                    len(ids) + n for n in itertools.accumulate(len(u.token_ids) for u in updates)
                ]
                assert all(
                    u.round.stretch and len(u.token_ids) == u.round.num_accepted + 1
                    for u in updates
                )
                assert all(len(token_sources(u.round)) == len(u.token_ids) for u in updates)
                accepted += sum(u.round.num_accepted for u in updates)
            # looked-up tokens crossed the wire in verdicts (Verdict.accepted_token_ids)
            assert accepted > 0
    finally:
        server.stop(0)


# --- adaptive speculation across a slow link ----------------------------------------------

LINK_DELAY_MS = 15  # one way: a 30 ms round trip against ~1 ms tiny-model steps


@pytest.fixture(scope="module")
def slow_target_address(target_address):
    """The target behind a delaying proxy: speculation cannot pay for its round trips."""
    with DelayProxy(target_address, LINK_DELAY_MS) as proxy:
        yield proxy.address


@pytest.mark.parametrize(
    ("worker", "drafter"), [("same", "model"), ("unrelated", "model"), ("same", "ngram")]
)
def test_adaptive_call_over_a_slow_link_has_the_target_decode_alone(
    worker, drafter, draft_stubs, target, slow_target_address, prompt_ids, references
):
    """The round trip costs more than anything a round can win, so after the first
    rounds the target decodes stretches alone, on the same Verify stream, the draft
    following their tokens (the n-gram drafter's stretches verify what prompt lookup
    finds: its rounds, run by the target). Same greedy output."""
    pair = Pair(draft_stubs[worker], target, slow_target_address, prompt_ids[3], drafter)
    updates = pair.speculate(num_speculative_tokens=4, adaptive=True)
    pair.close()
    assert tokens_of(updates) == references[3]
    stretched = [u for u in updates if u.round.stretch]
    assert sum(len(u.token_ids) for u in stretched) >= MAX_NEW_TOKENS // 2, [
        u.round.num_drafted for u in updates
    ]
    assert all(len(u.token_ids) == u.round.num_accepted + 1 for u in stretched)
    assert all(u.round.num_drafted == 0 for u in stretched) or drafter == "ngram"
    # The next session on this draft and target starts from the costs measured: its
    # first tokens are a stretch, before any round trip per token.
    pair = Pair(draft_stubs[worker], target, slow_target_address, prompt_ids[2], drafter)
    updates = pair.speculate(num_speculative_tokens=4, adaptive=True)
    pair.close()
    assert updates[0].round.stretch
    assert tokens_of(updates) == references[2]
