"""What a speculating call has measured, as estimates a decision reads.

`CostEstimator` keeps decayed running averages (weight `decay` on the past) of what the
call saw; `Estimates` is a frozen snapshot of them with the cost model of Leviathan et
al. 2023 plus a per-round delay. In nanoseconds where a time:

- a, acceptance per draft token (prior 0.5 over PRIOR_TRIALS tokens), and a_i, by depth
  (each with the depth above as its prior): a copied run of text goes on or stops, so
  its deep tokens are accepted more often than its first. Decisions read a with HOPE
  more accepted token, so one rejected first round does not stop speculation. Also
  measured during stretches where drafting is free (`observe_shadow`: what prompt
  lookup would have proposed against the tokens the target decoded; unbiased under
  sampling, a looked-up token being proposed with certainty).
- d, drafting per token.
- c(w) = c0 + g x(w), the target's pass over w tokens (`pass_costs.PassCostFit`);
  R, the rest of a round (network, queueing, the verdict).
- load: the B sessions sharing the target's steps and its step cost, which cap k
  (`worker_k`).
- what stretches measured (s, o, f and the recent actions that size the next stretch):
  `stretch_costs.StretchCosts`.

Free of torch: `python -m report` reads `expected_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from foundation.pass_cost import PassCost
from speculative.lookup_gate import LookupYield, LookupYields
from speculative.pass_costs import PassCostFit, blend, pass_x, slope_prior
from speculative.stretch_costs import StretchCosts, StretchEstimates

if TYPE_CHECKING:
    from foundation.load import StepLoad
from speculative.stats import RoundStats

PRIOR_TRIALS = 2.0  # the weight of a's prior, and of each a_i's, in draft tokens
HOPE = 1.0  # accepted draft tokens added to the evidence when deciding
# A tree's branch nodes yield this many accepted tokens each before measured, weighing as
# many nodes: where a node costs the pass less (policy.branch_reach), trees are tried, and
# tried again once what they measured has aged.
BRANCH_PRIOR_YIELD, BRANCH_PRIOR_NODES = 0.1, 4.0


def expected_tokens(acceptance: float, k: int) -> float:
    """E[tokens per round] for k draft tokens accepted each with probability
    `acceptance` until the first rejection, plus the target's own token (Leviathan et
    al. 2023, eq. 1: (1 - a^(k+1)) / (1 - a))."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def round_speedup(
    tokens: float, k: int, draft_cost: float, one_pass_cost: float, verify_cost: float
) -> float:
    """Speedup over target-only of rounds that yield `tokens` each (the target's own
    included) for k draft steps of draft_cost and one target pass of verify_cost (its
    width k + 1), where target-only pays one_pass_cost a token; any one unit of time.
    No overhead: the bound a scheduling of rounds cannot beat (Leviathan et al. 2023)."""
    return tokens * one_pass_cost / (k * draft_cost + verify_cost)


def leviathan_speedup(
    acceptance: float, k: int, draft_cost: float, one_pass_cost: float, verify_cost: float
) -> float:
    """round_speedup at i.i.d. acceptance `acceptance` (Leviathan et al. 2023, eq. 1)."""
    return round_speedup(expected_tokens(acceptance, k), k, draft_cost, one_pass_cost, verify_cost)


@dataclass(frozen=True)
class MeasuredCosts:
    """Costs measured between one drafter and one target, in nanoseconds: what one call
    hands the next (a call over a slow link can decide before its first round trip)."""

    one_token_ns: float  # c(1)
    per_token_ns: float | None  # g (None = not measured)
    overhead_ns: float  # R
    solo_token_ns: float | None  # s (None = not measured)
    stream_start_ns: float | None  # o
    draft_token_ns: float  # d
    acceptance: float | None = None  # a, the next call's prior (as light as the default)
    one_token_measured: bool = False  # c(1) from one-token passes, not extrapolated
    # The target's load as last seen (B, and its step cost; all 0: not reported): a
    # call's first decision then already knows whether drafts pay on that worker.
    batch_sessions: float = 1.0
    step_cost: PassCost = PassCost()
    stretches_measure: bool = False  # the drafter's acceptance is measured during stretches
    # a_i by draft depth: how a pair's runs of agreement go on (a copy runs on, a model's
    # guesses thin out) holds from call to call; the next call's prior, as light as a's.
    depth_acceptance: tuple[float, ...] = ()


