"""What a speculating call does next: a round drafting k tokens, or a stretch of tokens
the target decodes alone.

A fixed k is the textbook setting (`FixedK`). `AdaptiveK` is `decide`, a pure function
of the estimates its cost estimator keeps (speculative.estimator). Speculation pays
while a round's expected tokens over its cost, E[tokens](a, k) / (k d + c(k + 1) + R),
beat decoding alone, 1 / s; where the target verifies while the draft drafts, a round
may cost less (its successor drafted ahead).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from speculative.estimator import CostEstimator, Estimates, MeasuredCosts


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
    width: int = 1  # continuations a round may propose at once, as a token tree (1: a chain)
    # A model drafter stops drafting once its own chance that the target accepts every
    # token so far falls below this (DraftSession.propose): see `stop_reach`.
    min_reach: float = 0.0
    # In a tree, a model drafter's branch must have at least this chance of being the
    # target's token (DraftSession.propose_tree): see `branch_reach`.
    min_branch: float = 0.0


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
    known). A stretch too long for what remains runs to the end (`_stretch_unless_last`)."""
    if e.target_runs_lookup:  # the target runs the drafter's rounds, inside stretches
        return _lookup_stretch(e, remaining, rules)
    if not e.measured:  # a round of the k the priors favour
        return Action(k=e.best_k(), ahead=True) if turn is Turn.DRAFT else TAKE_ROUND
    if turn is not Turn.DRAFT:  # the drafter proposed nothing
        return _after_empty_turn(e, remaining, turn is Turn.NOTHING_UNTIL_MATCH, rules)
    if e.worker_k == 0 and e.stretches_measure:
        # No room for drafts on the loaded target, and stretches measure acceptance: no
        # probe is needed, and each restart costs a step the session misses.
        return _stretch_unless_last(rules.longest, remaining, least=rules.first)
    k = e.best_k()
    lead = 0.0 if e.worker_k == 0 else e.tokens_per_ns(k) * e.solo_token_ns  # speculation's speed over alone
    # After a stretch one round re-measures (a probe), unless the stretch measured.
    if (e.after_stretch and not e.stretches_measure) or (lead >= 1.0 and e.one_token_measured):
        return _round(e, k)
    if lead >= 1.0:  # read from an extrapolated c(1): one stretch measures it first
        return _stretch_unless_last(rules.sized(e, rules.first), remaining, least=None, otherwise=_round(e, k))
    # Speculation loses: a stretch, twice the last one's while probes keep losing.
    stretch = rules.sized(e, min(rules.first * 2 ** e.losing_stretches, rules.longest))
    return _stretch_unless_last(stretch, remaining, least=stretch)


def _lookup_stretch(e: Estimates, remaining: int | None, rules: StretchRules) -> Action:
    """The target runs a prompt-lookup drafter's rounds inside a stretch (no round trip,
    no drafting: R = d = 0), verifying the fastest k at that price a pass, or none where
    even those rounds lose. Stretches in a row double from `first` (k re-chosen after
    each from what it measured) to `longest`, at once where the loaded target leaves no
    room for drafts; each sized so that its start is at most start_share of its time."""
    inside = dataclasses.replace(e, overhead_ns=0.0, draft_token_ns=0.0, overlaps=False)
    k = inside.best_k()
    if e.worker_k == 0 or (inside.measured and inside.tokens_per_ns(k) <= inside.tokens_per_ns(0)):
        k = 0
    size = rules.longest if e.worker_k == 0 else min(rules.first * 2 ** e.losing_stretches, rules.longest)
    if e.measured:
        size = rules.sized(e, size)
    return dataclasses.replace(_stretch_unless_last(size, remaining, least=rules.first), lookup_k=k)


def _round(e: Estimates, k: int) -> Action:
    min_branch = branch_reach(e, k)
    width = e.max_width if e.branch_yield >= min_branch else 1
    return Action(k=k, ahead=draft_ahead(e, k), min_reach=stop_reach(e, k), width=width, min_branch=min_branch)


def branch_reach(e: Estimates, k: int) -> float:
    """The tokens a tree's branch node must bring for its place in the pass: it widens the
    target's pass past the chain's k + 1 tokens, so at least what that costs times the
    tokens per ns that rounds of k earn. A tree is proposed while its branches' measured
    yield per node (`branch_yield`) pays."""
    if not e.measured:
        return 1.0
    return min(1.0, max(0.0, e.compute_ns(k + 2) - e.compute_ns(k + 1)) * e.tokens_per_ns(k))


def stop_reach(e: Estimates, k: int) -> float:
    """The chance of acceptance below which a model drafter's next token does not pay:
    drafting it costs d and widens the target's pass (`widening_ns`), so it must bring at
    least that much times the tokens per ns that rounds of k earn. 0 for a free drafter."""
    if e.draft_token_ns <= 0.0:
        return 0.0
    return min(1.0, (e.draft_token_ns + e.widening_ns(k)) * e.tokens_per_ns(k))


def draft_ahead(e: Estimates, k: int) -> bool:
    """Whether drafting the next proposal while this one is verified saves time on average
    (a tie, as for a free drafter, drafts ahead)."""
    return e.ahead_saving_ns(k) >= 0.0


def _after_empty_turn(e: Estimates, remaining: int | None, ends_at_match: bool, rules: StretchRules) -> Action:
    """The plain step while rounds, empty ones included at their rate, beat decoding alone;
    else a stretch, longer with each empty turn in a row. One that ends where the drafter
    proposes again is taken when its start, spread over the expected gap of 1 / f tokens,
    costs less than an empty round a token. Only stretches measure s: a first-size one
    re-measures it once that risks at most start_share of the rounds' time since the last."""
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
    """The loop asks `next_action`, and tells `estimator` what each round and stretch
    measured (a fixed k is measured too: its costs are reported and handed on)."""

    def __init__(self, max_k: int, estimator: CostEstimator):
        self.max_k, self.estimator = max_k, estimator  # max_k: the largest k it will ask for

    def next_action(self, remaining: int | None = None, turn: Turn = Turn.DRAFT) -> Action:
        raise NotImplementedError


class FixedK(SpeculationPolicy):
    """k every round (a tree of up to `width` continuations where the drafter finds
    several), the next drafted ahead where the target overlaps; a turn that proposed
    nothing takes the plain step."""

    def __init__(self, k: int, width: int = 1):
        super().__init__(k, CostEstimator(k))
        self.width = width

    def next_action(self, remaining: int | None = None, turn: Turn = Turn.DRAFT) -> Action:
        return Action(k=self.max_k, ahead=True, width=self.width) if turn is Turn.DRAFT else TAKE_ROUND


class AdaptiveK(SpeculationPolicy):
    """`decide` on this call's own estimates; `costs` seeds them with what earlier calls
    between the same draft and target measured. overlaps: the target verifies while the
    draft drafts (a remote target with pipelining on), so rounds are priced with
    drafting ahead. max_width: rounds may propose token trees of that many continuations
    where their branches pay (`branch_reach`)."""

    def __init__(self, max_k: int, decay: float = 0.9, rules: StretchRules = StretchRules(),
                 costs: MeasuredCosts | None = None, overlaps: bool = False, max_width: int = 1):
        super().__init__(max_k, CostEstimator(max_k, decay, costs, overlaps, max_width))
        self.rules = rules

    def next_action(self, remaining: int | None = None, turn: Turn = Turn.DRAFT) -> Action:
        return decide(self.estimator.estimates(), remaining, turn, self.rules)


def _ceil(x: float) -> int:
    """ceil, blind to float noise (a ratio that is 20 on paper must not become 21)."""
    return math.ceil(round(x, 6))
