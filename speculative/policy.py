"""How many tokens to draft in the next round, or whether to let the target decode alone.

A fixed k is the textbook setting. Speculation only pays when the expected number of
tokens per round outweighs what drafting, a longer verification and the round trip to
the target cost, so an adaptive policy sees every finished round and chooses, each time,
between a round with some k and a stretch of target-only decoding ("solo": the target's
own decode loop, which pays no round trip per token).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

from speculative.stats import RoundStats


@dataclass(frozen=True)
class MeasuredCosts:
    """Costs an AdaptiveK measured between one drafter and one target, in nanoseconds."""

    compute_ns: dict[int, float]  # the target's pass over w tokens, by w
    overhead_ns: float  # the rest of a round trip (R)
    solo_ns: float  # per token decoded alone (0 = not measured)
    draft_token_ns: float  # per draft token


class SpeculationPolicy(abc.ABC):
    max_k: int  # the largest k this policy will ever ask for

    @abc.abstractmethod
    def next_k(self) -> int:
        """Draft tokens for the next round."""

    def solo_tokens(self) -> int:
        """Tokens the target should decode alone before the next round (0 = draft now)."""
        return 0

    def observe(self, round_stats: RoundStats) -> None:
        """Learns from a finished round (or a token the target decoded alone)."""


class FixedK(SpeculationPolicy):
    def __init__(self, k: int):
        self.max_k = k

    def next_k(self) -> int:
        return self.max_k


def expected_tokens(acceptance: float, k: int) -> float:
    """E[tokens per round] for k draft tokens accepted each with probability
    `acceptance` until the first rejection, plus the target's own token (Leviathan et
    al. 2023, eq. 1: (1 - a^(k+1)) / (1 - a))."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class AdaptiveK(SpeculationPolicy):
    """Chooses each round the fastest of k = 1..max_k and target-only decoding, from
    this request's own measurements (decayed running averages):

    - a: per-token acceptance (prior 0.5), from the rounds that drafted;
    - f: the fraction of rounds in which the drafter proposed anything (the n-gram
      drafter often finds nothing to copy; a model drafter always proposes);
    - d: drafting time per draft token;
    - c(w): the target's compute for a pass over w tokens, as the target reports it
      (widths not measured yet are interpolated, or extrapolated at +10% per token);
    - R: the rest of a round trip (network, serialization, queueing: verify - compute);
    - s: time per token when the target decodes alone (prior: c(1); streamed, R is paid
      once per stretch, not per token).

    Tokens per second at k (Leviathan et al. 2023, with f and R as in `python -m report`):

        (f * E[tokens](a, k) + 1 - f) / (f * (k * d + c(k + 1)) + (1 - f) * c(1) + R)

    against 1 / s for decoding alone. When decoding alone wins, the target decodes a
    stretch of tokens, then one round re-measures (a probe). The first stretch is
    `first_solo` tokens, or longer when the round trip is long, so that a probe costs at
    most `probe_share` of the stretch; each probe that still loses doubles it, up to
    `max_solo`.

    `costs` seeds the cost averages (not the acceptance, which depends on the text) with
    what earlier calls between the same draft and target measured, so a call over a slow
    link can decide before its first round trip.
    """

    def __init__(self, max_k: int, decay: float = 0.9, first_solo: int = 8, max_solo: int = 128,
                 probe_share: float = 0.05, costs: MeasuredCosts | None = None):
        self.max_k = max_k
        self.decay = decay  # weight of the past in every running average
        self.first_solo, self.max_solo, self.probe_share = first_solo, max_solo, probe_share
        self.accepted = 1.0  # decayed counts of the Bernoulli trials behind a:
        self.trials = 2.0  # a prior acceptance of 0.5
        self.proposed = 1.0  # decayed counts behind f (prior 1: the drafter proposes)
        self.asked = 1.0
        self.draft_token_ns = 0.0
        self.compute_ns: dict[int, float] = {}  # tokens per target pass -> mean ns
        self.overhead_ns = 0.0  # R
        self.solo_ns = 0.0  # s, once measured
        self.measured = False  # a round trip has been measured
        self.next_solo = first_solo
        self.probe_due = False  # the round after a solo stretch re-measures
        if costs is not None:
            self.seed(costs)

    def seed(self, costs: MeasuredCosts) -> None:
        """Starts from costs measured before (before this policy's first round)."""
        if costs.compute_ns:
            self.draft_token_ns, self.compute_ns = costs.draft_token_ns, dict(costs.compute_ns)
            self.overhead_ns, self.solo_ns, self.measured = costs.overhead_ns, costs.solo_ns, True

    def costs(self) -> MeasuredCosts:
        """What this policy measured of the costs, to seed the next call's."""
        return MeasuredCosts(dict(self.compute_ns), self.overhead_ns, self.solo_ns, self.draft_token_ns)

    def acceptance(self) -> float:
        return self.accepted / self.trials

    def proposal_rate(self) -> float:
        return self.proposed / self.asked

    def next_k(self) -> int:
        return max(range(1, self.max_k + 1), key=lambda k: (self.tokens_per_ns(k), -k))

    def solo_tokens(self) -> int:
        if not self.measured or self.probe_due:
            self.probe_due = False
            return 0
        k = self.next_k()
        solo_ns = self.solo_cost_ns()
        if self.tokens_per_ns(k) >= 1.0 / solo_ns:
            self.next_solo = self.first_solo
            return 0
        # What a probe round costs beyond the token it yields, and the stretch over which
        # that is probe_share of the time.
        probe_ns = k * self.draft_token_ns + self._compute(k + 1) + self.overhead_ns - solo_ns
        stretch = min(max(self.next_solo, math.ceil(probe_ns / (self.probe_share * solo_ns))), self.max_solo)
        self.next_solo = min(2 * self.next_solo, self.max_solo)
        self.probe_due = True
        return stretch

    def tokens_per_ns(self, k: int) -> float:
        """Expected output tokens per nanosecond of rounds drafting (up to) k tokens."""
        if not self.compute_ns:  # nothing measured: relative costs, R = 0, d = 0
            return expected_tokens(self.acceptance(), k) / (1.0 + 0.1 * k)
        f = self.proposal_rate()
        tokens = f * expected_tokens(self.acceptance(), k) + 1.0 - f
        cost = f * (k * self.draft_token_ns + self._compute(k + 1)) + (1.0 - f) * self._compute(1) + self.overhead_ns
        return tokens / cost

    def solo_cost_ns(self) -> float:
        return self.solo_ns or self._compute(1)

    def observe(self, round_stats: RoundStats) -> None:
        width = round_stats.num_drafted + 1
        previous = self.compute_ns.get(width, round_stats.target_compute_ns)
        self.compute_ns[width] = _blend(previous, round_stats.target_compute_ns, self.decay)
        if round_stats.streamed:
            self.solo_ns = _blend(self.solo_ns or round_stats.verify_ns, round_stats.verify_ns, self.decay)
            return
        overhead = max(0, round_stats.verify_ns - round_stats.target_compute_ns)
        self.overhead_ns = _blend(self.overhead_ns if self.measured else overhead, overhead, self.decay)
        self.measured = True
        drafted = round_stats.num_drafted > 0
        self.proposed = self.decay * self.proposed + drafted
        self.asked = self.decay * self.asked + 1.0
        if drafted:
            rejected = round_stats.num_accepted < round_stats.num_drafted
            self.accepted = self.decay * self.accepted + round_stats.num_accepted
            self.trials = self.decay * self.trials + round_stats.num_accepted + rejected
            per_token = round_stats.draft_ns / round_stats.num_drafted
            self.draft_token_ns = _blend(self.draft_token_ns or per_token, per_token, self.decay)

    def _compute(self, width: int) -> float:
        if width in self.compute_ns:
            return self.compute_ns[width]
        measured = sorted(self.compute_ns)
        below = [w for w in measured if w < width]
        above = [w for w in measured if w > width]
        if below and above:
            lo, hi = below[-1], above[0]
            return self.compute_ns[lo] + (self.compute_ns[hi] - self.compute_ns[lo]) * (width - lo) / (hi - lo)
        # Outside what was measured: assume each token beyond the first adds 10% of a
        # one-token pass, a guess that the next round at that width corrects.
        nearest = below[-1] if below else above[0]
        return self.compute_ns[nearest] * (1.0 + 0.1 * (width - 1)) / (1.0 + 0.1 * (nearest - 1))


def _blend(old: float, new: float, decay: float) -> float:
    return decay * old + (1.0 - decay) * new
