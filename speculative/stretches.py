"""Stretches: runs of tokens the target decodes alone, one result streamed per pass, where the policy finds
speculation losing (or the drafter proposing nothing); the draft follows each pass and catches up after. Plugged
in: shadow rounds (a free drafter's proposals checked against the target's tokens, so acceptance stays measured)
and, across the network, lookup run by the target (prompt lookup's rounds inside the stretch: no round trips).
Switched off (the draft worker's `stretches`), the loop takes a plain target step instead: exact either way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from speculative.drafter_base import DraftSession
from speculative.policy import SpeculationPolicy
from speculative.prompt_lookup import LookupRounds, LookupStop
from speculative.stats import RoundStats
from speculative.stretch_policy import Turn
from speculative.verifier import Verifier

if TYPE_CHECKING:
    from speculative.proposing import Proposer
    from speculative.speculation_loop import Call


class Stretches:
    def __init__(
        self, verifier: Verifier, proposer: Proposer, policy: SpeculationPolicy, target_lookup: bool
    ):
        self.verifier, self.proposer, self.policy = verifier, proposer, policy
        self.draft, self.free_draft = proposer.draft, proposer.free_draft
        # the target runs its rounds
        free_lookup = target_lookup and self.free_draft and verifier.runs_lookup
        self.lookup_sizes = self.draft.lookup_stop() if free_lookup else None
        if self.lookup_sizes is not None:
            policy.lookup_runs_on_target()

    def after_empty_turn(self, room: int) -> int:
        """Tokens of the stretch the policy prefers to a round with nothing to verify (0: none)."""
        turn = (
            Turn.NOTHING_UNTIL_MATCH
            if self.draft.lookup_stop() is not None
            else Turn.NOTHING_PROPOSED
        )
        return min(self.policy.next_action(room, turn).stretch, room)

    def run(
        self, call: Call, num_tokens: int, until: LookupStop | None, lookup_k: int = 0
    ) -> Iterator:
        """The target decodes up to num_tokens (ending where prompt lookup with `until`'s sizes finds text to
        copy; verifying up to lookup_k looked-up tokens a pass, where it runs lookup), committed through `call`."""
        # solo: intervals of passes that verified nothing
        stretch_start = call.start_ns
        intervals = []
        solo = []
        lookup = (
            LookupRounds(self.lookup_sizes, lookup_k, call.room)
            if lookup_k and self.lookup_sizes
            else None
        )
        # Only a free drafter is checked; a stretch that ends at its next proposal has none.
        shadow = (
            ShadowRounds(self.draft, self.policy) if self.free_draft and until is None else None
        )
        for stats, result in self._passes(call.base_len, num_tokens, until, lookup, shadow):
            if intervals and not stats.num_drafted:  # the first interval holds the stretch's start
                solo.append(stats.verify_ns)
            intervals.append(stats.verify_ns)
            yield from call.commit(result, stats)
            if call.finished:
                if solo:  # what its tokens cost seeds the next call
                    self.policy.observe_solo_tokens(len(solo), sum(solo) // len(solo))
                return
        self.proposer.next_index += 1
        if intervals:
            self.proposer.catch_up()
            token_ns = sum(solo) // len(solo) if solo else intervals[0]
            passes_ns = token_ns + sum(intervals[1:])  # its passes, the first as long as a solo one
            self.policy.observe_stretch(
                len(solo) + 1,
                time.perf_counter_ns() - stretch_start,
                token_ns,
                empty_turns=len(intervals) - 1 if until else 0,
                passes_ns=passes_ns,
            )

    def _passes(
        self,
        base_len: int,
        num_tokens: int,
        until: LookupStop | None,
        lookup: LookupRounds | None,
        shadow: ShadowRounds | None,
    ):
        """(stats, result) per pass of a stretch (all one round: one index); the draft follows each."""
        passes = self.verifier.decode(base_len, num_tokens, until, lookup)
        try:
            last = time.perf_counter_ns()
            for result in passes:
                now = time.perf_counter_ns()
                for token_id in result.token_ids if shadow is not None else ():
                    shadow.see(token_id)
                self.draft.append(result.token_ids)
                stats = RoundStats(
                    index=self.proposer.next_index,
                    base_len=base_len,
                    num_drafted=result.num_drafted,
                    num_accepted=result.verdict.num_accepted,
                    num_committed=len(result.token_ids),
                    next_token_kind=result.verdict.next_token_kind,
                    draft_ns=0,
                    verify_ns=now - last,
                    target_compute_ns=result.target_compute_ns,
                    streamed=True,
                    step=result.step,
                )
                base_len, last = base_len + len(result.token_ids), now
                yield stats, result
        finally:
            passes.close()  # stops the target's stream when the caller stops early


class ShadowRounds:
    """The rounds a free drafter (free `peek`) would have run during a stretch: at each point what it would have
    proposed (max k), checked against the tokens the target then decoded, each ended by the first token that
    differs or the one after a full match (a round's recovered or bonus token). Acceptance evidence; nothing sent."""

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
