"""A round's two halves for the round loop: draft and send a proposal, then receive its
verdict and bring the draft to it. `drafting_ahead.AheadProposer` overlaps the next
proposal's drafting with this one's verification; this is the plain, one-at-a-time form.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from speculative.drafter_base import EMPTY_PROPOSAL, DraftSession, Proposal
from speculative.policy import Action
from speculative.stats import RoundStats
from speculative.types import SamplingParams, VerifyResult
from speculative.verifier import Verifier


@dataclass
class Sent:
    """A proposal on its way to the target."""

    base_len: int
    proposal: Proposal
    draft_ns: int  # drafting its tokens (not a guess drafted after sending)
    sent_ns: int = 0  # when it was sent (time.perf_counter_ns)
    index: int = 0  # its Proposal.round, counted from the call's first
    open_ended: bool = False  # the drafter could have gone on past it
    warm: bool = False  # its first token came with the draft's prefill (a pass less)
    ahead: bool = False  # drafted while the proposal before it was verified
    guess: int | None = None  # the draft's next token after it: what a proposal ahead assumes


class Proposer:
    """Drafts, sends and settles one proposal at a time."""

    def __init__(self, verifier: Verifier, draft: DraftSession | None, params: SamplingParams):
        self.verifier, self.draft, self.params = verifier, draft, params
        self.draft_read_prompt = draft is None
        self.draft_warm = False  # the draft's prefill left the logits for its next token
        self.free_draft = draft is not None and draft.peek(0) is not None  # proposing costs no pass (lookup)
        self.next_index = 0  # Proposal.round of the next proposal sent (a stretch is one), from 0 per call

    @property
    def idle(self) -> bool:
        """Nothing sent beyond the proposal being settled (a stretch may start)."""
        return True

    def read_prompt(self) -> bool:
        """Whether the draft read the prompt just now: only before its first proposal, so
        a call the target decodes alone never runs the draft model on it."""
        if self.draft_read_prompt:
            return False
        self.draft.prefill()
        self.draft_read_prompt = self.draft_warm = True
        return True

    def propose(self, base_len: int, k: int, min_reach: float = 0.0) -> Sent:
        """Drafts up to k tokens after base_len (DraftSession.propose: min_reach)."""
        return self._draft(base_len, k, min_reach)

    def send(self, sent: Sent, action: Action, room: int) -> None:
        """Sends `sent` (action and room: what a proposer drafting ahead needs)."""
        self._send(sent, None)

    def settle(self, sent: Sent) -> tuple[VerifyResult, RoundStats]:
        """Receives the verdict on `sent` and brings the draft to it."""
        result = self.verifier.receive()
        now = time.perf_counter_ns()
        if not self._ahead_survives(sent, result):  # else the draft already holds the verdict's tokens
            apply_to_draft(self.draft, sent.base_len, result)
        return result, round_stats(sent, result, now)

    def _ahead_survives(self, sent: Sent, result: VerifyResult) -> bool:
        """Whether a proposal sent beyond `sent` stays valid after its verdict (none here)."""
        return False

    def after_stretch(self) -> None:
        """The draft caught up on a stretch's tokens: its next token costs no pass."""
        self.draft.prefill()
        self.draft_read_prompt = self.draft_warm = True

    def _draft(self, base_len: int, k: int, min_reach: float = 0.0) -> Sent:
        start = time.perf_counter_ns()
        proposal = self.draft.propose(k, min_reach) if k > 0 else EMPTY_PROPOSAL
        sent = Sent(base_len, proposal, time.perf_counter_ns() - start, open_ended=k > 0 and len(proposal) == k,
                    warm=self.draft_warm and k > 0)
        self.draft_warm = self.draft_warm and k == 0
        return sent

    def _send(self, sent: Sent, expected_last: int | None) -> None:
        sent.index, self.next_index = self.next_index, self.next_index + 1
        sent.sent_ns = time.perf_counter_ns()
        self.verifier.send(sent.base_len, sent.proposal.token_ids, sent.proposal.draft_probs, expected_last)


def round_stats(sent: Sent, result: VerifyResult, now: int) -> RoundStats:
    received = min(result.received_ns or now, now)
    return RoundStats(
        index=sent.index, base_len=sent.base_len, num_drafted=len(sent.proposal),
        num_accepted=result.verdict.num_accepted, num_committed=len(result.token_ids),
        next_token_kind=result.verdict.next_token_kind, draft_ns=sent.draft_ns,
        verify_ns=received - sent.sent_ns, target_compute_ns=result.target_compute_ns, step=result.step,
        drafted_ahead=sent.ahead, late_ns=now - received, draft_warm=sent.warm,
    )


def apply_to_draft(draft: DraftSession | None, base_len: int, result: VerifyResult) -> None:
    """Rolls the draft back to its accepted prefix and appends the target's tokens."""
    if draft is None:
        return
    num_kept_drafts = min(result.verdict.num_accepted, len(result.token_ids))
    draft.truncate_to(base_len + num_kept_drafts)
    draft.append(result.token_ids[num_kept_drafts:])
