"""What the target's pass over w tokens costs: c(w) = c0 + g x(w), fitted to every pass.

x = w - 1, or where the target reports what it timed a pass of each width to cost
(`step_costs`: a CPU's kernels are not monotone in the width, and the worker pads small
steps to the cheapest), x = that time over the cheapest one's, less 1, so the fit scales
the worker's own curve to what the call measures. The fit is decayed least squares with
a prior on the slope, so one width already gives a line: the one fit of a pass cost
(`foundation.pass_cost.fit_pass_cost`), its base c(1) = c0. In nanoseconds.
"""

from __future__ import annotations

from foundation.pass_cost import Moments, PassCost, fit_pass_cost

# g / c(1) before passes of two widths tell it: a memory-bound target, the common case.
SLOPE_PRIOR = 0.1
SLOPE_PRIOR_WEIGHT = 0.25  # of the prior slope against the widths' variance
# g / c0 where the target reported step costs: a pass costs what the worker timed it to.
STEP_COSTS_SLOPE_PRIOR = 1.0
# A pass slower than this many times the line counts as this slow: a burst of load must
# not rule a width out; a lasting slowdown is still learnt, a clipped step at a time.
SLOW_PASS_CLIP = 1.25


class PassCostFit:
    """c(w), refitted as each pass is observed; weight `decay` on the past."""

    def __init__(self, decay: float):
        self.decay = decay
        self.step_costs: tuple[
            float, ...
        ] = ()  # the target's (ModelInfo.step_ms), where it timed its steps
        # c(1) and g, once fitted (None: g not measured)
        self.one_token_ns = 0.0
        self.per_token_ns = None
        self.one_token_measured = (
            False  # c(1) from one-token passes (else extrapolated from wider ones)
        )
        self._sums = [0.0] * 5  # decayed n, sum x, sum x^2, sum c, sum x c over passes

    @property
    def slope(self) -> float:
        """g, or the prior's share of c(1) while no two widths told it."""
        return (
            self.per_token_ns
            if self.per_token_ns is not None
            else slope_prior(self.step_costs) * self.one_token_ns
        )

    @property
    def line(self) -> PassCost:
        """c(w) = line.ns(x(w)): c(1) and the slope (its prior's while not measured)."""
        return PassCost(self.one_token_ns, self.slope)

    def pass_ns(self, width: int) -> float:
        return self.line.ns(pass_x(self.step_costs, width))

    def seed(self, one_token_ns: float, per_token_ns: float | None) -> None:
        """An earlier call's line, as two pseudo-passes the first real ones outweigh."""
        self.one_token_ns, self.per_token_ns = one_token_ns, per_token_ns
        for x in (0, 4):
            self._add_sample(x, self.line.ns(x), 1.0)

    def observe(self, width: int, compute_ns: float, weight: float = 1.0, age: bool = True) -> None:
        """Refits the line over all passes, the sample clipped to SLOW_PASS_CLIP times the
        line (a fast pass is real, a slow one may be a spike); age=False: the earlier
        passes keep their weight. Least squares (foundation/pass_cost.py) with the slope
        prior, and no slope steeper than a pass of no tokens at 0."""
        x = pass_x(self.step_costs, width)
        if self._sums[0]:
            compute_ns = min(compute_ns, SLOW_PASS_CLIP * self.line.ns(x))
        self._add_sample(x, compute_ns, weight, age)
        moments = self._moments()
        slope = slope_prior(self.step_costs)
        fitted = fit_pass_cost(
            moments,
            # g where one width tells nothing
            prior_slope=slope * moments.mean_c / (1.0 + slope * moments.mean_x),
            prior_weight=SLOPE_PRIOR_WEIGHT,
            max_slope=moments.mean_c / (1.0 + moments.mean_x),
        )
        self.one_token_ns, self.per_token_ns = fitted.base_ns, fitted.per_token_ns

    def _moments(self) -> Moments:
        """The passes' moments from the decayed sums (weights normalised to sum to 1)."""
        n, sx, sxx, sc, sxc = self._sums
        mean_x, mean_c = sx / n, sc / n
        return Moments(mean_x, mean_c, sxx / n - mean_x**2, sxc / n - mean_x * mean_c)

    def _add_sample(self, x: float, compute_ns: float, weight: float, age: bool = True) -> None:
        decayed = [self.decay * total if age else total for total in self._sums]
        self._sums = [
            decayed[0] + weight,
            decayed[1] + weight * x,
            decayed[2] + weight * x * x,
            decayed[3] + weight * compute_ns,
            decayed[4] + weight * x * compute_ns,
        ]


def slope_prior(step_costs: tuple[float, ...]) -> float:
    """g / c0 before two widths are measured."""
    return STEP_COSTS_SLOPE_PRIOR if step_costs else SLOPE_PRIOR


def pass_x(step_costs: tuple[float, ...], width: int) -> float:
    """Where a pass of `width` tokens sits on the line c0 + g x: w - 1, or with the target's
    timed `step_costs`, its cost over the cheapest width's, less 1 (past the timed widths,
    on at their mean slope)."""
    if not step_costs:
        return width - 1.0
    cost = step_costs[min(width, len(step_costs)) - 1]
    if width > len(step_costs):
        cost += (width - len(step_costs)) * max(
            0.0, (step_costs[-1] - step_costs[0]) / max(len(step_costs) - 1, 1)
        )
    return cost / min(step_costs) - 1.0


def blend(old: float | None, new: float, decay: float) -> float:
    """The decayed average of old and new; new alone while nothing is measured (None)."""
    return new if old is None else decay * old + (1.0 - decay) * new