@dataclass(frozen=True)
class Estimates:
    """A call's costs (nanoseconds) and rates at one moment."""

    max_k: int
    acceptance: float  # a, hopeful
    draft_token_ns: float  # d
    one_token_ns: float  # c(1); 0 = nothing measured yet
    per_token_ns: float  # g
    overhead_ns: float  # R
    one_token_measured: bool  # c(1) from one-token passes (else extrapolated from wider ones)
    worker_k: int  # the k that makes best use of the loaded target (0: none)
    stretch: StretchEstimates  # what stretches measured (s, o, f) and the call's recent actions
    overlaps: bool = False  # the target verifies while the draft drafts (it may draft ahead)
    # [max_k] a_i, hopeful, for draft tokens 1..max_k; empty: `acceptance` at every depth.
    depth_acceptance: tuple[float, ...] = ()
    max_width: int = 1  # the most continuations a round may propose as a token tree
    branch_yield: float = 0.0  # accepted tokens per tree node off the first path
    step_costs: tuple[float, ...] = ()  # [w - 1] what the target timed a pass of w tokens to cost
    # A cascade's prompt lookup, by n-gram size (lookup_gate.py); empty: no cascade.
    lookup_yields: tuple[LookupYield, ...] = ()

    @property
    def measured(self) -> bool:
        return self.one_token_ns > 0

    def reach(self, depth: int) -> float:
        """The chance that the first `depth` draft tokens are all accepted."""
        return depth_reach(self.depth_acceptance, self.acceptance, depth)

    def expected_tokens(self, k: int) -> float:
        """E[tokens] of a round of k draft tokens, the target's own included."""
        return depth_expected_tokens(self.depth_acceptance, self.acceptance, k)

    def compute_ns(self, width: int) -> float:
        """c(width): the target's pass over `width` tokens."""
        return self.one_token_ns + self.per_token_ns * pass_x(self.step_costs, width)

    def widening_ns(self, k: int) -> float:
        """What each of k draft tokens adds to a round's pass, on average: g, or less
        where the target runs narrow passes as wider ones anyway."""
        return (self.compute_ns(k + 1) - self.compute_ns(1)) / k if k else self.per_token_ns

    def round_ns(self, k: int) -> float:
        """A round that drafts k tokens (k = 0: the drafter proposed nothing); where the
        target overlaps, with its successor drafted while it is verified if that saves."""
        if self.overlaps and k > 0:
            return self.sync_round_ns(k) - max(0.0, self.ahead_saving_ns(k))
        return self.sync_round_ns(k)

    def sync_round_ns(self, k: int) -> float:
        """A round that drafts k tokens, then waits for their verdict."""
        return k * self.draft_token_ns + self.compute_ns(k + 1) + self.overhead_ns

    def ahead_saving_ns(self, k: int) -> float:
        """What drafting a round's successor while it is verified saves a round, on
        average: with p = reach(k + 1) (all accepted, the draft's guess of the target's
        token right) rounds go at the slower side's pace, max(c(k + 1), (k + 1) d); else
        the successor is drafted again, up to d late where drafting outlasts c(k + 1) + R."""
        survives = self.reach(k + 1)
        ahead_ns = (k + 1) * self.draft_token_ns
        saved = self.sync_round_ns(k) - max(self.compute_ns(k + 1), ahead_ns)
        wasted = min(
            self.draft_token_ns, max(0.0, ahead_ns - self.compute_ns(k + 1) - self.overhead_ns)
        )
        return survives * saved - (1.0 - survives) * wasted

    def tokens_per_ns(self, k: int) -> float:
        """Expected output tokens per nanosecond of rounds drafting k tokens."""
        return self.expected_tokens(k) / self.round_ns(k)

    def best_k(self) -> int:
        """The fastest k in 1..max_k, at most worker_k (when that is above 0); the
        smaller k on a tie. Before any measurement: relative costs (c = 1 + slope prior x)."""
        largest = max(1, min(self.max_k, self.worker_k))
        if not self.measured:
            slope = slope_prior(self.step_costs)
            return max(
                range(1, largest + 1),
                key=lambda k: (
                    self.expected_tokens(k) / (1 + slope * pass_x(self.step_costs, k + 1)),
                    -k,
                ),
            )
        return max(range(1, largest + 1), key=lambda k: (self.tokens_per_ns(k), -k))


