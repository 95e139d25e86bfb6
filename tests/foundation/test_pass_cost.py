"""The one pass cost and its one fit (foundation/pass_cost.py); each caller's fit as it
was before they shared it, reproduced bit for bit (the report's to rounding)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundation.pass_cost import Moments, PassCost, fit_pass_cost
from model_runtime.step_scheduler import fit_step_cost
from report.model import fit_verify
from speculative.pass_costs import (
    SLOPE_PRIOR_WEIGHT,
    SLOW_PASS_CLIP,
    PassCostFit,
    pass_x,
    slope_prior,
)

MS = 1_000_000  # ns
EXAMPLES = settings(max_examples=300, deadline=None)


def bits(cost) -> list[str]:
    return [float(value).hex() for value in cost]


# --- the fit ------------------------------------------------------------------------------


def test_a_line_through_exact_samples_is_found():
    xs = range(5)
    moments = Moments.of(xs, [8 * MS + 2 * MS * x for x in xs])
    assert fit_pass_cost(moments) == pytest.approx((8 * MS, 2 * MS, 0.0))
    assert PassCost(8 * MS, 2 * MS).ns(3) == 14 * MS


def test_two_kinds_of_rows_are_told_apart():
    """Rows with logits at 2 ms, prefill rows at 0.5 ms, over a 50 ms base."""
    xs, ps = [1, 4, 8] * 2, [0] * 3 + [64] * 3
    costs = [50 * MS + 2 * MS * x + MS // 2 * p for x, p in zip(xs, ps)]
    cost = fit_pass_cost(Moments.of(xs, costs, ps), min_var=1.0)
    assert cost == pytest.approx((50 * MS, 2 * MS, MS // 2))
    assert cost.ns(4, 64) == pytest.approx(90 * MS)


def test_too_little_spread_tells_no_slope():
    """Rows within about one of each other (variance under min_var): every pass costs
    about the same, the slope unknown (0); with no spread at all, whatever min_var."""
    close = Moments.of([4, 5], [10 * MS, 12 * MS])  # variance 0.25
    assert fit_pass_cost(close, min_var=1.0) == (11 * MS, 0.0, 0.0)
    assert fit_pass_cost(close).per_token_ns == pytest.approx(2 * MS)
    one_width = Moments.of([4], [12 * MS], weights=[3])
    assert fit_pass_cost(one_width) == (12 * MS, 0.0, 0.0)


def test_a_prior_gives_one_width_a_slope():
    one_width = Moments.of([0], [10 * MS])
    cost = fit_pass_cost(one_width, prior_slope=1 * MS, prior_weight=0.25)
    assert cost == pytest.approx((10 * MS, 1 * MS, 0.0))


def test_slopes_and_the_base_are_clamped_as_asked():
    falling = Moments.of([0, 4], [12 * MS, 10 * MS])
    assert fit_pass_cost(falling) == (11 * MS, 0.0, 0.0)  # flat at the mean
    steep = Moments.of([1, 3], [1 * MS, 9 * MS])  # 4 ms a row, base -3 ms
    assert fit_pass_cost(steep) == pytest.approx((-3 * MS, 4 * MS, 0.0))
    assert fit_pass_cost(steep, floor_base=True).base_ns == 0.0
    capped = fit_pass_cost(steep, max_slope=2.5 * MS)
    assert capped == pytest.approx((0.0, 2.5 * MS, 0.0))


def test_a_pass_cost_is_measured_once_anything_is_priced():
    assert not PassCost().measured and PassCost(0.0, 1.0).measured
    assert PassCost(1.0, 2.0, 3.0).ns(2) == 5.0


# --- each caller's former fit, bit for bit --------------------------------------------------


def former_fit_step_cost(steps):
    """model_runtime.step_scheduler.fit_step_cost before the one fit."""
    if not steps:
        return (0.0, 0.0, 0.0)
    n = len(steps)
    plain = [run - logits for run, logits, _ in steps]
    logits = [logits for _, logits, _ in steps]
    cost = [c for _, _, c in steps]
    mean_p, mean_l, mean_c = sum(plain) / n, sum(logits) / n, sum(cost) / n
    dp, dl, dc = (
        [p - mean_p for p in plain],
        [x - mean_l for x in logits],
        [c - mean_c for c in cost],
    )

    def dot(xs, ys):
        return sum(x * y for x, y in zip(xs, ys))

    var_p, var_l = dot(dp, dp) / n, dot(dl, dl) / n
    cov_lp, cov_lc, cov_pc = dot(dl, dp) / n, dot(dl, dc) / n, dot(dp, dc) / n
    determinant = var_l * var_p - cov_lp**2
    if var_l < 1.0:
        slope = 0.0
    elif var_p < 1.0 or determinant < 0.01 * var_l * var_p:
        slope = cov_lc / var_l
    else:
        slope = (cov_lc * var_p - cov_pc * cov_lp) / determinant
    slope = min(max(slope, 0.0), mean_c / max(mean_l, 1.0))
    plain_slope = 0.0 if var_p < 1.0 else max(0.0, (cov_pc - slope * cov_lp) / var_p)
    return (max(mean_c - slope * mean_l - plain_slope * mean_p, 0.0), slope, plain_slope)


@st.composite
def steps(draw):
    """(run_tokens, logit_tokens, step_ns) of a scheduler's recent steps."""
    logits = draw(st.lists(st.integers(0, 64), min_size=1, max_size=32))
    return [
        (x + draw(st.integers(0, 512)), x, draw(st.integers(1, 400 * MS)))
        if draw(st.booleans())
        else (x, x, draw(st.integers(1, 400 * MS)))
        for x in logits
    ]


