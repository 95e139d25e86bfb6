"""When the target decodes alone instead of a round: a stretch (speculative.stretches runs it).

`hand_off` reads the same estimates as the k decision (speculative.policy): decoding alone
costs s a token, starting a stretch o; a round of k earns E[tokens](k) / round(k). A
stretch is taken where rounds lose to s, re-measured by one round after it (a probe), and
doubled while probes keep losing; sized so that its start is at most a share of its time.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from speculative.estimator import Estimates


class Turn(enum.Enum):
    """When the loop asks."""

    DRAFT = "draft"  # before drafting
    NOTHING_PROPOSED = "nothing"  # the drafter proposed nothing: a round would be one plain step
    NOTHING_UNTIL_MATCH = (
        "until_match"  # the same, and a stretch can end where it would propose again
    )


@dataclass(frozen=True)
class Stretch:
    tokens: int  # the target decodes up to this many tokens alone
    lookup_k: int = 0  # looked-up tokens the target verifies a pass, at most (0: none)


@dataclass(frozen=True)
class StretchRules:
    first: int = 8  # tokens of a first stretch
    longest: int = 128  # tokens of any stretch
    start_share: float = 0.05  # most of a stretch's time its start may take
    empty_growth: int = 4  # stretches after empty turns grow to at most this many times `first`

    def sized(self, e: Estimates, shortest: int) -> int:
        """At least `shortest` tokens, and long enough that starting it is at most
        start_share of its time; at most `longest`."""
        return min(
            max(shortest, _ceil(e.stretch.start_ns / (self.start_share * e.stretch.solo_token_ns))),
            self.longest,
        )


def hand_off(
    e: Estimates, k: int, remaining: int | None, turn: Turn, rules: StretchRules
) -> Stretch | None:
    """A stretch for a call that may still generate `remaining` tokens (None: not known), or
    None: a round of the policy's k (`e.best_k()`; after an empty turn, its plain step). A
    stretch too long for what remains runs to the end (`_unless_last`)."""
    s = e.stretch
    if s.target_runs_lookup:  # the target runs the drafter's rounds, inside stretches
        return _lookup_stretch(e, remaining, rules)
    if not e.measured:
        return None
    if turn is not Turn.DRAFT:  # the drafter proposed nothing
        return _after_empty_turn(e, k, remaining, turn is Turn.NOTHING_UNTIL_MATCH, rules)
    if e.worker_k == 0 and s.measure:
        # No room for drafts on the loaded target, and stretches measure acceptance: no
        # probe is needed, and each restart costs a step the session misses.
        return _unless_last(rules.longest, remaining, least=rules.first)
    # rounds' speed over alone
    lead = 0.0 if e.worker_k == 0 else e.tokens_per_ns(k) * s.solo_token_ns
    # After a stretch one round re-measures (a probe), unless the stretch measured.
    if (s.after_stretch and not s.measure) or (lead >= 1.0 and e.one_token_measured):
        return None
    if lead >= 1.0:  # read from an extrapolated c(1): one stretch measures it first
        return _unless_last(rules.sized(e, rules.first), remaining, least=None)
    # Speculation loses: a stretch, twice the last one's while probes keep losing.
    stretch = rules.sized(e, min(rules.first * 2**s.losing_in_a_row, rules.longest))
    return _unless_last(stretch, remaining, least=stretch)


def _lookup_stretch(e: Estimates, remaining: int | None, rules: StretchRules) -> Stretch:
    """The target runs a prompt-lookup drafter's rounds inside a stretch (no round trip,
    no drafting: R = d = 0), verifying the fastest k at that price a pass, or none where
    even those rounds lose. Stretches in a row double from `first` (k re-chosen after
    each from what it measured) to `longest`, at once where the loaded target leaves no
    room for drafts; each sized so that its start is at most start_share of its time."""
    inside = dataclasses.replace(e, overhead_ns=0.0, draft_token_ns=0.0, overlaps=False)
    k = inside.best_k()
    if e.worker_k == 0 or (inside.measured and inside.tokens_per_ns(k) <= inside.tokens_per_ns(0)):
        k = 0
    size = (
        rules.longest
        if e.worker_k == 0
        else min(rules.first * 2**e.stretch.losing_in_a_row, rules.longest)
    )
    if e.measured:
        size = rules.sized(e, size)
    return dataclasses.replace(_unless_last(size, remaining, least=rules.first), lookup_k=k)


def _after_empty_turn(
    e: Estimates, k: int, remaining: int | None, ends_at_match: bool, rules: StretchRules
) -> Stretch | None:
    """None (the plain step) while rounds, empty ones included at their rate, beat decoding
    alone; else a stretch, longer with each empty turn in a row. One that ends where the
    drafter proposes again is taken when its start, spread over the expected gap of 1 / f
    tokens, costs less than an empty round a token. Only stretches measure s: a first-size
    one re-measures it once that risks at most start_share of the rounds' time since the last."""
    s = e.stretch
    if ends_at_match:
        rounds_ns = e.round_ns(0)
        gap = 1.0 / s.proposal_rate if remaining is None else min(1.0 / s.proposal_rate, remaining)
        if s.solo_token_ns + s.start_ns / gap < rounds_ns:
            return Stretch(remaining if remaining is not None else rules.longest)
    else:
        rounds_ns = _rounds_ns_a_token(e, k)
        if rounds_ns > s.solo_token_ns:
            growth = min(2 ** max(s.empty_turns_in_a_row - 1, 0), rules.empty_growth)
            return _unless_last(rules.sized(e, rules.first * growth), remaining, least=rules.first)
    if not s.solo_measured:
        return None
    stretch = rules.sized(e, rules.first)
    risk_ns = s.start_ns + stretch * max(0.0, s.solo_token_ns - rounds_ns)
    if risk_ns > rules.start_share * s.rounds_since_ns:
        return None
    return _unless_last(stretch, remaining, least=None)


def _rounds_ns_a_token(e: Estimates, k: int) -> float:
    """What rounds of k cost a token where only a share f of turns propose (the others: a
    plain step, R paid)."""
    f = e.stretch.proposal_rate
    return (f * e.round_ns(k) + (1.0 - f) * e.round_ns(0)) / (f * e.expected_tokens(k) + (1.0 - f))


def _unless_last(stretch: int, remaining: int | None, least: int | None) -> Stretch | None:
    """A stretch. When fewer than `least` tokens would remain after it, it runs to the end
    (too few left to win back what speculating again costs); least=None: then no stretch
    (one that only measures is not worth it there)."""
    if remaining is None or remaining - stretch >= (least if least is not None else stretch):
        return Stretch(stretch)
    return Stretch(remaining) if least is not None else None


def _ceil(x: float) -> int:
    """ceil, blind to float noise (a ratio that is 20 on paper must not become 21)."""
    return math.ceil(round(x, 6))
