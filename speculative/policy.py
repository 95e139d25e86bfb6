"""What a speculating call does next: a round drafting k tokens, or, where decoding alone
wins, a stretch (`speculative.stretch_policy`).

A fixed k is the textbook setting (`FixedK`). `AdaptiveK` is `decide`, a pure function
of the estimates its cost estimator keeps (speculative.estimator): k is the fastest by a
round's expected tokens over its cost, E[tokens](a, k) / (k d + c(k + 1) + R)
(`Estimates.best_k`); where the target verifies while the draft drafts, a round may cost
less (its successor drafted ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

from speculative.estimator import CostEstimator, Estimates, MeasuredCosts
from speculative.lookup_gate import refused_sizes
from speculative.stats import RoundStats
from speculative.stretch_policy import StretchRules, Turn, hand_off


@dataclass(frozen=True)
class Action:
    k: int = 0  # draft k tokens for a round (0: a plain target step)
    stretch: int = 0  # > 0: instead, the target decodes up to this many tokens alone
    ahead: bool = (
        False  # draft the next proposal while this one is verified (where the target overlaps)
    )
    lookup_k: int = (
        0  # in a stretch: looked-up tokens the target verifies a pass, at most (0: none)
    )
    width: int = 1  # continuations a round may propose at once, as a token tree (1: a chain)
    # A model drafter stops drafting once its own chance that the target accepts every
    # token so far falls below this (DraftSession.propose): see `stop_reach`.
    min_reach: float = 0.0
    # In a tree, a model drafter's branch must have at least this chance of being the
    # target's token (DraftSession.propose_tree): see `branch_reach`.
    min_branch: float = 0.0
    # A cascade's prompt lookup leaves the turn to the model where it matched at one of
    # these n-gram sizes (speculative.lookup_gate).
    refused_lookup: frozenset[int] = frozenset()
    # Where it takes the turn, a cascade's lookup proposes up to this many tokens (0: k):
    # its tokens cost no drafting, and k is priced by the model's acceptance.
    lookup_tokens: int = 0


TAKE_ROUND = Action()  # the plain step: one target pass, nothing drafted


def decide(
    e: Estimates,
    remaining: int | None,
    turn: Turn = Turn.DRAFT,
    rules: StretchRules | None = StretchRules(),
) -> Action:
    """The next action of a call that may still generate `remaining` tokens (None: not
    known): a stretch where decoding alone wins (`stretch_policy.hand_off`), else a round
    of the fastest k, its tree width, stop and drafting ahead priced by the cost model.
    rules=None: no stretches; the plain step where it beats every k."""
    k = e.best_k()  # once: the stretch decision weighs rounds of this k too
    stretch = hand_off(e, k, remaining, turn, rules) if rules is not None else None
    if stretch is not None:
        return Action(stretch=stretch.tokens, lookup_k=stretch.lookup_k)
    if turn is not Turn.DRAFT:  # the drafter proposed nothing: the plain step
        return TAKE_ROUND
    if not e.measured:  # the priors' k
        return Action(k=k, ahead=True)
    if rules is None and (e.worker_k == 0 or e.tokens_per_ns(k) < e.tokens_per_ns(0)):
        return TAKE_ROUND
    return _round(e, k)


def _round(e: Estimates, k: int) -> Action:
    min_branch = branch_reach(e, k)
    width = e.max_width if e.branch_yield >= min_branch else 1
    return Action(
        k=k,
        ahead=draft_ahead(e, k),
        min_reach=stop_reach(e, k),
        width=width,
        min_branch=min_branch,
        refused_lookup=refused_sizes(e, k),
        lookup_tokens=e.max_k,
    )


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


class SpeculationPolicy:
    """The loop asks `next_action`, and tells the policy what each round and stretch
    measured (a fixed k is measured too: its costs are reported). The policy is the one
    owner of its estimator: callers start and end a call on it and hand on what it
    returns, never reading or setting what it measured."""

    def __init__(self, max_k: int, estimator: CostEstimator | None = None):
        self.max_k = max_k  # the largest k it will ask for
        self._estimator = estimator or CostEstimator(max_k)

    def next_action(
        self, remaining: int | None = None, turn: Turn = Turn.DRAFT, stretches: bool = True
    ) -> Action:
        """stretches: whether the loop can run a stretch (else only rounds are asked for)."""
        raise NotImplementedError

    # A call's start and end.

    def start_call(
        self, step_costs: tuple[float, ...] = (), earlier: MeasuredCosts | None = None
    ) -> None:
        """A call begins: its target prices its passes by `step_costs` (ms by width, as it
        timed them; empty: not told); `earlier`, what an earlier call between the same
        draft and target handed on, seeds a policy that has measured nothing yet."""
        if earlier is not None and not self._estimator.measured:
            self._estimator.seed(earlier)
        self._estimator.passes.step_costs = step_costs

    def end_call(self) -> MeasuredCosts | None:
        """What this call measured, for the next call between the same draft and target
        (None: nothing to hand on)."""
        return None

    @property
    def measured(self) -> bool:
        """The target's passes were measured (rounds, a stretch's passes, or an earlier call)."""
        return self._estimator.measured

    def estimates(self) -> Estimates:
        """What the policy decides on, now (read-only: reports, tests)."""
        return self._estimator.estimates()

    # Observations, from the loop and its stretches.

    def observe_round(self, stats: RoundStats, elapsed_ns: int) -> None:
        """A finished round (or one token of a stretch), elapsed_ns from its decision to
        its result passed on."""
        self._estimator.observe(stats, elapsed_ns)

    def observe_turn(self, proposed: bool) -> None:
        """The drafter's turn proposed something, or nothing."""
        self._estimator.stretches.observe_turn(proposed=proposed)

    def observe_shadow(self, num_drafted: int, num_accepted: int) -> None:
        """During a stretch, what a free drafter would have proposed and how much of it
        the target's tokens then matched (CostEstimator.observe_shadow)."""
        self._estimator.observe_shadow(num_drafted, num_accepted)

    def observe_stretch(
        self,
        num_tokens: int,
        elapsed_ns: int,
        token_ns: int,
        empty_turns: int = 0,
        passes_ns: int | None = None,
    ) -> None:
        """A finished stretch (StretchCosts.observe_stretch)."""
        self._estimator.stretches.observe_stretch(
            num_tokens, elapsed_ns, token_ns, empty_turns, passes_ns
        )

    def observe_solo_tokens(self, num_tokens: int, token_ns: int) -> None:
        """Tokens a stretch decoded alone when the call ended inside it."""
        self._estimator.stretches.observe_solo_tokens(num_tokens, token_ns)

    def lookup_runs_on_target(self) -> None:
        """In stretches, the target runs the drafter's prompt lookup itself."""
        self._estimator.stretches.target_runs_lookup = True