class AcceptanceCounts:
    """Decayed Bernoulli counts behind a and a_i: draft tokens until the first rejection,
    the accepted ones and the rejected one if any; a's prior is 0.5 over PRIOR_TRIALS."""

    def __init__(self, max_k: int, decay: float):
        self.decay = decay
        self.accepted, self.trials = 0.5 * PRIOR_TRIALS, PRIOR_TRIALS  # behind a
        # [max_k] (accepted, reached) behind a_i, per draft token depth
        self.depth_counts = [[0.0, 0.0] for _ in range(max_k)]

    def rate(self, hope: float = 0.0) -> float:
        """a, read with `hope` more accepted tokens (decisions read it hopeful)."""
        return (self.accepted + hope) / (self.trials + hope)

    def depth_rates(self, hope: float = 0.0) -> tuple[float, ...]:
        """a_i for depths 1..max_k, each with the one before as its prior (a before the
        first), as light as a's: a depth few rounds reach reads near the one above it, not
        its few draws, and one never reached as the deepest reached. `hope` more accepted
        tokens are read in a and the first depth only: at every depth it would compound with k."""
        rates, rate = [], self.rate(hope)
        for accepted, reached in self.depth_counts:
            rate = (accepted + hope + PRIOR_TRIALS * rate) / (reached + hope + PRIOR_TRIALS)
            rates.append(rate)
            hope = 0.0
        return tuple(rates)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        rejected = num_accepted < num_drafted
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + num_accepted + rejected
        for depth, counts in enumerate(self.depth_counts):  # depth 0: the first draft token
            counts[0] = self.decay * counts[0] + (depth < num_accepted)
            counts[1] = self.decay * counts[1] + (depth <= num_accepted and depth < num_drafted)

    def seed(self, acceptance: float | None, depth_acceptance: tuple[float, ...]) -> None:
        """An earlier call's rates, as priors as light as the default one."""
        if acceptance is not None:
            self.accepted, self.trials = PRIOR_TRIALS * acceptance, PRIOR_TRIALS
        for counts, rate in zip(self.depth_counts, depth_acceptance):
            counts[:] = [PRIOR_TRIALS * rate, PRIOR_TRIALS]


