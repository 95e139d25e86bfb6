"""Drafting ahead (pipelining, depth 1): while proposal n is verified, proposal n + 1 is drafted from the
optimistic context (all of n accepted, and the target's own next token equal to the draft's guess, drafted
first) and sent with that guess as expected_last_token_id. It survives when n's verdict commits exactly that
context; otherwise the target discards it (it checks base_len and the last token), and the draft rolls back
to the verdict. Every proposal the target applies was judged on its actual context: exactness holds.
Pays only where the target verifies while the draft drafts (`Verifier.overlaps`: across the network).
"""

from __future__ import annotations

import time

from speculative.drafter_base import Proposal
from speculative.policy import Action
from speculative.proposing import Proposer, Sent
from speculative.types import VerifyResult


class AheadProposer(Proposer):
    ahead: Sent | None = None  # a proposal sent beyond the one being verified

    @property
    def idle(self) -> bool:
        return self.ahead is None

    def propose(self, base_len: int, k: int, action: Action, draft_stop: bool = False) -> Sent:
        # the proposal sent ahead, if it survived
        return self.ahead or super().propose(base_len, k, action, draft_stop)

    def send(self, sent: Sent, action: Action, room: int) -> None:
        """Sends `sent` (unless it went ahead), then, where the policy says so, drafts
        and sends the next proposal while `sent` is verified."""
        if sent is self.ahead:
            self.ahead = None
        else:
            self._send(sent)
        if action.ahead and not action.stretch:
            self._send_ahead(sent, action.k, room)

    def apply_to_draft(self, sent: Sent, result: VerifyResult) -> None:
        """The proposal ahead survives when the verdict on `sent` committed the context it
        assumed (the draft holds it already); else it is abandoned and the draft rolls back."""
        if (
            self.ahead is not None
            and result.committed_len == self.ahead.base_len
            and result.token_ids[-1] == sent.guess
            and not result.stopped
        ):
            return
        if self.ahead is not None:
            self.verifier.abandon_last()  # the target discards it
            self.ahead = None
        super().apply_to_draft(sent, result)

    def _send_ahead(self, current: Sent, k: int, room: int) -> None:
        """Drafts the guess, then up to k tokens after it (not past the room or a stop token). A costly
        drafter stops once `current`'s verdict has come (drafting on would only keep it waiting), unless the
        call is seeded sampling: its draws depend on where its tokens split into rounds, not on timing."""
        k = min(
            k, room - len(current.proposal) - 2
        )  # room - 1 after current's round (the guess its last)
        if not current.open_ended or k < 1:
            return
        guess = self.draft.propose(1)
        if not guess.token_ids or guess.token_ids[0] in self.params.stop_token_ids:
            return  # the draft keeps the guess, truncated with the verdict
        current.guess = guess.token_ids[0]
        start = time.perf_counter_ns()
        # free, or seeded
        if self.free_draft or (not self.params.greedy and self.params.seed is not None):
            proposal = self.draft.propose(k)
            open_ended = len(proposal) == k
        else:
            proposal, open_ended = self._propose_until_verdict(k)
        if proposal.token_ids:
            self.ahead = Sent(
                current.base_len + len(current.proposal) + 1,
                proposal,
                time.perf_counter_ns() - start,
                open_ended=open_ended,
                ahead=True,
            )
            self._send(self.ahead, current.guess)

    def _propose_until_verdict(self, k: int) -> tuple[Proposal, bool]:
        """Up to k tokens, one at a time, until the verdict on the proposal before comes, and
        whether the drafter could go on. One kind of q per proposal (a lookup token's is implied)."""
        token_ids: list[int] = []
        probs: list | None = None
        while len(token_ids) < k and not self.verifier.verdict_came():
            length = self.draft.length
            piece = self.draft.propose(1)
            if not piece.token_ids:
                return Proposal(token_ids, probs), False
            if token_ids and (piece.draft_probs is None) != (probs is None):
                self.draft.truncate_to(length)
                break
            token_ids += piece.token_ids
            probs = None if piece.draft_probs is None else (probs or []) + list(piece.draft_probs)
        return Proposal(token_ids, probs), True
