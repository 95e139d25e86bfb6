"""Deadlines that follow the client, over real gRPC on loopback.

A call slow because other sessions share its workers must live as long as its
client's deadline: no fixed cap on a whole call (the orchestrator's
generate_timeout_s, the draft's Verify stream) may cut it. What stays bounded is one
wait: a verdict the target does not send (verdict_stall_timeout_s), a session another
call holds (session_wait_timeout_s).

The target is scripted (answers after a delay, or stops answering); the draft worker
is the real one with the n-gram drafter, the orchestrator the real one. Timeouts are
configured small so that each test takes seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent import futures

import grpc
import pytest

from draft_service.config import DraftConfig
from draft_service.server import create_server as create_draft_server
from orchestrator.config import OrchestratorConfig
from orchestrator.server import create_server as create_orchestrator
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from tests.scripted_target import BookkeepingTarget

WAIT_S = 30.0  # client deadlines, and the bound on anything a test waits for when correct
STALL_S = 1.0  # the draft's verdict_stall_timeout_s in these tests
REPLY_DELAY_S = 0.3  # the scripted target's time per verdict or decoded token: < STALL_S
NUM_TOKENS = 8  # one per round: NUM_TOKENS * REPLY_DELAY_S outlasts STALL_S and GENERATE_TIMEOUT_S
GENERATE_TIMEOUT_S = 1.0  # the orchestrator's bound for a client without a deadline
RPC_TIMEOUT_S = 0.5  # the orchestrator's bookkeeping calls
PROMPT = [5, 6, 5, 6, 5, 6]  # periodic: the n-gram drafter always proposes
# What speculation from PROMPT commits: the period, then 5 after the last round's empty
# draft (with one token of room left, it drafts none).
SPECULATED = [5, 6] * (NUM_TOKENS // 2 - 1) + [5, 5]


class ScriptedTarget(BookkeepingTarget):
    """A target worker that keeps the prompt's period: each round rejects the draft and
    commits the draft's first token (5 after an empty draft), each decoded token is 5.
    Answers after `reply_delay_s`, opens sessions after `prefill_delay_s`, and stops
    answering verdicts after `answers` of them until `release` is set."""

    def __init__(
        self, reply_delay_s: float = 0.0, prefill_delay_s: float = 0.0, answers: int | None = None
    ):
        self.reply_delay_s = reply_delay_s
        self.prefill_delay_s = prefill_delay_s
        self.answers = answers
        self.answered = 0
        self.stalled = threading.Event()  # it holds a proposal it will not answer
        self.cancelled = threading.Event()  # the stalled stream was cancelled by the draft
        self.release = threading.Event()  # set at teardown: every wait ends

    def OpenSession(self, request, context):
        self.release.wait(self.prefill_delay_s)
        return super().OpenSession(request, context)

    def Verify(self, request_iterator, context):
        for proposal in request_iterator:
            if self.answers is not None and self.answered >= self.answers:
                self._stall(context)
                return
            self.release.wait(self.reply_delay_s)
            self.answered += 1
            yield target_pb2.Verdict(
                session_id=proposal.session_id,
                round=proposal.round,
                base_len=proposal.base_len,
                decision=target_pb2.Decision(
                    num_accepted=0,
                    next_token_id=(list(proposal.draft.token_ids) or [5])[0],
                    next_token_kind=common_pb2.NEXT_TOKEN_KIND_RECOVERED,
                    committed_len=proposal.base_len + 1,
                    target_compute_ns=1000,
                ),
            )

    def _stall(self, context) -> None:
        self.stalled.set()
        while context.is_active() and not self.release.wait(0.05):
            pass
        if not context.is_active():
            self.cancelled.set()

    def Decode(self, request, context):
        for index in range(request.max_tokens or request.sampling.max_new_tokens):
            self.release.wait(self.reply_delay_s)
            yield target_pb2.DecodeToken(
                token_id=5, committed_len=request.base_len + index + 1, compute_ns=1000
            )


@pytest.fixture
def servers():
    """Starts servers for one test, stops them after it: start(kind, ...) -> address."""
    with contextlib.ExitStack() as stack:

        def start_target(target: ScriptedTarget) -> str:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
            target_pb2_grpc.add_TargetServiceServicer_to_server(target, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            stack.callback(server.stop, 0)
            stack.callback(target.release.set)  # first: frees the handlers still waiting
            return f"127.0.0.1:{port}"

        def start_service(service) -> str:
            service.start()
            stack.callback(service.stop, 0)
            return f"127.0.0.1:{service.port}"

        def channel(address: str) -> grpc.Channel:
            return stack.enter_context(grpc.insecure_channel(address))

        yield start_target, start_service, channel


def _draft(servers, **config) -> draft_pb2_grpc.DraftServiceStub:
    _, start_service, channel = servers
    config = {"verdict_stall_timeout_s": STALL_S, **config}
    address = start_service(create_draft_server(DraftConfig(address="127.0.0.1:0", **config)))
    return draft_pb2_grpc.DraftServiceStub(channel(address))


def _open_draft_session(draft, target_address: str) -> draft_pb2.SpeculateRequest:
    """A draft session on PROMPT, and a Speculate request from it against the target."""
    handle = draft.OpenSession(
        draft_pb2.DraftOpenSessionRequest(prompt_token_ids=PROMPT, drafter="ngram"), timeout=WAIT_S
    ).handle
    return draft_pb2.SpeculateRequest(
        session_id=handle.session_id,
        base_len=len(PROMPT),
        target=common_pb2.KvHandle(
            worker_address=target_address, session_id="target-session", committed_len=len(PROMPT)
        ),
        sampling=common_pb2.SamplingParams(max_new_tokens=NUM_TOKENS),
        speculation=common_pb2.SpeculationParams(num_speculative_tokens=4),
    )


# --- the draft worker -------------------------------------------------------------------


def test_speculate_outlasts_the_stall_timeout_while_each_verdict_comes_within_it(servers):
    """NUM_TOKENS rounds of REPLY_DELAY_S each: longer in all than STALL_S, which only
    bounds one verdict; the caller's deadline allows the whole call."""
    start_target, _, _ = servers
    target_address = start_target(ScriptedTarget(reply_delay_s=REPLY_DELAY_S))
    draft = _draft(servers)
    request = _open_draft_session(draft, target_address)
    start = time.monotonic()
    updates = list(draft.Speculate(request, timeout=WAIT_S))
    assert time.monotonic() - start > STALL_S
    assert [t for u in updates for t in u.token_ids] == SPECULATED
    assert updates[-1].finished and updates[-1].committed_len == len(PROMPT) + NUM_TOKENS


