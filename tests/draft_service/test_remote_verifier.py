"""RemoteVerifier, the draft service's end of a Verify stream, against a scripted target
over real gRPC on loopback.

The stream opens with the first proposal and closes without waiting for the target to
end it: across a slow link, a Speculate call must not spend a round trip to the target
on its way out. A stretch (the target decoding alone) is one proposal answered by a
verdict per token, on the same stream as the rounds around it.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from draft_service.remote_verifier import RemoteVerifier
from service_common.deadlines import Deadline
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from speculative.sampling import SamplingParams

WAIT_S = 30  # generous bound on what must happen; nothing here waits it out when correct


class ScriptedTarget(target_pb2_grpc.TargetServiceServicer):
    """Rejects every draft token and commits one token per proposal (a stretch: tokens
    7, 8, ...); after the client half-closes, ends the stream only once `release` is set."""

    def __init__(self):
        self.streams_opened = 0
        self.half_closed = threading.Event()
        self.release = threading.Event()
        self.ended = threading.Event()

    def Verify(self, request_iterator, context):
        self.streams_opened += 1
        for proposal in request_iterator:
            if proposal.HasField("stretch"):
                yield from self._stretch(proposal)
                continue
            yield target_pb2.Verdict(
                session_id=proposal.session_id,
                round=proposal.round,
                base_len=proposal.base_len,
                decision=target_pb2.Decision(
                    num_accepted=0,
                    next_token_id=7,
                    next_token_kind=common_pb2.NEXT_TOKEN_KIND_RECOVERED,
                    committed_len=proposal.base_len + 1,
                    target_compute_ns=1000,
                ),
            )
        self.half_closed.set()
        self.release.wait(WAIT_S)
        self.ended.set()

    def _stretch(self, proposal):
        for offset in range(proposal.stretch.max_tokens):
            base_len = proposal.base_len + offset
            decision = target_pb2.Decision(
                next_token_id=7 + offset,
                next_token_kind=common_pb2.NEXT_TOKEN_KIND_BONUS,
                committed_len=base_len + 1,
                target_compute_ns=1000,
            )
            yield target_pb2.Verdict(
                session_id=proposal.session_id,
                round=proposal.round,
                base_len=base_len,
                stretch_pass=target_pb2.StretchPass(
                    decision=decision, ended=offset == proposal.stretch.max_tokens - 1
                ),
            )


@pytest.fixture
def scripted_target():
    target = ScriptedTarget()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    target_pb2_grpc.add_TargetServiceServicer_to_server(target, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield target, target_pb2_grpc.TargetServiceStub(channel), f"127.0.0.1:{port}"
    target.release.set()
    channel.close()
    server.stop(0)


def _verifier(stub, address: str) -> RemoteVerifier:
    return RemoteVerifier(
        stub,
        address,
        "session-1",
        SamplingParams(),
        first_round=0,
        deadline=Deadline(WAIT_S),
        stall_timeout_s=WAIT_S,
    )


def _verify(verifier: RemoteVerifier, base_len: int, token_ids: list[int], probs):
    verifier.send(base_len, token_ids, probs)
    return verifier.receive()


def test_no_stream_is_opened_without_a_proposal(scripted_target):
    target, stub, address = scripted_target
    _verifier(stub, address).close()
    # A stream, had one opened, would reach the server: a later call proves it did not.
    verifier = _verifier(stub, address)
    _verify(verifier, 10, [1, 2], None)
    verifier.close()
    assert target.half_closed.wait(WAIT_S)
    assert target.streams_opened == 1


def test_close_does_not_wait_for_the_target_to_end_the_stream(scripted_target):
    target, stub, address = scripted_target
    verifier = _verifier(stub, address)
    result = _verify(verifier, 10, [1, 2], None)
    assert (result.token_ids, result.committed_len) == ([7], 11)

    closed = threading.Event()
    threading.Thread(target=lambda: (verifier.close(), closed.set()), daemon=True).start()
    assert closed.wait(WAIT_S), "close() waited for the target to end the stream"
    assert not target.ended.is_set()  # the target still holds its end open

    assert target.half_closed.wait(WAIT_S)  # the half-close reached the target all the same
    target.release.set()
    assert target.ended.wait(WAIT_S)


def test_a_stretch_streams_its_tokens_between_rounds_on_one_stream(scripted_target):
    target, stub, address = scripted_target
    verifier = _verifier(stub, address)
    assert _verify(verifier, 10, [1], None).committed_len == 11
    results = list(verifier.decode(11, 3))
    assert [(r.token_ids, r.committed_len) for r in results] == [([7], 12), ([8], 13), ([9], 14)]
    assert verifier.round == 2  # the stretch was one proposal
    result = _verify(verifier, 14, [1, 2], None)
    assert (result.token_ids, result.committed_len) == ([7], 15)
    verifier.close()
    assert target.half_closed.wait(WAIT_S) and target.streams_opened == 1


def test_a_stretch_left_early_is_cancelled_by_close(scripted_target):
    target, stub, address = scripted_target
    verifier = _verifier(stub, address)
    tokens = verifier.decode(10, 1000)
    assert next(tokens).committed_len == 11
    tokens.close()  # the caller stopped: the rest of the stretch is never read
    closed = threading.Event()
    threading.Thread(target=lambda: (verifier.close(), closed.set()), daemon=True).start()
    assert closed.wait(WAIT_S)
