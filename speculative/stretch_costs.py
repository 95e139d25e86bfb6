"""What stretches measured, for the decision to hand off to one (speculative.stretch_policy).
In nanoseconds where a time:

- s, a token decoded alone (c(1) until a stretch measures it); o, what starting a stretch
  costs past its tokens (prior 2 R);
- f, the share of the drafter's turns that proposed anything (an empty turn is a round
  trip for one token);
- the call's recent actions, which size the next stretch: stretches in a row, empty
  turns in a row, the time of the rounds since the last stretch.

Fed by the stretch runner (speculative.stretches) and the round loop's empty turns; a
stretch's passes also refine the target's c(w) (`pass_costs.PassCostFit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from speculative.pass_costs import PassCostFit, blend

if TYPE_CHECKING:
    from speculative.stats import RoundStats

# A token decoded alone weighs this much of a pass in the fit of c(w), and does not age
# the passes: a long stretch refines c(1) without erasing what wider passes cost.
SOLO_TOKEN_WEIGHT = 0.1


@dataclass(frozen=True)
class StretchEstimates:
    """What stretches measured, at one moment (`Estimates.stretch`)."""

    solo_token_ns: float  # s
    solo_measured: bool  # s from stretches (else it is c(1))
    start_ns: float  # o
    proposal_rate: float  # f
    measure: bool  # stretches measure acceptance (a free drafter): no probe needed
    target_runs_lookup: bool = (
        False  # the target runs the (prompt-lookup) drafter's rounds inside stretches
    )
    after_stretch: bool = False  # the last thing the call did was a stretch
    losing_in_a_row: int = 0  # stretches in a row, each followed by one round that lost (a probe)
    empty_turns_in_a_row: int = 0  # drafter turns that proposed nothing since one that did
    rounds_since_ns: float = 0.0  # time of the rounds since the last stretch


class StretchCosts:
    def __init__(self, decay: float, passes: PassCostFit):
        self.decay, self.passes = decay, passes
        self.solo_token_ns: float | None = None  # s (None: not measured)
        self.start_ns: float | None = None  # o (None: not measured)
        self.proposals, self.turns = 1.0, 2.0  # decayed counts behind f (prior 0.5)
        self.measure = False  # shadow rounds measure the drafter's acceptance during stretches
        self.target_runs_lookup = (
            False  # the target runs the (prompt-lookup) drafter's rounds inside stretches
        )
        self.after_stretch = False  # the last thing the call did was a stretch
        self.in_a_row = self.empty_turns_in_a_row = 0
        # rounds since the last stretch, and their time
        self.rounds_since = 0
        self.rounds_since_ns = 0.0

    @property
    def losing_in_a_row(self) -> int:
        """Stretches in a row, each followed by one round that lost (a probe)."""
        return self.in_a_row if self.rounds_since <= 1 else 0

    def estimates(self, overhead_ns: float) -> StretchEstimates:
        """The snapshot; before a stretch measures them, s is c(1) and o is 2 R."""
        solo_measured = self.solo_token_ns is not None
        return StretchEstimates(
            solo_token_ns=self.solo_token_ns if solo_measured else self.passes.pass_ns(1),
            solo_measured=solo_measured,
            start_ns=self.start_ns if self.start_ns is not None else 2 * overhead_ns,
            proposal_rate=self.proposals / self.turns,
            measure=self.measure,
            target_runs_lookup=self.target_runs_lookup,
            after_stretch=self.after_stretch,
            losing_in_a_row=self.losing_in_a_row,
            empty_turns_in_a_row=self.empty_turns_in_a_row,
            rounds_since_ns=self.rounds_since_ns,
        )

    def observe_round(self, elapsed_ns: int) -> None:
        self.after_stretch = False
        self.rounds_since += 1
        self.rounds_since_ns += elapsed_ns

    def observe_pass(self, stats: RoundStats) -> None:
        """One pass of a stretch: one token, or verifying looked-up ones as a round's."""
        if stats.target_compute_ns <= 0:  # the logits were kept from the prefill
            return
        if stats.num_drafted:
            self.passes.observe(stats.num_drafted + 1, stats.target_compute_ns)
        else:
            self.passes.observe(1, stats.target_compute_ns, SOLO_TOKEN_WEIGHT, age=False)
            self.passes.one_token_measured = True

    def observe_turn(self, proposed: bool) -> None:
        """The drafter was asked for tokens and proposed some, or nothing."""
        self.proposals = self.decay * self.proposals + proposed
        self.turns = self.decay * self.turns + 1.0
        self.empty_turns_in_a_row = 0 if proposed else self.empty_turns_in_a_row + 1

    def observe_stretch(
        self,
        num_tokens: int,
        elapsed_ns: int,
        token_ns: int,
        empty_turns: int = 0,
        passes_ns: int | None = None,
    ) -> None:
        """A whole stretch: elapsed_ns from deciding on it to being ready to draft again,
        of which its passes took passes_ns (default num_tokens token_ns; the rest is o),
        tokens decoded alone token_ns apart (s). The drafter would have proposed nothing
        in empty_turns of them (a stretch that ended where it would propose again)."""
        for _ in range(empty_turns):
            self.observe_turn(proposed=False)
        self.observe_solo_tokens(num_tokens, token_ns)
        passes_ns = num_tokens * token_ns if passes_ns is None else passes_ns
        self.start_ns = blend(self.start_ns, max(0.0, elapsed_ns - passes_ns), self.decay)
        self.in_a_row = self.in_a_row + 1 if self.rounds_since <= 1 else 1
        self.after_stretch = True
        self.rounds_since, self.rounds_since_ns = 0, 0.0

    def observe_solo_tokens(self, num_tokens: int, token_ns: int) -> None:
        """num_tokens decoded alone, token_ns apart (s; also a bound on c(1)): a stretch's,
        or the call's last stretch's (its start not measured; its s seeds the next call)."""
        if token_ns < self.passes.pass_ns(1):
            self.passes.observe(1, token_ns, SOLO_TOKEN_WEIGHT * num_tokens, age=False)
        self.passes.one_token_measured = True
        # s ages by the rounds since it was measured, as passes do by later passes.
        self.solo_token_ns = blend(
            self.solo_token_ns, token_ns, self.decay ** (1 + self.rounds_since)
        )