@EXAMPLES
@given(steps())
def test_the_step_schedulers_fit_is_as_it_was(recent):
    assert bits(fit_step_cost(recent)) == bits(former_fit_step_cost(recent))


class FormerPassCostFit(PassCostFit):
    """speculative.pass_costs.PassCostFit.observe before the one fit."""

    def observe(self, width, compute_ns, weight=1.0, age=True):
        x = pass_x(self.step_costs, width)
        if self._sums[0]:
            compute_ns = min(compute_ns, SLOW_PASS_CLIP * self.line.ns(x))
        self._add_sample(x, compute_ns, weight, age)
        n, sx, sxx, sc, sxc = self._sums
        mean_x, mean_c = sx / n, sc / n
        slope = slope_prior(self.step_costs)
        prior = slope * mean_c / (1.0 + slope * mean_x)
        g = (sxc / n - mean_x * mean_c + SLOPE_PRIOR_WEIGHT * prior) / (
            sxx / n - mean_x**2 + SLOPE_PRIOR_WEIGHT
        )
        g = min(max(g, 0.0), mean_c / (1.0 + mean_x))
        self.one_token_ns, self.per_token_ns = mean_c - g * mean_x, g


passes = st.tuples(
    st.integers(1, 9),  # width
    st.floats(0.1 * MS, 500 * MS),  # compute_ns
    st.sampled_from([1.0, 0.1, 0.7]),  # weight
    st.booleans(),  # age
)


@EXAMPLES
@given(
    st.lists(passes, min_size=1, max_size=40),
    st.sampled_from([(), (200.0,) * 6 + (250.0, 260.0, 270.0), (5.0, 5.5, 7.0)]),
    st.one_of(st.none(), st.tuples(st.floats(1 * MS, 300 * MS), st.floats(0.0, 50 * MS))),
    st.sampled_from([0.9, 0.99]),
)
def test_the_estimators_fit_is_as_it_was(observed, step_costs, seed, decay):
    fits = [PassCostFit(decay), FormerPassCostFit(decay)]
    for fit in fits:
        fit.step_costs = step_costs
        if seed is not None:
            fit.seed(*seed)
        for width, compute_ns, weight, age in observed:
            fit.observe(width, compute_ns, weight, age)
    now, before = fits
    assert bits((now.one_token_ns, now.per_token_ns)) == bits(
        (before.one_token_ns, before.per_token_ns)
    )


def former_fit_verify(points):
    """report.model.fit_verify before the one fit."""
    points = [(k, ns, n) for k, ns, n in points if n > 0]
    total = sum(n for _, _, n in points)
    mean_k = sum(k * n for k, _, n in points) / total
    mean_ns = sum(ns * n for _, ns, n in points) / total
    spread = sum(n * (k - mean_k) ** 2 for k, _, n in points)
    if spread == 0:
        return mean_ns, 0.0
    slope = sum(n * (k - mean_k) * (ns - mean_ns) for k, ns, n in points) / spread
    if slope < 0:
        return mean_ns, 0.0
    return mean_ns - slope * mean_k, slope


@EXAMPLES
@given(
    st.lists(
        st.tuples(st.integers(0, 16), st.floats(1 * MS, 500 * MS), st.integers(1, 200)),
        min_size=1,
        max_size=17,
    )
)
def test_the_reports_fit_is_as_it_was(points):
    """The same rules; the sums are normalised and squared by multiplying now, so the
    last bits may differ (the flat cases are exact)."""
    base, slope = former_fit_verify(points)
    fitted = fit_verify(points)
    assert fitted.per_token_ns == pytest.approx(slope, rel=1e-9, abs=1e-6)
    assert fitted.base_ns == pytest.approx(base, rel=1e-9, abs=1e-3)
    assert fitted.per_prefill_token_ns == 0.0
    if len({k for k, _, n in points}) == 1:  # one width: flat at the same mean
        assert bits(fitted) == bits((base, slope, 0.0))
