"""What a forward pass costs, and the one least-squares fit of it.

A pass whose rows are x tokens that need logits and p that need none (prefill chunks:
their rows skip the output layer and the decision) costs about

    base_ns + per_token_ns x + per_prefill_token_ns p      (nanoseconds)

Each user says what its x counts and where its base sits:
- the step scheduler (model_runtime/step_scheduler.py): x, the step's rows with
  logits over every session in it; base_ns, a step of none; p fitted;
- the adaptive policy's estimator (speculative/pass_costs.py): x, a verification's
  rows past the first, on the target's own width curve where it reports one; base_ns
  is then c(1), a one-token pass; p not fitted (0);
- the report (report/model.py): x = k, the draft tokens a verification scores past the
  target's own; base_ns, t_verify(0); p not fitted (0).

`fit_pass_cost` is the one fit: least squares over the samples' moments, with the
rules where the callers differ (how little spread tells no slope, a prior on the slope,
the steepest slope believed, a floor under the base) as its parameters. Each caller
gathers its moments its own way: the scheduler and the report from samples
(`Moments.of`), the estimator from decayed running sums.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Below this share of the product of their variances, x's and p's covariance leaves
# too little of either apart from the other to tell their slopes: x's slope alone.
COLLINEAR = 0.01


class PassCost(NamedTuple):
    """base_ns + per_token_ns x + per_prefill_token_ns p, in nanoseconds (module doc:
    what x and p count for each user). All 0: not measured yet."""

    base_ns: float = 0.0
    per_token_ns: float = 0.0  # a row that needs logits (x)
    per_prefill_token_ns: float = 0.0  # a row that needs none (p); 0: not fitted

    @property
    def measured(self) -> bool:
        return bool(self.base_ns or self.per_token_ns or self.per_prefill_token_ns)

    def ns(self, tokens: float, prefill_tokens: float = 0.0) -> float:
        """The pass of `tokens` rows with logits (x) and `prefill_tokens` without (p)."""
        cost = self.base_ns + self.per_token_ns * tokens
        return cost + self.per_prefill_token_ns * prefill_tokens if prefill_tokens else cost


@dataclass(frozen=True)
class Moments:
    """The weighted means and (co)variances of pass samples (x, p, c: c the cost in
    ns), over the weights the caller chose: a variance is the weighted mean of squared
    deviations where the weights sum to 1 (the thresholds and the prior weight of
    `fit_pass_cost` are in that scale). p's are 0 where a fit has no p."""

    mean_x: float
    mean_c: float
    var_x: float
    cov_xc: float
    mean_p: float = 0.0
    var_p: float = 0.0
    cov_xp: float = 0.0
    cov_pc: float = 0.0

    @classmethod
    def of(
        cls,
        xs: Sequence[float],
        cs: Sequence[float],
        ps: Sequence[float] | None = None,
        weights: Sequence[float] | None = None,
    ) -> Moments:
        """Two-pass moments of samples (x, c, and p where given: else no p), each of
        weight 1 or as weighted, the weights normalised to sum to 1."""

        def weighted_sum(values: Iterable[float]) -> float:
            return sum(values) if weights is None else sum(v * w for v, w in zip(values, weights))

        total = len(xs) if weights is None else sum(weights)
        mean_x, mean_c = weighted_sum(xs) / total, weighted_sum(cs) / total
        dx, dc = [x - mean_x for x in xs], [c - mean_c for c in cs]

        def co(a: list[float], b: list[float]) -> float:
            return weighted_sum(u * v for u, v in zip(a, b)) / total

        if ps is None:
            return cls(mean_x, mean_c, co(dx, dx), co(dx, dc))
        mean_p = weighted_sum(ps) / total
        dp = [p - mean_p for p in ps]
        return cls(
            mean_x, mean_c, co(dx, dx), co(dx, dc), mean_p, co(dp, dp), co(dx, dp), co(dp, dc)
        )


def fit_pass_cost(
    m: Moments,
    *,
    min_var: float = 0.0,
    prior_slope: float = 0.0,
    prior_weight: float = 0.0,
    max_slope: float = math.inf,
    floor_base: bool = False,
) -> PassCost:
    """The least-squares pass cost through the moments. A slope is fitted where its
    rows vary, by at least min_var (else it is unknown, 0, and joins the base: every
    pass costs about the same), or where x's slope has a prior: prior_slope, weighted
    as prior_weight of x's variance (for x alone, without p). With p: both slopes
    together, or x's alone where p's varies too little or moves with x (COLLINEAR),
    then p's over what x's leaves. x's slope is kept within [0, max_slope], p's >= 0
    (a pass with more rows never costs less); floor_base: the base too >= 0."""
    known_x = (m.var_x >= min_var and m.var_x > 0) or prior_weight > 0
    known_p = m.var_p >= min_var and m.var_p > 0
    if not known_x:
        slope = 0.0
    elif not known_p or (determinant := m.var_x * m.var_p - m.cov_xp**2) < (
        COLLINEAR * m.var_x * m.var_p
    ):
        slope = (m.cov_xc + prior_weight * prior_slope) / (m.var_x + prior_weight)
    else:
        slope = (m.cov_xc * m.var_p - m.cov_pc * m.cov_xp) / determinant
    slope = min(max(slope, 0.0), max_slope)
    prefill_slope = max(0.0, (m.cov_pc - slope * m.cov_xp) / m.var_p) if known_p else 0.0
    base = m.mean_c - slope * m.mean_x - prefill_slope * m.mean_p
    return PassCost(max(base, 0.0) if floor_base else base, slope, prefill_slope)
