"""The cost model of speculative decoding with a per-round delay.

Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding"
(ICML 2023): with per-token acceptance alpha (their E[beta]) and i.i.d. acceptances, a
round that drafts k tokens yields E[tokens](k) = (1 - alpha^(k+1)) / (1 - alpha) tokens
(their eq. 1). A round costs k draft steps, one verification of width k and, across a
network, a delay R (round trip, serialization, queueing), so against target-only
decoding at t_target per token:

    speedup(k, R) = E[tokens](k) * t_target / (k * t_draft + t_verify(k) + R)

Speculation pays while speedup > 1: the break-even delay is
R* = E[tokens](k) * t_target - k * t_draft - t_verify(k). Times are in nanoseconds.

A drafter that proposes only when it finds something (n-gram prompt lookup) drafts in a
fraction f of the rounds; the others are one-token target steps that still pay R:

    speedup(k, R) = (f * E[tokens](k) + 1 - f) * t_target
                    / (f * (k * t_draft + t_verify(k)) + (1 - f) * t_verify(0) + R)

which is the formula above when f = 1 (a draft model always proposes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from foundation.limits import MAX_SPECULATIVE_TOKENS
from foundation.pass_cost import Moments, PassCost, fit_pass_cost
from speculative.estimator import expected_tokens  # the same formula the adaptive policy uses

K_MAX = MAX_SPECULATIVE_TOKENS  # the model considers every k the protocol allows


@dataclass(frozen=True)
class CostModel:
    alpha: float  # per-token acceptance probability, in [0, 1]
    target_step_ns: float  # target-only decoding, per token
    draft_step_ns: float  # drafting, per draft token
    verify: PassCost  # t_verify(k) = verify.ns(k): base_ns + per_token_ns * k
    draft_fraction: float = 1.0  # f: fraction of rounds that draft (n-gram: those with a match)

    def verify_ns(self, k: int) -> float:
        return self.verify.ns(k)

    def tokens_per_round(self, k: int) -> float:
        f = self.draft_fraction
        return f * expected_tokens(self.alpha, k) + (1.0 - f)

    def round_ns(self, k: int, delay_ns: float) -> float:
        """Mean round time at k: drafting rounds and, for f < 1, plain target steps."""
        f = self.draft_fraction
        return (
            f * (k * self.draft_step_ns + self.verify_ns(k))
            + (1.0 - f) * self.verify_ns(0)
            + delay_ns
        )

    def speedup(self, k: int, delay_ns: float) -> float:
        return self.tokens_per_round(k) * self.target_step_ns / self.round_ns(k, delay_ns)

    def break_even_delay_ns(self, k: int) -> float:
        """The per-round delay R at which speedup(k, R) = 1 (negative: never pays)."""
        return self.tokens_per_round(k) * self.target_step_ns - self.round_ns(k, 0.0)

    def best_k(self, delay_ns: float, k_max: int = K_MAX) -> int:
        """The k in 1..k_max with the highest speedup at this delay (ties: the smaller)."""
        return max(range(1, k_max + 1), key=lambda k: (self.speedup(k, delay_ns), -k))


def alpha_from_rounds(rounds: Sequence[tuple[int, int]]) -> float:
    """Maximum-likelihood per-token acceptance from (k, accepted) of drafting rounds.

    Under the model each draft position is accepted with probability alpha until the
    first rejection: a round contributes `accepted` successes and one failure unless all
    k were accepted, so alpha = successes / (successes + failures).
    """
    successes = sum(accepted for k, accepted in rounds if k > 0)
    failures = sum(1 for k, accepted in rounds if k > 0 and accepted < k)
    if successes + failures == 0:
        return 0.0
    return successes / (successes + failures)


def fit_verify(points: Sequence[tuple[int, float, int]]) -> PassCost:
    """Least-squares line t_verify(k) = base + per_token * k through (k, mean ns, count)
    points, weighted by count (foundation/pass_cost.py). One width: flat at its mean (no
    slope can be seen). A falling line is noise (verifying more tokens is not cheaper):
    flat at the mean."""
    points = [(k, ns, n) for k, ns, n in points if n > 0]
    if not points:
        raise ValueError("no verification times to fit")
    ks, costs, counts = zip(*points)
    return fit_pass_cost(Moments.of(ks, costs, weights=counts))
