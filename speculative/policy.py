"""What a speculating call does next: a round drafting k tokens, or a stretch of tokens
the target decodes alone.

A fixed k is the textbook setting (`FixedK`). `AdaptiveK` is two pieces: a cost
estimator (speculative.estimator: acceptance, draft cost, the target's cost against
width, the round trip, what a stretch costs) and `decide`, a pure function of its
estimates. Speculation pays while a round's expected tokens over its cost,
E[tokens](a, k) / (k d + c(k + 1) + R), beat decoding alone, 1 / s; where the target
verifies while the draft drafts, a round may cost less (its successor drafted ahead).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speculative.estimator import CostEstimator, Estimates, MeasuredCosts, expected_tokens

if TYPE_CHECKING:  # annotations only: this module stays free of torch
    from speculative.stats import RoundStats

__all__ = ["Action", "AdaptiveK", "FixedK", "MeasuredCosts", "SpeculationPolicy", "StretchRules", "Turn", "decide",
           "draft_ahead", "expected_tokens"]


class Turn(enum.Enum):
    """When the loop asks."""

    DRAFT = "draft"  # before drafting
    NOTHING_PROPOSED = "nothing"  # the drafter proposed nothing: a round would be one plain step
    NOTHING_UNTIL_MATCH = "until_match"  # the same, and a stretch can end where it would propose again


@dataclass(frozen=True)
class Action:
    k: int = 0  # draft k tokens for a round (0: a plain target step)
    stretch: int = 0  # > 0: instead, the target decodes up to this many tokens alone
    ahead: bool = False  # draft the next proposal while this one is verified (where the target overlaps)
    lookup_k: int = 0  # in a stretch: looked-up tokens the target verifies a pass, at most (0: none)
    # A model drafter stops drafting once its own chance that the target accepts every
    # token so far falls below this (DraftSession.propose): see `stop_reach`.
    min_reach: float = 0.0


TAKE_ROUND = Action()  # after a turn that proposed nothing: the plain step, one round trip


@dataclass(frozen=True)
class StretchRules:
    first: int = 8  # tokens of a first stretch
    longest: int = 128  # tokens of any stretch
    start_share: float = 0.05  # most of a stretch's time its start may take
    empty_growth: int = 4  # stretches after empty turns grow to at most this many times `first`

    def sized(self, e: Estimates, shortest: int) -> int:
        """At least `shortest` tokens, and long enough that starting it is at most
        start_share of its time; at most `longest`."""
        return min(max(shortest, _ceil(e.stretch_start_ns / (self.start_share * e.solo_token_ns))), self.longest)


def decide(e: Estimates, remaining: int | None, turn: Turn = Turn.DRAFT, rules: StretchRules = StretchRules()) -> Action:
    """The next action of a call that may still generate `remaining` tokens (None: not
    known). Rules:
    - Where the target runs the drafter's rounds (prompt lookup): see `_lookup_stretch`.
    - Nothing measured yet: a round of the k the priors favour.
    - A loaded target whose worker_k is 0 decodes alone. Where stretches measure
      acceptance (a free drafter), in stretches of the longest size: nothing needs a
      probe, and each restart costs the session a step it misses.
    - After a stretch, one round re-measures (a probe), unless the stretch measured.
    - The fastest k while its rounds beat decoding alone; a lead read from an
      extrapolated c(1) is checked by one stretch first. Else a stretch, twice the
      last one's while probes (or measuring stretches) keep losing.
    - The drafter proposed nothing: see `_after_empty_turn`.
    - Whether a round's next proposal is drafted ahead: see `draft_ahead`.
    - A stretch after which fewer tokens would remain than it has runs to the end."""
    if e.target_runs_lookup:
        return _lookup_stretch(e, remaining, rules)
    if not e.measured:
        return Action(k=e.best_k(), ahead=True) if turn is Turn.DRAFT else TAKE_ROUND
    if turn is not Turn.DRAFT:
        return _after_empty_turn(e, remaining, turn is Turn.NOTHING_UNTIL_MATCH, rules)
    if e.worker_k == 0 and e.stretches_measure:
        return _stretch_unless_last(rules.longest, remaining, least=rules.first)
    k = e.best_k()
    lead = 0.0 if e.worker_k == 0 else e.tokens_per_ns(k) * e.solo_token_ns  # speculation's speed over alone
    if (e.after_stretch and not e.stretches_measure) or (lead >= 1.0 and e.one_token_measured):
        return _round(e, k)
    if lead >= 1.0:
        return _stretch_unless_last(rules.sized(e, rules.first), remaining, least=None, otherwise=_round(e, k))
    stretch = rules.sized(e, min(rules.first * 2 ** e.losing_stretches, rules.longest))
    return _stretch_unless_last(stretch, remaining, least=stretch)


def _lookup_stretch(e: Estimates, remaining: int | None, rules: StretchRules) -> Action:
    """The target runs a prompt-lookup drafter's rounds inside a stretch: the same
    proposals, without a round trip or drafting each. Its passes verify up to the k
    fastest at that price (R = d = 0), or none where even those rounds lose to decoding
    alone. Stretches in a row double from `first` to `longest`, k chosen again after
    each with what its passes and shadow rounds measured (a call's first k rests on
    priors alone), each long enough that its start is at most start_share of its time
    (on a loaded target a restart misses a step). Where the loaded target leaves no
    room for drafts (worker_k 0) there is no k to learn: the longest. A stretch runs
    to the end where too few tokens would remain."""
    inside = dataclasses.replace(e, overhead_ns=0.0, draft_token_ns=0.0, overlaps=False)
    k = inside.best_k()
    if e.worker_k == 0 or (inside.measured and inside.tokens_per_ns(k) <= inside.tokens_per_ns(0)):
        k = 0
    size = rules.longest if e.worker_k == 0 else min(rules.first * 2 ** e.losing_stretches, rules.longest)
    if e.measured:
        size = rules.sized(e, size)
    return dataclasses.replace(_stretch_unless_last(size, remaining, least=rules.first), lookup_k=k)


def _round(e: Estimates, k: int) -> Action:
    return Action(k=k, ahead=draft_ahead(e, k), min_reach=stop_reach(e, k))


def stop_reach(e: Estimates, k: int) -> float:
    """The chance of acceptance below which a model drafter's next token does not pay:
    drafting it costs d and widens the target's pass by g, so it must bring at least
    (d + g) times the tokens per ns that rounds of k earn. 0 for a free drafter."""
    if e.draft_token_ns <= 0.0:
        return 0.0
    return min(1.0, (e.draft_token_ns + e.per_token_ns) * e.tokens_per_ns(k))


def draft_ahead(e: Estimates, k: int) -> bool:
    """Whether to draft the next proposal while this one of k tokens is verified: where
    that saves time on average (Estimates.ahead_saving_ns; a tie, as for a free
    drafter, goes to drafting ahead)."""
    return e.ahead_saving_ns(k) >= 0.0


def _after_empty_turn(e: Estimates, remaining: int | None, ends_at_match: bool, rules: StretchRules) -> Action:
    """The plain step is taken while rounds, empty ones included at the rate f they come,
    beat decoding alone (text to copy may turn up next turn); else a stretch, longer
    with each empty turn in a row. A stretch that ends where the drafter proposes again
    is taken when its start, spread over the expected gap of 1 / f tokens, costs less
    than an empty round per token. Where the plain step is taken, a first-size stretch
    re-measures s once it risks at most start_share of the rounds' time since the last
    one (s is measured only by stretches)."""
    if ends_at_match:
        rounds_ns = e.round_ns(0)
        gap = 1.0 / e.proposal_rate if remaining is None else min(1.0 / e.proposal_rate, remaining)
        if e.solo_token_ns + e.stretch_start_ns / gap < rounds_ns:
            return Action(stretch=remaining if remaining is not None else rules.longest)
    else:
        rounds_ns = 1.0 / e.mixed_tokens_per_ns(e.best_k())
        if rounds_ns > e.solo_token_ns:
            growth = min(2 ** max(e.empty_turns_in_a_row - 1, 0), rules.empty_growth)
            return _stretch_unless_last(rules.sized(e, rules.first * growth), remaining, least=rules.first)
    if not e.solo_measured:
        return TAKE_ROUND
    stretch = rules.sized(e, rules.first)
    risk_ns = e.stretch_start_ns + stretch * max(0.0, e.solo_token_ns - rounds_ns)
    if risk_ns > rules.start_share * e.rounds_since_stretch_ns:
        return TAKE_ROUND
    return _stretch_unless_last(stretch, remaining, least=None, otherwise=TAKE_ROUND)


def _stretch_unless_last(stretch: int, remaining: int | None, least: int | None, otherwise: Action = TAKE_ROUND) -> Action:
    """A stretch. When fewer than `least` tokens would remain after it, it runs to the
    end (too few left to win back what speculating again costs); least=None: then
    `otherwise` instead (a stretch that only measures is not worth it there)."""
    if remaining is None or remaining - stretch >= (least if least is not None else stretch):
        return Action(stretch=stretch)
    return Action(stretch=remaining) if least is not None else otherwise


class SpeculationPolicy:
    """What the speculation loop asks and tells a policy."""

    max_k: int  # the largest k this policy will ever ask for

    def next_action(self, remaining: int | None = None, turn: Turn = Turn.DRAFT) -> Action:
        raise NotImplementedError

    def observe(self, round_stats: RoundStats, elapsed_ns: int) -> None:
        """A finished round (or a token of a stretch), elapsed_ns after its decision."""

    def observe_turn(self, proposed: bool) -> None:
        """The drafter was asked for tokens: it proposed some, or nothing."""

    def observe_shadow(self, num_drafted: int, num_accepted: int) -> None:
        """During a stretch, a round not run (CostEstimator.observe_shadow)."""

    def observe_stretch(self, num_tokens: int, elapsed_ns: int, token_ns: int, empty_turns: int = 0,
                        passes_ns: int | None = None) -> None:
        """A whole stretch (CostEstimator.observe_stretch)."""

    def observe_solo_tokens(self, num_tokens: int, token_ns: int) -> None:
        """The stretch that ended the call (CostEstimator.observe_solo_tokens)."""

    def target_runs_lookup(self) -> None:
        """The target can run this call's drafter's rounds itself, inside stretches: a
        prompt-lookup drafter, across the network (Verifier.runs_lookup)."""


class FixedK(SpeculationPolicy):
    """k every round, the next drafted ahead where the target overlaps; a turn that
    proposed nothing takes the plain step."""

    def __init__(self, k: int):
        self.max_k = k

    def next_action(self, remaining: int | None = None, turn: Turn = Turn.DRAFT) -> Action:
        return Action(k=self.max_k, ahead=True) if turn is Turn.DRAFT else TAKE_ROUND


class AdaptiveK(SpeculationPolicy):
    """`decide` on this call's own estimates; `costs` seeds them with what earlier calls
    between the same draft and target measured. overlaps: the target verifies while the
    draft drafts (a remote target with pipelining on), so rounds are priced with
    drafting ahead."""

    def __init__(self, max_k: int, decay: float = 0.9, rules: StretchRules = StretchRules(),
                 costs: MeasuredCosts | None = None, overlaps: bool = False):
        self.max_k, self.rules = max_k, rules
        self.estimator = CostEstimator(max_k, decay, costs, overlaps)

    @property
    def measured(self) -> bool:
        """The call measured the target's passes (rounds, or a stretch's passes)."""
        return self.estimates().measured

    def estimates(self) -> Estimates:
        return self.estimator.estimates()

    def next_action(self, remaining: int | None = None, turn: Turn = Turn.DRAFT) -> Action:
        return decide(self.estimates(), remaining, turn, self.rules)

    def observe(self, round_stats: RoundStats, elapsed_ns: int) -> None:
        self.estimator.observe(round_stats, elapsed_ns)

    def observe_turn(self, proposed: bool) -> None:
        self.estimator.observe_turn(proposed)

    def observe_shadow(self, num_drafted: int, num_accepted: int) -> None:
        self.estimator.observe_shadow(num_drafted, num_accepted)

    def observe_stretch(self, num_tokens: int, elapsed_ns: int, token_ns: int, empty_turns: int = 0,
                        passes_ns: int | None = None) -> None:
        self.estimator.observe_stretch(num_tokens, elapsed_ns, token_ns, empty_turns, passes_ns)

    def observe_solo_tokens(self, num_tokens: int, token_ns: int) -> None:
        self.estimator.observe_solo_tokens(num_tokens, token_ns)

    def target_runs_lookup(self) -> None:
        self.estimator.target_runs_lookup = True

    def seed(self, costs: MeasuredCosts) -> None:
        self.estimator.seed(costs)

    def costs(self) -> MeasuredCosts:
        return self.estimator.costs()


def _ceil(x: float) -> int:
    """ceil, blind to float noise (a ratio that is 20 on paper must not become 21)."""
    return math.ceil(round(x, 6))