class CostEstimator:
    """The estimators behind Estimates, fed by the speculation loop's observations."""

    def __init__(
        self,
        max_k: int,
        decay: float = 0.9,
        costs: MeasuredCosts | None = None,
        overlaps: bool = False,
        max_width: int = 1,
    ):
        self.max_k, self.decay, self.overlaps, self.max_width = max_k, decay, overlaps, max_width
        self.passes = PassCostFit(decay)  # c(w)
        self.acceptances = AcceptanceCounts(max_k, decay)  # a and a_i
        self.stretches = StretchCosts(decay, self.passes)  # s, o, f, recent actions
        self.lookup = LookupYields(decay)  # a cascade's prompt lookup, by n-gram size
        self.lookup_took_turns = False  # the model drafted only where lookup left it the turn
        self.branch_tokens = self.branch_nodes = 0.0  # decayed counts behind branch_yield
        self.draft_token_ns = self.overhead_ns = 0.0
        self.overhead_measured = False  # R by a round
        self.batch_sessions = 1.0  # B
        self.step_cost = PassCost()  # the target's step cost (all 0: unreported)
        if costs is not None:
            self.seed(costs)

    @property
    def measured(self) -> bool:
        """The target's passes were measured (rounds, a stretch's passes, or an earlier call)."""
        return self.passes.one_token_ns > 0

    def estimates(self) -> Estimates:
        passes, acceptances, hope = self.passes, self.acceptances, HOPE if self.measured else 0.0
        return Estimates(
            max_k=self.max_k,
            acceptance=acceptances.rate(hope),
            draft_token_ns=self.draft_token_ns,
            one_token_ns=passes.one_token_ns,
            per_token_ns=passes.slope,
            overhead_ns=self.overhead_ns,
            one_token_measured=passes.one_token_measured,
            worker_k=self.worker_k(),
            stretch=self.stretches.estimates(self.overhead_ns),
            overlaps=self.overlaps,
            depth_acceptance=acceptances.depth_rates(hope),
            max_width=self.max_width,
            branch_yield=self.branch_yield(),
            step_costs=passes.step_costs,
            lookup_yields=self.lookup.yields(),
        )

    def branch_yield(self) -> float:
        return (BRANCH_PRIOR_YIELD * BRANCH_PRIOR_NODES + self.branch_tokens) / (
            BRANCH_PRIOR_NODES + self.branch_nodes
        )

    def worker_k(self) -> int:
        """The k (0 = none) at which the target's B sessions, all drafting k, commit the
        most tokens a second: E[tokens] over a step of B (k + 1) tokens at the target's
        step cost, plus R for the steps a round misses. a is read with HOPE / B: a token explored on hope costs
        all B sessions. max_k while the target reports no cost."""
        if not self.step_cost.measured:
            return self.max_k
        sessions = max(self.batch_sessions, 1.0)
        acceptance = self.acceptances.rate(HOPE / sessions)
        depths = self.acceptances.depth_rates(HOPE / sessions)

        def rate(k: int) -> float:
            step_ns = self.step_cost.base_ns + self.step_cost.per_token_ns * sessions * (k + 1)
            return depth_expected_tokens(depths, acceptance, k) / (
                step_ns + (self.overhead_ns if k else 0.0)
            )

        return max(range(self.max_k + 1), key=lambda k: (rate(k), -k))

    # Seeding from, and handing on, what earlier calls measured.

    def seed(self, costs: MeasuredCosts) -> None:
        if costs.one_token_ns:
            self.passes.seed(costs.one_token_ns, costs.per_token_ns)
            self.passes.one_token_measured = costs.one_token_measured
            self.overhead_ns = costs.overhead_ns
            self.draft_token_ns = costs.draft_token_ns
            self.overhead_measured = True
            self.stretches.solo_token_ns = costs.solo_token_ns
            self.stretches.start_ns = costs.stream_start_ns
        self.acceptances.seed(costs.acceptance, costs.depth_acceptance)
        self.batch_sessions = costs.batch_sessions
        self.step_cost = costs.step_cost
        self.stretches.measure = costs.stretches_measure

    def costs(self) -> MeasuredCosts:
        """What this call hands the next. A cascade whose lookup took turns hands on no
        acceptance: its model drafted only the positions lookup left (what this prompt did
        not copy), and a and a_i measured there would start a call that copies less, say
        new code, pessimistic, its deep a_i slow to climb back (the default prior instead)."""
        passes, stretches = self.passes, self.stretches
        selected = self.lookup_took_turns
        return MeasuredCosts(
            one_token_ns=passes.one_token_ns,
            per_token_ns=passes.per_token_ns,
            overhead_ns=self.overhead_ns,
            solo_token_ns=stretches.solo_token_ns,
            stream_start_ns=stretches.start_ns,
            draft_token_ns=self.draft_token_ns,
            acceptance=None if selected else self.acceptances.rate(),
            one_token_measured=passes.one_token_measured,
            batch_sessions=self.batch_sessions,
            step_cost=self.step_cost,
            stretches_measure=stretches.measure,
            depth_acceptance=() if selected else self.acceptances.depth_rates(),
        )

    # Observations.

    def observe(self, stats: RoundStats, elapsed_ns: int) -> None:
        """A finished round, elapsed_ns from its decision to its result passed on; or
        one token of a stretch (its pass only: the stretch is observed whole)."""
        self._observe_load(stats.step)
        if stats.streamed:
            self.stretches.observe_pass(stats)
            return
        if stats.target_compute_ns > 0:  # else the logits were kept from the prefill
            self.passes.observe(stats.num_drafted + 1, stats.target_compute_ns)
            self.passes.one_token_measured |= stats.num_drafted == 0
        self.stretches.observe_round(elapsed_ns)
        # else its drafting fell in the round before: R is not in elapsed_ns
        if not stats.drafted_ahead:
            # a search that found nothing is overhead
            drafting_ns = stats.draft_ns if stats.num_drafted else 0
            overhead = max(0, elapsed_ns - drafting_ns - stats.target_compute_ns - stats.late_ns)
            self.overhead_ns = blend(
                self.overhead_ns if self.overhead_measured else None, overhead, self.decay
            )
        self.overhead_measured = True
        # aged by every round
        self.branch_tokens = self.decay * self.branch_tokens + stats.branch_tokens
        self.branch_nodes = self.decay * self.branch_nodes + stats.branch_nodes
        if stats.lookup is not None:
            self.lookup.observe(stats.lookup)
        if stats.lookup_turn:  # a and d are the model's: lookup is measured apart
            self.lookup_took_turns = True
            return
        if stats.num_drafted:  # a tree's first path: what a chain would have proposed
            self.acceptances.observe(
                stats.num_drafted - stats.branch_nodes, stats.num_accepted - stats.branch_tokens
            )
            drafting_passes = stats.num_drafted - stats.branch_nodes - stats.draft_warm
            if drafting_passes:
                self.draft_token_ns = blend(
                    self.draft_token_ns or None, stats.draft_ns / drafting_passes, self.decay
                )

    def observe_shadow(self, num_drafted: int, num_accepted: int) -> None:
        """During a stretch: the drafter would have proposed num_drafted tokens (0:
        nothing) of which the target's next num_accepted came (a round not run)."""
        self.stretches.measure = True
        self.stretches.observe_turn(proposed=num_drafted > 0)
        if num_drafted:
            self.acceptances.observe(num_drafted, num_accepted)

    def _observe_load(self, step: StepLoad | None) -> None:
        if step is None or not step.batch_sessions:
            return
        self.batch_sessions = blend(self.batch_sessions, step.batch_sessions, self.decay)
        # already averaged over the target's recent steps
        if step.cost.measured:
            self.step_cost = step.cost


def depth_reach(depth_acceptance: tuple[float, ...], acceptance: float, depth: int) -> float:
    """a_1 ... a_depth (`acceptance` past the tuple's end)."""
    return math.prod(
        depth_acceptance[i] if i < len(depth_acceptance) else acceptance for i in range(depth)
    )


def depth_expected_tokens(depth_acceptance: tuple[float, ...], acceptance: float, k: int) -> float:
    """1 + reach(1) + ... + reach(k): the accepted draft tokens and the target's own."""
    return 1.0 + sum(depth_reach(depth_acceptance, acceptance, i) for i in range(1, k + 1))