def test_a_target_that_stops_answering_fails_the_call_within_the_stall_timeout(servers):
    """Two verdicts, then none: UNAVAILABLE naming the target and the setting about
    STALL_S after the last one (not at the caller's deadline); the target's stream is
    cancelled, and the draft session, which held the unanswered proposal, is back at
    the committed length."""
    start_target, _, _ = servers
    target = ScriptedTarget(answers=2)
    target_address = start_target(target)
    draft = _draft(servers)
    request = _open_draft_session(draft, target_address)
    updates = []
    with pytest.raises(grpc.RpcError) as caught:
        for update in draft.Speculate(request, timeout=WAIT_S):
            updates.append(update)
            last = time.monotonic()
    waited = time.monotonic() - last
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
    assert (
        target_address in caught.value.details()
        and "verdict_stall_timeout_s" in caught.value.details()
    )
    assert STALL_S <= waited < STALL_S + 5.0
    assert target.cancelled.wait(WAIT_S)
    committed_len = len(PROMPT) + 2
    assert [u.committed_len for u in updates] == [len(PROMPT) + 1, committed_len]
    # Extend only succeeds at the session's exact length.
    extended = draft.Extend(
        common_pb2.ExtendRequest(
            session_id=request.session_id, base_len=committed_len, token_ids=[5]
        ),
        timeout=WAIT_S,
    )
    assert extended.committed_len == committed_len + 1


