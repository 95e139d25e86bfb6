"""How many tokens to draft in the next round.

A fixed k is the textbook setting. Speculation only pays when the expected number of
tokens per round outweighs what drafting and a longer verification cost, so the policy
sees every finished round and may change k (down to 0: plain target decoding).
"""

from __future__ import annotations

import abc

from speculative.stats import RoundStats


class SpeculationPolicy(abc.ABC):
    max_k: int  # the largest k this policy will ever ask for

    @abc.abstractmethod
    def next_k(self) -> int:
        """Draft tokens for the next round (0 = a plain target step)."""

    def observe(self, round_stats: RoundStats) -> None:
        """Learns from a finished round."""


class FixedK(SpeculationPolicy):
    def __init__(self, k: int):
        self.max_k = k

    def next_k(self) -> int:
        return self.max_k


class AdaptiveK(SpeculationPolicy):
    """Chooses k each round to maximise expected tokens per second, from measurements.

    With per-token acceptance probability a, a round drafting k tokens yields
    E[tokens] = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, eq. 1) and costs
    k * draft_token_ns + verify_ns(k + 1). Both a and the costs are running averages of
    this request's rounds, so a slow network or a costly verification shows up in
    verify_ns and lowers k, down to 0 (a plain target step) when speculation does not pay.
    Verification costs not yet measured for some width are interpolated linearly.
    """

    def __init__(self, max_k: int, decay: float = 0.9, probe_every: int = 8):
        self.max_k = max_k
        self.decay = decay  # weight of the past in every running average
        self.probe_every = probe_every  # at k = 0, draft one token this often to re-measure
        self.accepted = 1.0  # decayed counts of the Bernoulli trials behind a:
        self.trials = 2.0  # a prior acceptance of 0.5
        self.draft_token_ns = 0.0
        self.verify_ns: dict[int, float] = {}  # tokens per verify pass -> mean ns
        self.rounds_at_zero = 0

    def acceptance(self) -> float:
        return self.accepted / self.trials

    def next_k(self) -> int:
        if not self.verify_ns:
            return self.max_k  # nothing measured yet: start optimistic
        best_k = max(range(self.max_k + 1), key=self.expected_tokens_per_ns)
        self.rounds_at_zero = self.rounds_at_zero + 1 if best_k == 0 else 0
        if best_k == 0 and self.rounds_at_zero % self.probe_every == 0:
            return min(1, self.max_k)
        return best_k

    def expected_tokens_per_ns(self, k: int) -> float:
        a = min(self.acceptance(), 1.0 - 1e-9)
        expected_tokens = (1.0 - a ** (k + 1)) / (1.0 - a)
        return expected_tokens / (k * self.draft_token_ns + self._verify_cost(k + 1))

    def observe(self, round_stats: RoundStats) -> None:
        rejected = round_stats.num_accepted < round_stats.num_drafted
        self.accepted = self.decay * self.accepted + round_stats.num_accepted
        self.trials = self.decay * self.trials + round_stats.num_accepted + rejected
        if round_stats.num_drafted:
            per_token = round_stats.draft_ns / round_stats.num_drafted
            self.draft_token_ns = _blend(self.draft_token_ns or per_token, per_token, self.decay)
        width = round_stats.num_drafted + 1
        previous = self.verify_ns.get(width, round_stats.verify_ns)
        self.verify_ns[width] = _blend(previous, round_stats.verify_ns, self.decay)

    def _verify_cost(self, width: int) -> float:
        if width in self.verify_ns:
            return self.verify_ns[width]
        measured = sorted(self.verify_ns)
        below = [w for w in measured if w < width]
        above = [w for w in measured if w > width]
        if below and above:
            lo, hi = below[-1], above[0]
            return self.verify_ns[lo] + (self.verify_ns[hi] - self.verify_ns[lo]) * (width - lo) / (hi - lo)
        # Outside what was measured: assume each extra token adds 10% of the nearest
        # measurement, a guess that the next round at that width corrects.
        nearest = below[-1] if below else above[0]
        return self.verify_ns[nearest] * (1.0 + 0.1 * (width - nearest))


def _blend(old: float, new: float, decay: float) -> float:
    return decay * old + (1.0 - decay) * new
