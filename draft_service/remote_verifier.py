"""The target as the speculation loop sees it, across the network: the loop's `Verifier`
(speculative.verifier) over a `TargetService.Verify` stream (channels: draft_service.target_connections)."""

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
from foundation.errors import StaleProposal
from service_common.convert import (
    NEXT_TOKEN_KIND_FROM_PROTO,
    decision_from_proto,
    lookup_rounds_to_proto,
    lookup_stop_to_proto,
    sampling_to_proto,
    sparse_to_proto,
)
from service_common.deadlines import Deadline
from service_common.status import Unavailable
from specdec.v1 import target_pb2, target_pb2_grpc
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.types import SamplingParams, VerifyResult

if TYPE_CHECKING:
    from speculative.sampling import SparseProbs  # only a model drafter's proposals carry them

log = logging.getLogger(__name__)

# On the request queue: half-closes the Verify stream; on the verdict queue: the target ended it.
_END_OF_STREAM = None


class RemoteVerifier:
    """A Verifier over one Verify stream to one target session. Not thread-safe: one speculation
    loop drives it. The stream opens with the first proposal; `close()` ends it without waiting
    for the target's end of it.

    Two limits, so that a call under load is not cut while its caller still waits: the stream's
    deadline is the caller's (`deadline`, whenever the stream opens), and each verdict is waited
    for at most `stall_timeout_s` (a hung target), then UNAVAILABLE. A thread reads the verdicts
    into a queue: a gRPC response iterator's next() cannot time out, a queue's get() can."""

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
        self.address = address
        self.overlaps = overlaps  # False: never draft ahead of a verdict
        self.runs_lookup = True
        self.session_id = target_session_id
        self.round = first_round  # Proposal.round of the next proposal (0-based per session)
        self.proposal_bytes = self.verdict_bytes = (
            0  # serialized sizes of the last Proposal and Verdict
        )
        self._sampling = sampling_to_proto(params)  # sent with the first proposal only
        self._stub, self._deadline, self._stall_timeout_s = stub, deadline, stall_timeout_s
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._verdicts: queue.SimpleQueue = queue.SimpleQueue()  # filled by _read_verdicts
        self._received_ns = 0  # when the verdict read last came
        self._responses = None  # the Verify call, once the first proposal opens it
        # Proposals sent whose verdicts are not read yet, oldest first: [proposal, abandoned].
        self._outstanding: collections.deque[list] = collections.deque()
        self._closed = threading.Event()  # set by close(); the reader then only logs

    def send(
        self,
        base_len: int,
        draft_token_ids: Sequence[int],
        draft_probs: Sequence[SparseProbs] | None,
        expected_last_token_id: int | None = None,
        parents: Sequence[int] | None = None,
    ) -> None:
        draft = target_pb2.Draft(
            token_ids=list(draft_token_ids),
            parents=list(parents or ()),
            distributions=[sparse_to_proto(probs) for probs in draft_probs or ()],
        )
        self._put(
            target_pb2.Proposal(
                base_len=base_len, draft=draft, expected_last_token_id=expected_last_token_id
            )
        )

    def receive(self) -> VerifyResult:
        self._skip_abandoned()
        proposal, _ = self._outstanding.popleft()
        verdict, draft = self._next_verdict(), proposal.draft
        proposed = self._path_tokens(draft, verdict.decision) if draft.parents else draft.token_ids
        return self._result(
            proposal.round,
            proposal.base_len,
            proposed,
            verdict,
            num_drafted=len(draft.token_ids),
            tree=bool(draft.parents),
        )

    def _path_tokens(self, draft: target_pb2.Draft, decision: target_pb2.Decision) -> list[int]:
        """The tokens of a tree's accepted path, checked to be a path from the root."""
        path, parent = list(decision.path), -1
        for node in path:
            if not (0 <= node < len(draft.token_ids) and draft.parents[node] == parent):
                raise RuntimeError(
                    f"target worker at {self.address} sent an inconsistent verdict: path {path} "
                    f"is not a path of the proposed tree"
                )
            parent = node
        if len(path) != decision.num_accepted:
            raise RuntimeError(
                f"target worker at {self.address} sent an inconsistent verdict: a path of "
                f"{len(path)} nodes for {decision.num_accepted} accepted tokens"
            )
        return [draft.token_ids[node] for node in path]

    def verdict_came(self) -> bool:
        # Verdicts (or how the stream ended) come in the order of the proposals.
        return bool(self._outstanding) and self._verdicts.qsize() >= len(self._outstanding)

    def abandon_last(self) -> None:
        self._outstanding[-1][1] = True

    def decode(
        self,
        base_len: int,
        max_tokens: int,
        until: LookupStop | None = None,
        lookup: LookupRounds | None = None,
    ) -> Iterator[VerifyResult]:
        """Closing the iterator mid-stretch leaves its verdicts unread: the stream is then only good for close()."""
        self._skip_abandoned()
        assert not self._outstanding, "a stretch starts with nothing in flight"
        proposal = self._put(
            target_pb2.Proposal(
                base_len=base_len,
                stretch=target_pb2.Stretch(
                    max_tokens=max_tokens,
                    until_lookup=lookup_stop_to_proto(until) if until else None,
                    lookup_rounds=lookup_rounds_to_proto(lookup) if lookup else None,
                ),
            )
        )
        while self._outstanding:
            verdict = self._next_verdict()
            if verdict.WhichOneof("kind") != "stretch_pass" or verdict.stretch_pass.ended:
                self._outstanding.popleft()
            # Each pass is checked as a round from the length before it, of the looked-up tokens it accepted.
            result = self._result(
                proposal.round,
                base_len,
                verdict.stretch_pass.accepted_token_ids,
                verdict,
                num_drafted=verdict.stretch_pass.num_looked_up,
            )
            yield result
            base_len = result.committed_len

    def _skip_abandoned(self) -> None:
        while self._outstanding and self._outstanding[0][1]:
            proposal, _ = self._outstanding.popleft()
            if self._next_verdict().WhichOneof("kind") != "discarded":
                raise RuntimeError(
                    f"target worker at {self.address} applied a proposal at length "
                    f"{proposal.base_len} whose context the draft knew to be wrong"
                )

    def _put(self, proposal: target_pb2.Proposal) -> target_pb2.Proposal:
        proposal.session_id, proposal.round = self.session_id, self.round
        if self._sampling is not None:
            proposal.sampling.CopyFrom(self._sampling)
            self._sampling = None
        self.proposal_bytes = proposal.ByteSize()
        # gRPC reads the requests on its own thread; ours moves the verdicts
        if self._responses is None:
            self._responses = self._stub.Verify(
                iter(self._requests.get, _END_OF_STREAM), timeout=self._deadline.remaining()
            )
            threading.Thread(
                target=_read_verdicts,
                args=(self._responses, self._verdicts, self._closed, self.address),
                name="verify-read",
                daemon=True,
            ).start()
        self._requests.put(proposal)
        self._outstanding.append([proposal, False])
        self.round += 1
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
            raise Unavailable(
                f"target worker at {self.address} ended the Verify stream without a verdict"
            )
        self._received_ns, verdict = item
        self.verdict_bytes = verdict.ByteSize()
        return verdict

    def _result(
        self,
        round_index: int,
        base_len: int,
        proposed: Sequence[int],
        verdict: target_pb2.Verdict,
        num_drafted: int | None = None,
        tree: bool = False,
    ) -> VerifyResult:
        """The verdict checked, as TargetSession.verify returns it (see decision_from_proto)."""
        if verdict.round != round_index or verdict.base_len != base_len:
            raise RuntimeError(
                f"target worker at {self.address} answered round {verdict.round} at length "
                f"{verdict.base_len} to round {round_index} at length {base_len}"
            )
        kind = verdict.WhichOneof("kind")
        if kind == "discarded":
            raise StaleProposal(
                f"target worker at {self.address} discarded the proposal at length {base_len}: "
                f"its session {self.session_id!r} holds {verdict.discarded.committed_len} committed "
                "tokens; truncate both sessions to the committed length and retry"
            )
        decision = verdict.stretch_pass.decision if kind == "stretch_pass" else verdict.decision
        if not (
            kind in ("decision", "stretch_pass")
            and 0 <= decision.num_accepted <= len(proposed)
            and 1 <= decision.committed_len - base_len <= decision.num_accepted + 1
            and decision.next_token_kind in NEXT_TOKEN_KIND_FROM_PROTO
        ):
            raise RuntimeError(
                f"target worker at {self.address} sent an inconsistent verdict ({kind or 'empty'}): "
                f"{decision.num_accepted} of {len(proposed)} accepted, committed length "
                f"{decision.committed_len} after {base_len}, next token kind {decision.next_token_kind}"
            )
        return decision_from_proto(
            decision, base_len, proposed, self._received_ns, num_drafted, tree
        )

    def close(self) -> None:
        """Half-closes the stream, or cancels it while a verdict is outstanding (after an error). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._requests.put(_END_OF_STREAM)  # also frees gRPC's request-reading thread
        if self._responses is not None and self._outstanding:
            self._responses.cancel()


def _read_verdicts(
    responses, verdicts: queue.SimpleQueue, closed: threading.Event, address: str
) -> None:
    """Moves a Verify stream's verdicts into `verdicts`, then how it ended (_END_OF_STREAM or
    its grpc.RpcError). Once the verifier is closed nobody reads them: what should not come is logged."""
    try:
        for verdict in responses:
            if closed.is_set():
                log.warning(
                    "unexpected verdict after the last proposal",
                    extra={"fields": {"target": address, "round": verdict.round}},
                )
            verdicts.put((time.perf_counter_ns(), verdict))  # when it came, for the loop's timings
        verdicts.put(_END_OF_STREAM)
    except grpc.RpcError as error:
        if closed.is_set() and error.code() != grpc.StatusCode.CANCELLED:
            log.warning(
                "Verify stream ended with an error",
                extra={
                    "fields": {
                        "target": address,
                        "code": error.code().name,
                        "details": error.details(),
                    }
                },
            )
        verdicts.put(error)
