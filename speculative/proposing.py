"""A round's two halves for the round loop: draft and send a proposal, then receive its verdict
and bring the draft to it, one proposal at a time (`drafting_ahead.AheadProposer` overlaps them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from foundation.sequence import common_prefix_length
from speculative.drafter_base import EMPTY_PROPOSAL, DraftSession, Proposal
from speculative.lookup_gate import PendingGuess
from speculative.policy import Action
from speculative.stats import LookupCheck, RoundStats
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
    idle = True  # nothing sent beyond the proposal being verified (a stretch may start)

    def __init__(
        self,
        verifier: Verifier,
        draft: DraftSession | None,
        params: SamplingParams,
        lookup_gate: bool = True,
    ):
        """lookup_gate: a cascade's lookup takes only the turns the policy leaves it
        (Action.refused_lookup), and each round reports what lookup brought (or would have)."""
        self.verifier, self.draft, self.params = verifier, draft, params
        self.lookup_gate = lookup_gate
        self.pending_lookup = PendingGuess()  # a cascade's lookup guess, until decided
        self.draft_read_prompt = draft is None
        self.draft_warm = False  # the draft's prefill left the logits for its next token
        # proposing costs no pass (lookup)
        self.free_draft = draft is not None and draft.peek(0) is not None
        self.next_index = (
            0  # Proposal.round of the next proposal sent (a stretch is one), from 0 per call
        )

    def read_prompt(self) -> bool:
        """Whether the draft read the prompt just now: only before its first proposal, so
        a call the target decodes alone never runs the draft model on it."""
        if self.draft_read_prompt:
            return False
        self.catch_up()
        return True

    def catch_up(self) -> None:
        """The draft reads what it holds unread (the prompt, a stretch's tokens): its next token costs no pass."""
        self.draft.prefill()
        self.draft_read_prompt = self.draft_warm = True

    def propose(self, base_len: int, k: int, action: Action, draft_stop: bool = False) -> Sent:
        """Drafts up to k tokens after base_len, or a tree of up to action.width
        continuations of k tokens (DraftSession.propose_tree: action.min_branch); draft_stop:
        a model draft stops where its own chances say the next token does not pay (action.min_reach)."""
        start = time.perf_counter_ns()
        min_reach = action.min_reach if draft_stop else 0.0
        if self.lookup_gate and k > 0:
            self.draft.gate_lookup(action.refused_lookup, action.lookup_tokens)
        if k <= 0:
            proposal = EMPTY_PROPOSAL
        elif action.width > 1:
            proposal = self.draft.propose_tree(k, action.width, min_reach, action.min_branch)
        else:
            proposal = self.draft.propose(k, min_reach)
        chain_of_k = proposal.parents is None and len(proposal) == k  # drafting may go on past it
        sent = Sent(
            base_len,
            proposal,
            time.perf_counter_ns() - start,
            open_ended=k > 0 and chain_of_k,
            warm=self.draft_warm and k > 0,
        )
        self.draft_warm = self.draft_warm and k == 0
        return sent

    def send(self, sent: Sent, action: Action, room: int) -> None:
        """Sends `sent` (action and room: what a proposer drafting ahead needs)."""
        self._send(sent)

    def _send(self, sent: Sent, expected_last: int | None = None) -> None:
        sent.index, self.next_index = self.next_index, self.next_index + 1
        sent.sent_ns = time.perf_counter_ns()
        self.verifier.send(
            sent.base_len,
            sent.proposal.token_ids,
            sent.proposal.draft_probs,
            expected_last,
            sent.proposal.parents,
        )

    def receive(self, sent: Sent) -> tuple[VerifyResult, RoundStats]:
        """The verdict on `sent`, and its round's stats."""
        result = self.verifier.receive()
        now = time.perf_counter_ns()
        received = min(result.received_ns or now, now)
        return result, RoundStats(
            index=sent.index,
            base_len=sent.base_len,
            num_drafted=len(sent.proposal),
            num_accepted=result.verdict.num_accepted,
            num_committed=len(result.token_ids),
            next_token_kind=result.verdict.next_token_kind,
            draft_ns=sent.draft_ns,
            verify_ns=received - sent.sent_ns,
            target_compute_ns=result.target_compute_ns,
            step=result.step,
            target_handled_ns=result.target_handled_ns,
            drafted_ahead=sent.ahead,
            late_ns=now - received,
            draft_warm=sent.warm,
            lookup=self._lookup_check(sent, result) if self.lookup_gate else None,
            lookup_turn=self.lookup_gate and _lookup_turn(sent.proposal),
            **_branch_counts(sent.proposal, result.path),
        )

    def _lookup_check(self, sent: Sent, result: VerifyResult) -> LookupCheck | None:
        """A cascade's lookup guess decided by the target's tokens, this round's or an
        earlier one's (where it proposed them: its accepted ones, the target's next token
        differing from the first it rejected)."""
        if sent.proposal.lookup is not None:
            self.pending_lookup.start(sent.proposal.lookup, sent.proposal.lookup_ids, sent.base_len)
        return self.pending_lookup.follow(sent.base_len, result.token_ids)

    def apply_to_draft(self, sent: Sent, result: VerifyResult) -> None:
        """Rolls the draft back to what it appended of the accepted path and appends the rest
        of the target's tokens."""
        if self.draft is not None:
            num_kept = common_prefix_length(
                sent.proposal.appended(), result.token_ids[: result.verdict.num_accepted]
            )
            self.draft.truncate_to(sent.base_len + num_kept)
            self.draft.append(result.token_ids[num_kept:])


def _lookup_turn(proposal: Proposal) -> bool:
    """A cascade's lookup proposed these tokens (not its draft model)."""
    return proposal.lookup is not None and proposal.lookup.proposed


def _branch_counts(proposal: Proposal, path: tuple[int, ...] | None) -> dict[str, int]:
    """A tree's nodes off its first path (its leading chain of nodes 0, 1, ...), and the
    accepted tokens they added past what that path alone had."""
    if proposal.parents is None or path is None:
        return {}
    first = next((i for i, parent in enumerate(proposal.parents) if parent != i - 1), len(proposal))
    on_first = next((i for i, node in enumerate(path) if node != i), len(path))
    return {"branch_nodes": len(proposal) - first, "branch_tokens": len(path) - on_first}