class FixedK(SpeculationPolicy):
    """k every round (a tree of up to `width` continuations where the drafter finds
    several), the next drafted ahead where the target overlaps; a turn that proposed
    nothing takes the plain step."""

    def __init__(self, k: int, width: int = 1):
        super().__init__(k)
        self.width = width

    def next_action(
        self, remaining: int | None = None, turn: Turn = Turn.DRAFT, stretches: bool = True
    ) -> Action:
        return (
            Action(k=self.max_k, ahead=True, width=self.width) if turn is Turn.DRAFT else TAKE_ROUND
        )


class AdaptiveK(SpeculationPolicy):
    """`decide` on this call's own estimates; `costs` seeds them with what earlier calls
    between the same draft and target measured. overlaps: the target verifies while the
    draft drafts (a remote target with pipelining on), so rounds are priced with
    drafting ahead. max_width: rounds may propose token trees of that many continuations
    where their branches pay (`branch_reach`)."""

    def __init__(
        self,
        max_k: int,
        decay: float = 0.9,
        rules: StretchRules = StretchRules(),
        costs: MeasuredCosts | None = None,
        overlaps: bool = False,
        max_width: int = 1,
    ):
        super().__init__(max_k, CostEstimator(max_k, decay, costs, overlaps, max_width))
        self.rules = rules

    def next_action(
        self, remaining: int | None = None, turn: Turn = Turn.DRAFT, stretches: bool = True
    ) -> Action:
        return decide(
            self._estimator.estimates(), remaining, turn, self.rules if stretches else None
        )

    def end_call(self) -> MeasuredCosts | None:
        return self._estimator.costs() if self._estimator.measured else None
