"""The speculation loop: rounds of draft k tokens, verify them, apply the verdict, or
stretches the target decodes alone, until a stop token or max_new_tokens.

The loop reaches both sides through small interfaces: a `DraftSession` and a `Verifier`
(a local TargetSession in speculative.generator, a remote target stream in
draft_service.remote_verifier), so it is the same code in process and across the
network. Free of torch on purpose: the n-gram draft worker runs it without a model
runtime (the tokens and verdicts it handles are plain ints and dataclasses).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from speculative.drafter_base import EMPTY_PROPOSAL, DraftSession, Proposal
from speculative.policy import Action, SpeculationPolicy, Turn
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.stats import RoundStats
from speculative.types import FinishReason, SamplingParams, VerifyResult

if TYPE_CHECKING:
    from speculative.sampling import SparseProbs


class Verifier(Protocol):
    """The target as the loop sees it: a local TargetSession (LocalVerifier) or a remote
    stream (draft_service.remote_verifier.RemoteVerifier). Proposals are sent, then
    their verdicts received in the order sent."""

    # Whether the target verifies while the loop drafts (across the network): only
    # then does drafting the next proposal ahead of a verdict pay.
    overlaps: bool
    # Whether the target runs a prompt-lookup drafter's rounds inside a stretch
    # (`decode` with lookup): across the network that saves a round trip per round.
    runs_lookup: bool

    def send(self, base_len: int, draft_token_ids: Sequence[int], draft_probs: Sequence[SparseProbs] | None,
             expected_last_token_id: int | None = None) -> None:
        """Sends a proposal; expected_last_token_id: the token it assumes at base_len - 1."""

    def receive(self) -> VerifyResult:
        """The verdict on the oldest proposal not yet received (skipping abandoned ones);
        StaleProposal if the target discarded it."""
        ...

    def verdict_came(self) -> bool:
        """Whether the verdict on the oldest proposal not yet received is in (no wait)."""
        ...

    def abandon_last(self) -> None:
        """The proposal sent last will be discarded (its context turned out wrong): its
        verdict is skipped, and RuntimeError raised should the target apply it."""

    def decode(self, base_len: int, max_tokens: int, until: LookupStop | None = None,
               lookup: LookupRounds | None = None) -> Iterator[VerifyResult]:
        """A stretch: target-only decoding of up to max_tokens tokens, one result per
        pass, ending after a stop token or the first token at which prompt lookup with
        `until`'s sizes finds text to copy; with `lookup`, each pass also verifies the
        tokens prompt lookup finds to copy. Nothing may be in flight."""
        ...


@dataclass(frozen=True)
class RoundResult:
    token_ids: list[int]  # tokens this round (or this token of a stretch) added to the output
    stats: RoundStats
    finish_reason: FinishReason | None  # set on the last round


def speculation_rounds(
    verifier: Verifier,
    draft: DraftSession | None,
    base_len: int,
    params: SamplingParams,
    policy: SpeculationPolicy,
    context_length: int,
) -> Iterator[RoundResult]:
    """Runs rounds until a stop token, max_new_tokens or the context length.

    Each step is either a round (draft k tokens, verify them in one target pass) or, when
    the policy finds that faster, a stretch of tokens the target decodes alone, each
    yielded as it comes. Where the verifier overlaps and the policy says so, the next
    proposal is drafted and sent while the last one is verified (`_Loop`). On entry
    verifier and draft both hold `base_len` committed tokens; after each yielded result
    both hold the new committed length (the draft also any proposal sent ahead).
    """
    return _Loop(verifier, draft, base_len, params, policy, context_length).run()


@dataclass
class _Sent:
    """A proposal on its way to the target."""

    base_len: int
    proposal: Proposal
    draft_ns: int  # drafting its tokens (not the guess: that is drafted after sending)
    sent_ns: int  # when it was sent (time.perf_counter_ns)
    guess: int | None = None  # the draft's next token after it: what a proposal ahead assumes
    index: int = 0  # its Proposal.round, counted from the call's first
    ahead: bool = False  # drafted while the proposal before it was verified
    open_ended: bool = False  # the drafter could have gone on past it (a guess may follow)
    warm: bool = False  # its first token came with the draft's prefill (a pass less)


class _Loop:
    """One call's rounds. Pipelining (depth 1): while proposal n is verified, proposal
    n + 1 is drafted from the optimistic context (all of n accepted, and the target's own
    next token equal to the draft's guess, drafted first) and sent with that guess as
    expected_last_token_id; a costly drafter sends it as soon as n's verdict comes, with
    the tokens it has by then. It survives when the verdict on n commits
    exactly that context; otherwise the target discards it (it checks base_len and the
    last token), and the draft rolls back to the verdict and drafts again. Every
    proposal the target applies was judged on its actual context: exactness holds."""

    def __init__(self, verifier, draft, base_len, params, policy, context_length):
        self.verifier, self.draft, self.params, self.policy = verifier, draft, params, policy
        self.base_len, self.context_length = base_len, context_length
        self.num_generated = 0
        self.index = 0  # Proposal.round of the next proposal sent (a stretch is one), from 0 per call
        self.draft_read_prompt = draft is None
        self.draft_warm = False  # the draft's prefill left the logits for its next token
        self.free_draft = draft is not None and draft.peek(0) is not None  # proposing costs no pass (lookup)
        # The target can run this drafter's rounds itself: a free drafter that looks up.
        self.lookup_sizes = draft.lookup_stop() if self.free_draft and verifier.runs_lookup else None
        if self.lookup_sizes is not None:
            policy.target_runs_lookup()
        self.ahead: _Sent | None = None  # a proposal sent beyond the one being verified
        self.start_ns = 0  # when the current step began (its decision)
        self.finish_reason: FinishReason | None = None

    def run(self) -> Iterator[RoundResult]:
        while True:
            self.start_ns = time.perf_counter_ns()
            room = self._room()
            # 1. Decide: a stretch, or a round (the one sent ahead, or a new one).
            action = self.policy.next_action(room) if self.draft is not None else Action()
            if self.ahead is None and action.stretch:
                yield from self._stretch(min(action.stretch, room), None, action.lookup_k)
            else:
                current = self.ahead or self._draft_current(action, room)
                self.ahead = None
                if isinstance(current, int):  # the drafter found nothing and a stretch wins
                    yield from self._stretch(current, self.draft.lookup_stop())
                else:
                    # 2. Draft the next proposal while this one is verified.
                    if action.ahead and not action.stretch and self.verifier.overlaps:
                        self._send_ahead(current, action.k)
                    # 3. Its verdict, applied to the draft.
                    yield from self._round(current)
            if self.finished:
                return

    def _room(self) -> int:
        """Tokens this call may still generate (never past max_new_tokens or the context)."""
        return min(self.params.max_new_tokens - self.num_generated, self.context_length - self.base_len)

    def _draft_current(self, action: Action, room: int) -> _Sent | int:
        """Drafts and sends the next proposal (k capped by the room); or, when the
        drafter found nothing, the stretch the policy prefers to an empty round (an int)."""
        if not self.draft_read_prompt:
            # The draft reads the prompt only now: a call the target decodes alone from
            # its start never runs the draft model on it.
            self.draft.prefill()
            self.draft_read_prompt, self.start_ns = True, time.perf_counter_ns()
            self.draft_warm = True
        k = min(action.k, room - 1)
        sent = self._draft(self.base_len, k)
        if k > 0:
            self.policy.observe_turn(proposed=bool(sent.proposal.token_ids))
        if k > 0 and not sent.proposal.token_ids:  # nothing to verify: a round trip for one token?
            # A lookup drafter's stretch ends where it would propose again.
            turn = Turn.NOTHING_UNTIL_MATCH if self.draft.lookup_stop() is not None else Turn.NOTHING_PROPOSED
            stretch = min(self.policy.next_action(room, turn).stretch, room)
            if stretch:
                return stretch
        self._send(sent, None)
        return sent

    def _draft(self, base_len: int, k: int, until: Callable[[], bool] | None = None) -> _Sent:
        """Drafts up to k tokens after base_len. With `until`, a drafter whose tokens cost
        a pass drafts them one at a time and stops once until() holds."""
        start = time.perf_counter_ns()
        if k > 0 and until is not None and not self.free_draft:
            proposal, open_ended = self._propose_until(k, until)
        else:
            proposal = self.draft.propose(k) if k > 0 else EMPTY_PROPOSAL
            open_ended = len(proposal) == k  # shorter: the drafter found no more
        sent = _Sent(base_len, proposal, 0, 0, open_ended=k > 0 and open_ended, warm=self.draft_warm and k > 0)
        self.draft_warm = self.draft_warm and k == 0
        sent.draft_ns = time.perf_counter_ns() - start
        sent.sent_ns = time.perf_counter_ns()
        return sent

    def _propose_until(self, k: int, until: Callable[[], bool]) -> tuple[Proposal, bool]:
        """Up to k tokens, one at a time, until until() holds; and whether the drafter
        could go on. A proposal keeps one kind of q (a lookup token's is implied)."""
        token_ids: list[int] = []
        probs: list | None = None
        while len(token_ids) < k and not until():
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

    def _send_ahead(self, current: _Sent, k: int) -> None:
        """Drafts and sends the proposal after `current` while it is verified, assuming
        all of it accepted and the target's next token the draft's guess (drafted
        first). A costly drafter stops where `current`'s verdict has come (drafting on
        would only keep it waiting), unless the call is seeded sampling. Not past the
        room or a stop token."""
        if not current.open_ended:
            return
        base_len = current.base_len + len(current.proposal) + 1
        room = self._room() - (base_len - self.base_len)
        k = min(k, room - 1)
        if k < 1:
            return
        guess = self.draft.propose(1)
        if not guess.token_ids or guess.token_ids[0] in self.params.stop_token_ids:
            return  # the draft keeps the guess, truncated with the verdict
        current.guess = guess.token_ids[0]
        # A seeded sampling call drafts whole proposals: its draws depend on where its
        # tokens split into rounds, which must not depend on timing.
        reproducible = not self.params.greedy and self.params.seed is not None
        ahead = self._draft(base_len, k, until=None if reproducible else self.verifier.verdict_came)
        if not ahead.proposal.token_ids:  # nothing to send
            return
        ahead.ahead = True
        self._send(ahead, current.guess)
        self.ahead = ahead

    def _send(self, sent: _Sent, expected_last: int | None) -> None:
        sent.index, self.index = self.index, self.index + 1
        self.verifier.send(sent.base_len, sent.proposal.token_ids, sent.proposal.draft_probs, expected_last)

    def _round(self, current: _Sent) -> Iterator[RoundResult]:
        """Receives the verdict on `current` and brings the draft to it."""
        result = self.verifier.receive()
        now = time.perf_counter_ns()
        received = min(result.received_ns or now, now)
        survives = self.ahead is not None and result.committed_len == self.ahead.base_len \
            and result.token_ids[-1] == current.guess and not result.stopped
        if self.ahead is not None and not survives:
            self.verifier.abandon_last()
            self.ahead = None
        if not survives:  # else the draft already holds the verdict's tokens, and the proposal ahead
            _apply_to_draft(self.draft, current.base_len, result)
        stats = RoundStats(
            index=current.index, base_len=current.base_len, num_drafted=len(current.proposal),
            num_accepted=result.verdict.num_accepted, num_committed=len(result.token_ids),
            next_token_kind=result.verdict.next_token_kind, draft_ns=current.draft_ns,
            verify_ns=received - current.sent_ns, target_compute_ns=result.target_compute_ns, step=result.step,
            drafted_ahead=current.ahead, late_ns=now - received, draft_warm=current.warm,
        )
        yield from self._commit(result, stats)

    def _stretch(self, num_tokens: int, until: LookupStop | None, lookup_k: int = 0) -> Iterator[RoundResult]:
        """The target decodes up to num_tokens (verifying up to lookup_k looked-up tokens
        a pass, where it runs lookup); the draft follows each pass, and catches up on
        them after (what starting a stretch costs, not drafting)."""
        stretch_start, intervals, solo = self.start_ns, [], []  # solo: intervals of passes that verified nothing
        lookup = LookupRounds(self.lookup_sizes, lookup_k) if lookup_k and self.lookup_sizes else None
        # Only a free drafter is checked; a stretch that ends at its next proposal has none.
        shadow = _ShadowRounds(self.draft, self.policy) if self.free_draft and until is None else None
        for stats, result in _solo_stretch(self.verifier, self.draft, self.base_len, num_tokens, until, lookup, shadow):
            if intervals and not stats.num_drafted:  # the first interval holds the stretch's start
                solo.append(stats.verify_ns)
            intervals.append(stats.verify_ns)
            yield from self._commit(result, dataclasses.replace(stats, index=self.index))
            if self.finished:
                if solo:  # what its tokens cost seeds the next call
                    self.policy.observe_solo_tokens(len(solo), sum(solo) // len(solo))
                return
        self.index += 1
        if intervals:
            self.draft.prefill()
            self.draft_read_prompt = self.draft_warm = True
            token_ns = sum(solo) // len(solo) if solo else intervals[0]
            passes_ns = token_ns + sum(intervals[1:])  # its passes, the first as long as a solo one
            self.policy.observe_stretch(len(solo) + 1, time.perf_counter_ns() - stretch_start, token_ns,
                                        empty_turns=len(intervals) - 1 if until else 0, passes_ns=passes_ns)

    def _commit(self, result: VerifyResult, stats: RoundStats) -> Iterator[RoundResult]:
        self.base_len += len(result.token_ids)
        self.num_generated += len(result.token_ids)
        out_of_room = self.num_generated >= self.params.max_new_tokens or self.base_len >= self.context_length
        self.finish_reason = _finish_reason(result, out_of_room)
        yield RoundResult(result.token_ids, stats, self.finish_reason)
        # Measured after the caller is done with the result: what a round (or a
        # streamed token) costs includes passing it on.
        self.policy.observe(stats, time.perf_counter_ns() - self.start_ns)
        self.start_ns = time.perf_counter_ns()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _ShadowRounds:
    """The rounds a free drafter would have run during a stretch: at each point, what it
    would have proposed (DraftSession.peek, max k), checked against the tokens the
    target then decoded, each ended by the first token that differs or the one after
    a full match, as a round's recovered or bonus token. The policy counts them as
    acceptance evidence; nothing is sent. For drafters whose `peek` is free."""

    def __init__(self, draft: DraftSession, policy: SpeculationPolicy):
        self.draft, self.policy = draft, policy
        self.proposal: list[int] | None = None  # the round under way
        self.matched = 0

    def see(self, token_id: int) -> None:
        """The target's next token, before the draft follows it."""
        if self.proposal is None:
            self.proposal, self.matched = self.draft.peek(self.policy.max_k), 0
            if not self.proposal:  # an empty turn: the token is a plain step
                self.proposal = None
                self.policy.observe_shadow(0, 0)
                return
        if self.matched < len(self.proposal) and token_id == self.proposal[self.matched]:
            self.matched += 1
            return
        self.policy.observe_shadow(len(self.proposal), self.matched)
        self.proposal = None


def _solo_stretch(verifier: Verifier, draft: DraftSession, base_len: int, num_tokens: int,
                 until: LookupStop | None, lookup: LookupRounds | None = None, shadow: _ShadowRounds | None = None):
    """(stats, result) per pass of a stretch; the draft follows each."""
    passes = verifier.decode(base_len, num_tokens, until, lookup)
    try:
        last = time.perf_counter_ns()
        for result in passes:
            now = time.perf_counter_ns()
            for token_id in result.token_ids if shadow is not None else ():
                shadow.see(token_id)
            draft.append(result.token_ids)
            stats = RoundStats(index=0, base_len=base_len, num_drafted=result.num_drafted,
                               num_accepted=result.verdict.num_accepted, num_committed=len(result.token_ids),
                               next_token_kind=result.verdict.next_token_kind, draft_ns=0, verify_ns=now - last,
                               target_compute_ns=result.target_compute_ns, streamed=True, step=result.step)
            base_len, last = base_len + len(result.token_ids), now
            yield stats, result
    finally:
        passes.close()  # stops the target's stream when the caller stops early


def _finish_reason(result: VerifyResult, out_of_room: bool) -> FinishReason | None:
    if result.stopped:
        return FinishReason.STOP_TOKEN
    return FinishReason.LENGTH if out_of_room else None


def _apply_to_draft(draft: DraftSession | None, base_len: int, result: VerifyResult) -> None:
    """Rolls the draft back to its accepted prefix and appends the target's tokens."""
    if draft is None:
        return
    num_kept_drafts = min(result.verdict.num_accepted, len(result.token_ids))
    draft.truncate_to(base_len + num_kept_drafts)
    draft.append(result.token_ids[num_kept_drafts:])