def test_a_busy_session_is_waited_for_at_most_session_wait_timeout_s(servers):
    """A Truncate behind a Speculate whose verdict does not come: ABORTED after the
    setting, although the caller's deadline would wait longer."""
    start_target, _, _ = servers
    target = ScriptedTarget(answers=0)
    target_address = start_target(target)
    draft = _draft(servers, verdict_stall_timeout_s=WAIT_S, session_wait_timeout_s=0.5)
    request = _open_draft_session(draft, target_address)
    speculate = draft.Speculate(request, timeout=WAIT_S)
    holder = threading.Thread(target=_drain, args=(speculate,), daemon=True)
    holder.start()
    assert target.stalled.wait(WAIT_S)  # the Speculate call holds the session
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        draft.Truncate(
            common_pb2.TruncateRequest(session_id=request.session_id, length=len(PROMPT)),
            timeout=WAIT_S,
        )
    assert caught.value.code() == grpc.StatusCode.ABORTED, caught.value.details()
    assert 0.5 <= time.monotonic() - start < WAIT_S / 2
    speculate.cancel()
    target.release.set()
    holder.join(WAIT_S)


def _drain(call) -> None:
    with contextlib.suppress(grpc.RpcError):
        for _ in call:
            pass


# --- the orchestrator -------------------------------------------------------------------


def _orchestrator(servers, tiny_target, target_address: str, draft_address: str = ""):
    _, start_service, channel = servers
    config = OrchestratorConfig(
        address="127.0.0.1:0",
        target_addresses=target_address,
        draft_addresses=draft_address,
        generate_timeout_s=GENERATE_TIMEOUT_S,
        rpc_timeout_s=RPC_TIMEOUT_S,
    )
    address = start_service(create_orchestrator(config, tokenizer=tiny_target.tokenizer))
    return orchestrator_pb2_grpc.OrchestratorStub(channel(address))


def _generate_request(k: int) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
        sampling=common_pb2.SamplingParams(max_new_tokens=NUM_TOKENS),
        speculation=common_pb2.SpeculationParams(num_speculative_tokens=k, drafter="ngram"),
    )


def test_a_client_deadline_longer_than_generate_timeout_s_is_followed(servers, tiny_target):
    """Target-only decoding slower in all than generate_timeout_s, a prefill slower
    than rpc_timeout_s: the client's deadline allows both, so the call succeeds."""
    start_target, _, _ = servers
    target_address = start_target(
        ScriptedTarget(reply_delay_s=REPLY_DELAY_S, prefill_delay_s=2 * RPC_TIMEOUT_S)
    )
    orchestrator = _orchestrator(servers, tiny_target, target_address)
    start = time.monotonic()
    response = orchestrator.Generate(_generate_request(k=0), timeout=WAIT_S)
    assert time.monotonic() - start > GENERATE_TIMEOUT_S
    assert list(response.token_ids) == [5] * NUM_TOKENS


def test_speculation_under_load_lives_as_long_as_the_client_deadline(servers, tiny_target):
    """The measured failure: client -> orchestrator -> draft -> target, each verdict
    slow (a busy target), the whole call longer than generate_timeout_s and the draft's
    stall timeout; the client's deadline reaches the draft's Verify stream."""
    start_target, _, _ = servers
    target_address = start_target(ScriptedTarget(reply_delay_s=REPLY_DELAY_S))
    draft_address = _draft_address(servers)
    orchestrator = _orchestrator(servers, tiny_target, target_address, draft_address)
    start = time.monotonic()
    response = orchestrator.Generate(_generate_request(k=4), timeout=WAIT_S)
    assert time.monotonic() - start > max(GENERATE_TIMEOUT_S, STALL_S)
    assert list(response.token_ids) == SPECULATED


def _draft_address(servers) -> str:
    _, start_service, _ = servers
    return start_service(
        create_draft_server(DraftConfig(address="127.0.0.1:0", verdict_stall_timeout_s=STALL_S))
    )


def test_without_a_client_deadline_generate_timeout_s_bounds_the_call(servers, tiny_target):
    start_target, _, _ = servers
    target_address = start_target(ScriptedTarget(reply_delay_s=REPLY_DELAY_S))
    orchestrator = _orchestrator(servers, tiny_target, target_address)
    call = orchestrator.Generate.future(_generate_request(k=0))  # no deadline
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        call.result(timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value.details()
    assert time.monotonic() - start < NUM_TOKENS * REPLY_DELAY_S
