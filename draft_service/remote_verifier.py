"""The target as the speculation loop sees it, across the network.

`RemoteVerifier` implements the loop's `Verifier` protocol (speculative.verifier)
over one open bidirectional `TargetService.Verify` stream: each round sends one
Proposal and reads one Verdict, one round trip per round; `decode` sends one stretch
proposal and reads a verdict per pass the target makes in it (a token alone, or with the prompt-lookup tokens it verified). The stream
lives as long as the Speculate caller's deadline; each verdict is waited for at most a
stall timeout. The channels it runs on: `draft_service.target_connections`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from draft_service.target_connections import as_target_error
from service_common.convert import (
    NEXT_TOKEN_KIND_FROM_PROTO,
    lookup_rounds_to_proto,
    lookup_stop_to_proto,
    sampling_to_proto,
    sparse_to_proto,
    step_load_from_proto,
)
from service_common.deadlines import Deadline
from service_common.status import Unavailable
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from speculative.errors import StaleProposal
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.types import SamplingParams, Verdict, VerifyResult

if TYPE_CHECKING:
    from speculative.sampling import SparseProbs  # only a model drafter's proposals carry them

log = logging.getLogger(__name__)

# On the request queue: half-closes the Verify stream; on the verdict queue: the target ended it.
_END_OF_STREAM = None


class RemoteVerifier:
    """A Verifier over one Verify stream to one target session. Not thread-safe: one
    speculation loop drives it; `close()` ends the stream.

    The stream opens with the first proposal and closes without waiting for the
    target's end of it.

    Two limits, so that a call under load is not cut while its caller still waits: the
    stream's deadline is the caller's (`deadline`, whenever the stream opens), and
    each verdict is waited for at most `stall_timeout_s` seconds (a hung target), then
    UNAVAILABLE. A thread reads the verdicts into a queue: a gRPC response iterator's
    next() cannot time out, a queue's get() can."""

    def __init__(
        self,
        stub: target_pb2_grpc.TargetServiceStub,
        address: str,
        target_session_id: str,
        params: SamplingParams,
        first_round: int,
        deadline: Deadline,
        stall_timeout_s: float,
        overlaps: bool = True,
    ):
        """overlaps: the target verifies while the draft drafts (False: never draft ahead)."""
        self.address = address
        self.overlaps = overlaps
        self.runs_lookup = True  # it runs a prompt-lookup drafter's rounds inside stretches (Stretch.lookup_rounds)
        self.session_id = target_session_id
        self.round = first_round  # Proposal.round of the next proposal (0-based per session)
        self.proposal_bytes = 0  # serialized size of the last Proposal, in bytes
        self.verdict_bytes = 0  # serialized size of the last Verdict, in bytes
        self._sampling = sampling_to_proto(params)  # sent with the first proposal only
        self._stub = stub
        self._deadline = deadline  # bounds the stream, whenever it opens
        self._stall_timeout_s = stall_timeout_s
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._verdicts: queue.SimpleQueue = queue.SimpleQueue()  # filled by _read_verdicts
        self._received_ns = 0  # when the verdict read last came
        self._responses = None  # the Verify call, once the first proposal opens it
        # Proposals sent whose verdicts are not read yet, oldest first: [proposal, abandoned].
        self._outstanding: collections.deque[list] = collections.deque()
        self._closed = threading.Event()  # set by close(); the reader then only logs

    def send(self, base_len: int, draft_token_ids: Sequence[int], draft_probs: Sequence[SparseProbs] | None,
             expected_last_token_id: int | None = None) -> None:
        """Sends one proposal; its verdict comes with receive(), in order."""
        proposal = self._proposal(base_len)
        proposal.draft.CopyFrom(target_pb2.Draft(
            token_ids=list(draft_token_ids), distributions=[sparse_to_proto(probs) for probs in draft_probs or ()]))
        if expected_last_token_id is not None:
            proposal.expected_last_token_id = expected_last_token_id
        self._put(proposal)

    def receive(self) -> VerifyResult:
        """The verdict on the oldest proposal not received yet, skipping the abandoned
        ones (which the target must have discarded); StaleProposal if it was discarded."""
        self._skip_abandoned()
        proposal, _ = self._outstanding.popleft()
        verdict = self._next_verdict()
        self.verdict_bytes = verdict.ByteSize()
        return self._result(proposal.round, proposal.base_len, proposal.draft.token_ids, verdict)

    def _skip_abandoned(self) -> None:
        """Reads the verdicts of the oldest proposals the loop abandoned: the target must
        have discarded them."""
        while self._outstanding and self._outstanding[0][1]:
            proposal, _ = self._outstanding.popleft()
            if self._next_verdict().WhichOneof("kind") != "discarded":
                raise RuntimeError(
                    f"target worker at {self.address} applied a proposal at length {proposal.base_len} "
                    "whose context the draft knew to be wrong"
                )

    def verdict_came(self) -> bool:
        # Verdicts (or how the stream ended) come in the order of the proposals.
        return bool(self._outstanding) and self._verdicts.qsize() >= len(self._outstanding)

    def abandon_last(self) -> None:
        self._outstanding[-1][1] = True

    def _put(self, proposal: target_pb2.Proposal) -> None:
        self.proposal_bytes = proposal.ByteSize()
        if self._responses is None:
            self._open()
        self._requests.put(proposal)
        self._outstanding.append([proposal, False])
        self.round += 1

    def decode(self, base_len: int, max_tokens: int, until: LookupStop | None = None,
               lookup: LookupRounds | None = None) -> Iterator[VerifyResult]:
        """A stretch: the target decodes up to max_tokens tokens (ending early where
        prompt lookup with `until`'s sizes finds text to copy; verifying what it finds
        with `lookup`), one result per pass as it arrives; StaleProposal if it was
        discarded. Closing the iterator before the stretch ended leaves its verdicts
        unread: the stream is then only good for close()."""
        self._skip_abandoned()
        assert not self._outstanding, "a stretch starts with nothing in flight"
        proposal = self._proposal(base_len)
        proposal.stretch.CopyFrom(target_pb2.Stretch(
            max_tokens=max_tokens, until_lookup=lookup_stop_to_proto(until) if until else None,
            lookup_rounds=lookup_rounds_to_proto(lookup) if lookup else None))
        self._put(proposal)
        while self._outstanding:
            verdict = self._next_verdict()
            self.verdict_bytes = verdict.ByteSize()
            if verdict.WhichOneof("kind") != "stretch_pass" or verdict.stretch_pass.ended:
                self._outstanding.popleft()
            # Each pass is checked as a round from the length before it, of the looked-up
            # tokens it accepted.
            stretch_pass = verdict.stretch_pass
            result = self._result(proposal.round, base_len, stretch_pass.accepted_token_ids, verdict,
                                  num_drafted=stretch_pass.num_looked_up)
            yield result
            base_len = result.committed_len

    def _open(self) -> None:
        """Opens the stream; gRPC reads the request queue on its own thread, and our
        reader thread moves the verdicts into _verdicts."""
        self._responses = self._stub.Verify(iter(self._requests.get, _END_OF_STREAM),
                                            timeout=self._deadline.remaining())
        threading.Thread(target=_read_verdicts, args=(self._responses, self._verdicts, self._closed, self.address),
                         name="verify-read", daemon=True).start()

    def _proposal(self, base_len: int) -> target_pb2.Proposal:
        proposal = target_pb2.Proposal(session_id=self.session_id, round=self.round, base_len=base_len)
        if self._sampling is not None:
            proposal.sampling.CopyFrom(self._sampling)
            self._sampling = None
        return proposal

    def _next_verdict(self) -> target_pb2.Verdict:
        try:
            item = self._verdicts.get(timeout=self._stall_timeout_s)
        except queue.Empty:
            self._responses.cancel()  # gives up on the target: frees its end of the stream
            raise Unavailable(
                f"target worker at {self.address} sent no verdict for {self._stall_timeout_s:g} s "
                "(verdict_stall_timeout_s): giving up on it"
            ) from None
        if isinstance(item, grpc.RpcError):
            raise as_target_error(self.address, item)
        if item is _END_OF_STREAM:
            raise Unavailable(f"target worker at {self.address} ended the Verify stream without a verdict")
        self._received_ns, verdict = item
        return verdict

    def _result(self, round_index: int, base_len: int, proposed: Sequence[int], verdict: target_pb2.Verdict,
                num_drafted: int | None = None) -> VerifyResult:
        """Verdict -> VerifyResult, as speculative.target.TargetSession.verify returns it:
        the decision on `proposed` (a draft, or the looked-up tokens a stretch's pass
        accepted, of num_drafted it verified) at base_len."""
        if verdict.round != round_index or verdict.base_len != base_len:
            raise RuntimeError(
                f"target worker at {self.address} answered round {verdict.round} at length "
                f"{verdict.base_len} to round {round_index} at length {base_len}"
            )
        kind = verdict.WhichOneof("kind")
        if kind == "discarded":
            raise StaleProposal(
                f"target worker at {self.address} discarded the proposal at length {base_len}: "
                f"its session {self.session_id!r} holds {verdict.discarded.committed_len} committed tokens; "
                "truncate both sessions to the committed length and retry"
            )
        decision = verdict.stretch_pass.decision if kind == "stretch_pass" else verdict.decision
        self._check(decision, base_len, len(proposed), kind)
        decided = Verdict(
            decision.num_accepted, decision.next_token_id, NEXT_TOKEN_KIND_FROM_PROTO[decision.next_token_kind]
        )
        return VerifyResult(
            verdict=decided,
            token_ids=decided.committed_tokens(list(proposed))[: decision.committed_len - base_len],
            committed_len=decision.committed_len,
            stopped=decision.finish_reason == common_pb2.FINISH_REASON_STOP_TOKEN,
            target_compute_ns=decision.target_compute_ns,
            step=step_load_from_proto(decision.step),
            received_ns=self._received_ns,
            num_drafted=len(proposed) if num_drafted is None else num_drafted,
        )

    def _check(self, decision: target_pb2.Decision, base_len: int, num_proposed: int, kind: str | None) -> None:
        num_committed = decision.committed_len - base_len
        if not (kind in ("decision", "stretch_pass")
                and 0 <= decision.num_accepted <= num_proposed
                and 1 <= num_committed <= decision.num_accepted + 1
                and decision.next_token_kind in NEXT_TOKEN_KIND_FROM_PROTO):
            raise RuntimeError(
                f"target worker at {self.address} sent an inconsistent verdict ({kind or 'empty'}): "
                f"{decision.num_accepted} of {num_proposed} accepted, committed length "
                f"{decision.committed_len} after {base_len}, next token kind {decision.next_token_kind}"
            )

    def close(self) -> None:
        """Ends the stream: half-closes it (the reader thread waits for the target's
        end), or cancels it when a verdict is still outstanding (after an error).
        Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._requests.put(_END_OF_STREAM)  # also frees gRPC's request-reading thread
        if self._responses is not None and self._outstanding:
            self._responses.cancel()


def _read_verdicts(responses, verdicts: queue.SimpleQueue, closed: threading.Event, address: str) -> None:
    """Moves a Verify stream's verdicts into `verdicts`, then how it ended: _END_OF_STREAM,
    or its grpc.RpcError. Once the verifier is closed nobody reads them: what should
    not come is logged."""
    try:
        for verdict in responses:
            if closed.is_set():
                log.warning("unexpected verdict after the last proposal",
                            extra={"fields": {"target": address, "round": verdict.round}})
            verdicts.put((time.perf_counter_ns(), verdict))  # when it came, for the loop's timings
        verdicts.put(_END_OF_STREAM)
    except grpc.RpcError as error:
        if closed.is_set() and error.code() != grpc.StatusCode.CANCELLED:
            log.warning("Verify stream ended with an error",
                        extra={"fields": {"target": address, "code": error.code().name,
                                          "details": error.details()}})
        verdicts.put(error)
