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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module stays free of torch, for `python -m report`
    from speculative.stats import RoundStats, StepLoad


@dataclass(frozen=True)
class MeasuredCosts:
    """Costs an AdaptiveK measured between one drafter and one target, in nanoseconds."""

    one_token_ns: float  # the target's pass over one token, c(1)
    per_token_ns: float | None  # what each further token of a pass adds (None = not measured)
    overhead_ns: float  # the rest of a round (R)
    solo_token_ns: float | None  # per token of a stretch decoded alone (None = not measured)
    stream_start_ns: float | None  # starting a stretch, besides its tokens
    draft_token_ns: float  # per draft token
    # Per-token acceptance with this pair: the next call's prior (as light as the default
    # 0.5: the text decides it), so one unlucky first round does not stop speculation.
    acceptance: float | None = None
    one_token_measured: bool = False  # c(1) from one-token passes, not extrapolated


class SpeculationPolicy(abc.ABC):
    max_k: int  # the largest k this policy will ever ask for

    @abc.abstractmethod
    def next_k(self) -> int:
        """Draft tokens for the next round."""

    def solo_tokens(self, remaining: int | None = None) -> int:
        """Tokens the target should decode alone before the next round (0 = draft now),
        of the `remaining` tokens this call may still generate (None: not known)."""
        return 0

    def tokens_instead_of_empty_round(self, remaining: int | None = None, ends_at_match: bool = False) -> int:
        """The drafter proposed nothing: tokens for the target to decode alone instead of
        a round trip for one plain step (0 = take the round), of the `remaining` tokens
        this call may still generate (None: not known). ends_at_match: the stretch will
        end by itself after the first token at which the drafter would propose again
        (a prompt-lookup drafter: LookupStop)."""
        return 0

    def observe(self, round_stats: RoundStats, elapsed_ns: int) -> None:
        """Learns from a finished round (or a token the target decoded alone) that took
        elapsed_ns from the policy's decision to its result having been passed on."""

    def observe_stretch(self, num_tokens: int, elapsed_ns: int, token_ns: int, empty_turns: int = 0) -> None:
        """Learns from a whole stretch the target decoded alone (see AdaptiveK); in
        empty_turns of its tokens the drafter would have proposed nothing."""


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

    - a: per-token acceptance (prior 0.5), from the rounds that drafted, decided on
      with HOPE more accepted tokens (`hopeful_acceptance`);
    - d: drafting time per draft token;
    - c(w) = c(1) + g * (w - 1): the target's compute for a pass over w tokens, as the
      target reports it, one line fitted to every pass whatever its width (slope prior:
      10% of c(1); 0 <= g <= c(1)), each sample clipped to SLOW_PASS_CLIP times the line, so
      one slow pass (a cold start, a neighbour's burst) cannot make a width look too
      costly to ever be tried again;
    - R: the rest of a round: its elapsed time less drafting and the target's compute
      (network, serialization, queueing, applying the verdict, passing tokens on);
    - s: time per token when the target decodes alone, the time between a stretch's
      tokens (c(1) until a stretch is measured); starting a stretch costs o_0 once
      (the stream's first token, the draft catching up on the stretch; across the
      services also the caller's stream and a new call), measured from whole stretches
      (`observe_stretch`) in process and across the services alike. s ages with the
      rounds since its last stretch, and is measured again while rounds win once that
      risks little (`_remeasure_solo`).

    Tokens per second of a round drafting k tokens (Leviathan et al. 2023, with a
    per-round delay R as in `python -m report`):

        E[tokens](a, k) / (k * d + c(k + 1) + R)

    against 1 / s for decoding alone. When decoding alone wins, the target decodes a
    stretch of tokens, then one round re-measures (a probe). The first stretch is
    `first_solo` tokens, or longer when starting one costs more, so that o_0 is at
    most `probe_share` of the stretch; each probe that still loses doubles it, up to
    `max_solo`. A stretch after which fewer tokens would remain than it has runs to the
    end of the call: no probe is worth it there. Before decoding alone is ruled out, one
    stretch measures it, unless a one-token pass already did (`_explore`).

    A drafter may also propose nothing (the n-gram drafter, outside text it can copy):
    such a round is one plain step that still pays R. Whether that is worth it depends
    on f, the share of the drafter's turns that propose at all: with its proposals, a
    round yields on average

        (f * E[tokens](a, k) + (1 - f)) / (f * (k * d + c(k + 1) + R) + (1 - f) * (c(1) + R))

    tokens per ns. When that still beats 1 / s, the empty round is taken (the next
    turn may find text to copy); else the target decodes a short stretch and the
    drafter is asked again (`tokens_instead_of_empty_round`). Where the drafter proposes
    only what prompt lookup finds, the stretch can end by itself at the first token after
    which lookup finds text to copy, so no turn comes back empty and one start pays for
    the whole gap: it is taken when s + o_0 / gap beats an empty round's c(1) + R per
    token, the gap being the 1 / f tokens expected until the drafter proposes again.

    `costs` seeds the cost averages with what earlier calls between the same draft and
    target measured, so a call over a slow link can decide before its first round trip,
    and the acceptance's prior with theirs (as light as the default: the text decides).

    Under load (the target batches B sessions per step and reports its step cost
    base + per_token * T for T tokens), k is also capped at `worker_k`: the k that
    maximises this session's output per unit of the worker's time, E[tokens](a, k) /
    (base / B + per_token * (k + 1)): the step's base cost is shared by the B sessions,
    each draft token costs the whole batch per_token. Alone (B = 1) the cap is loose;
    as B grows, draft tokens that are likely rejected stop paying, and at 0 the target
    decodes alone (plain decode steps inside the batch), so speculation never makes
    the worker slower than the same load without it.
    """

    def __init__(self, max_k: int, decay: float = 0.9, first_solo: int = 8, max_solo: int = 128,
                 probe_share: float = 0.05, costs: MeasuredCosts | None = None):
        self.max_k = max_k
        self.decay = decay  # weight of the past in every running average
        self.first_solo, self.max_solo, self.probe_share = first_solo, max_solo, probe_share
        self.accepted = 0.5 * PRIOR_TRIALS  # decayed counts of the Bernoulli trials behind a:
        self.trials = PRIOR_TRIALS  # a prior acceptance of 0.5
        self.proposals = 1.0  # decayed counts of the drafter's turns behind f:
        self.turns = 2.0  # a prior proposal rate of 0.5
        self.draft_token_ns = 0.0
        self.one_token_ns = 0.0  # c(1); 0 = not measured
        self.per_token_ns: float | None = None  # g
        self._sums = [0.0] * 5  # decayed n, sum x, sum x^2, sum c, sum x c over passes (x = w - 1)
        self.overhead_ns = 0.0  # R
        self.solo_token_ns: float | None = None  # s as stretches measured it
        self.rounds_since_solo = 0  # rounds since a stretch last measured s (s ages by each)
        self.rounds_since_solo_ns = 0.0  # and their time (what re-measuring s may risk a share of)
        self.stream_start_ns: float | None = None  # o_0: starting a stretch, besides its tokens
        self.measured = False  # a round has been measured
        self.one_token_measured = False  # c(1) from a one-token pass (else extrapolated)
        self.next_solo = first_solo
        self.next_empty_solo = first_solo  # after an empty turn; doubles while turns stay empty
        self.probe_due = False  # the round after a solo stretch re-measures
        self.batch_sessions = 1.0  # B: decayed sessions per target step (1 = alone)
        self.step_base_ns = 0.0  # the target's step cost: base + per_token * T (0: unknown)
        self.step_token_ns = 0.0
        if costs is not None:
            self.seed(costs)

    def seed(self, costs: MeasuredCosts) -> None:
        """Starts from costs measured before (before this policy's first round)."""
        if costs.one_token_ns:
            self.one_token_ns, self.per_token_ns = costs.one_token_ns, costs.per_token_ns
            for x in (0, 4):  # the line as two pseudo-passes, outweighed by the first real ones
                self._add_sample(x, self.compute_ns(x + 1), 1.0)
            self.overhead_ns, self.solo_token_ns = costs.overhead_ns, costs.solo_token_ns
            self.stream_start_ns = costs.stream_start_ns
            self.draft_token_ns, self.measured = costs.draft_token_ns, True
            self.one_token_measured = costs.one_token_measured
        if costs.acceptance is not None:
            self.accepted, self.trials = PRIOR_TRIALS * costs.acceptance, PRIOR_TRIALS

    def costs(self) -> MeasuredCosts:
        """What this policy measured of the costs, to seed the next call's."""
        return MeasuredCosts(self.one_token_ns, self.per_token_ns, self.overhead_ns, self.solo_token_ns,
                             self.stream_start_ns, self.draft_token_ns, self.acceptance(), self.one_token_measured)

    def acceptance(self) -> float:
        return self.accepted / self.trials

    def hopeful_acceptance(self) -> float:
        """The acceptance decisions use: the estimate with HOPE more accepted token,
        which weighs while there is little evidence (the decayed counts hold about ten
        rounds' trials). One rejected first round (an answer's first token is often the
        draft's worst guess) must not stop speculation, and k must not creep up one
        token per round while every draft is accepted; a drafter that is always wrong
        still reads 1 / 11 at k = 1."""
        return (self.accepted + HOPE) / (self.trials + HOPE)

    def proposal_rate(self) -> float:
        """f: the share of the drafter's turns that proposed something."""
        return self.proposals / self.turns

    def next_k(self) -> int:
        largest = max(1, min(self.max_k, self.worker_k()))
        return max(range(1, largest + 1), key=lambda k: (self.tokens_per_ns(k), -k))

    def worker_k(self) -> int:
        """The k (0 = none) that maximises this session's tokens per unit of the target
        worker's time, from the step cost the target reports and the sessions sharing
        its steps; max_k while the target reports no cost."""
        if not self.step_base_ns and not self.step_token_ns:
            return self.max_k
        shared_ns = self.step_base_ns / max(self.batch_sessions, 1.0)
        acceptance = self.hopeful_acceptance()
        return max(range(self.max_k + 1),
                   key=lambda k: (expected_tokens(acceptance, k) / (shared_ns + self.step_token_ns * (k + 1)), -k))

    def solo_tokens(self, remaining: int | None = None) -> int:
        if not self.measured or self.probe_due:
            self.probe_due = False
            return 0
        k = self.next_k()
        solo_ns = self.solo_cost_ns()
        lead = self.tokens_per_ns(k) * solo_ns  # speculation's speed over decoding alone
        if self.worker_k() == 0:  # drafting costs the loaded worker more than it yields
            lead = 0.0
        if lead >= 1.0 and self.one_token_measured:
            self.next_solo = self.first_solo
            return 0
        if lead >= 1.0:
            return self._explore(remaining, solo_ns)
        stretch = self._stretch(self.next_solo, solo_ns)
        self.next_solo = min(2 * self.next_solo, self.max_solo)
        self.probe_due = True
        # Should the probe after it lose, the next stretch (twice this one) would reach
        # the end anyway, so the probe pays only if it wins: not worth it.
        return remaining if _too_little_after(remaining, stretch, stretch) else stretch

    def tokens_instead_of_empty_round(self, remaining: int | None = None, ends_at_match: bool = False) -> int:
        """The drafter proposed nothing, so a round would pay R for one plain step. It
        is taken while rounds, empty ones included at the measured rate f, still beat
        decoding alone (text to copy may turn up at the next turn); else the target
        decodes a stretch, after which the drafter is asked again: at least first_solo
        tokens, twice the last one's after each further empty turn (at most
        MAX_EMPTY_STRETCH_FACTOR * first_solo: copies must not be missed for long), and as
        many as make starting it at most probe_share of the stretch. When less than
        first_solo tokens would remain after it, it runs to the end of the call: asking
        the drafter again there costs a stretch's start for too few tokens to win it
        back (SmolLM2 at 20 ms: a 32-token stretch left one token, which a round trip
        to the target then cost twice over). A stretch that ends by itself where the
        drafter would propose again (ends_at_match) needs none of this sizing:
        `_stretch_to_match` decides."""
        self._count_turn(proposed=False)
        if not self.measured:
            return 0
        solo_ns = self.solo_cost_ns()
        if ends_at_match:
            return self._stretch_to_match(remaining, solo_ns)
        rounds_ns = 1.0 / self.mixed_tokens_per_ns(self.next_k())  # per token, empty rounds included
        if rounds_ns <= solo_ns:
            return self._remeasure_solo(remaining, solo_ns, rounds_ns)
        stretch = self._stretch(self.next_empty_solo, solo_ns)
        self.next_empty_solo = min(2 * self.next_empty_solo, MAX_EMPTY_STRETCH_FACTOR * self.first_solo)
        return remaining if _too_little_after(remaining, stretch, self.first_solo) else stretch

    def _stretch_to_match(self, remaining: int | None, solo_ns: float) -> int:
        """A stretch that ends where the drafter proposes again (or with the call),
        when its start, spread over the expected gap of 1 / f tokens, costs less than
        the round trip each empty round would pay (SmolLM2 at 20 ms: 105 ms an empty
        round against 57 ms a token decoding alone; copies on a summary came every 3
        tokens or so, on a chat answer twice in 64). Else the empty round (and, where
        it is cheaper than a token decoded alone, s re-measured now and then)."""
        empty_round_ns = self._drafting_round_ns(0)
        gap = 1.0 / self.proposal_rate()
        if remaining is not None:
            gap = min(gap, remaining)
        if solo_ns + self._start_ns() / gap < empty_round_ns:
            return remaining if remaining is not None else self.max_solo
        if empty_round_ns <= solo_ns:  # rounds win even per token: s may be stale
            return self._remeasure_solo(remaining, solo_ns, empty_round_ns)
        return 0

    def _remeasure_solo(self, remaining: int | None, solo_ns: float, rounds_ns: float) -> int:
        """Rounds win, so the empty round is taken (0), and s, which only stretches
        measure, would never be measured again: one stretch that came out slow (a burst
        of load on this shared machine: SmolLM2 at 57 ms a token against 46) kept a whole
        benchmark phase on empty rounds that cost more. So a first_solo stretch
        re-measures s once the rounds since the last one took long enough that what it
        may lose (its start, and its tokens at s where rounds are faster) is at most
        probe_share of their time. Not where it would end the call; not while no stretch
        has measured s (it is then c(1), which the rounds keep measuring)."""
        if self.solo_token_ns is None:
            return 0
        stretch = self._stretch(self.first_solo, solo_ns)
        risk_ns = self._start_ns() + stretch * (solo_ns - rounds_ns)
        if risk_ns > self.probe_share * self.rounds_since_solo_ns or _too_little_after(remaining, stretch, stretch):
            return 0
        return stretch

    def _explore(self, remaining: int | None, solo_ns: float) -> int:
        """A first stretch, while no one-token pass was measured: c(1) is extrapolated
        from wider passes until then, by the slope's prior where their widths say little,
        and speculation's lead read from it may not be real (Qwen2.5-Coder 1.5B in bf16:
        c(1) read 265-285 ms, 213 ms decoding alone). Measured once, it carries to later
        calls. Not where the call could not speculate after it."""
        stretch = self._stretch(self.first_solo, solo_ns)
        if _too_little_after(remaining, stretch, stretch):
            return 0
        self.probe_due = True
        return stretch

    def _stretch(self, shortest: int, solo_ns: float) -> int:
        """A stretch of at least `shortest` tokens, and long enough that starting it is
        at most probe_share of its time; at most max_solo."""
        return min(max(shortest, _ceil(self._start_ns() / (self.probe_share * solo_ns))), self.max_solo)

    def tokens_per_ns(self, k: int) -> float:
        """Expected output tokens per nanosecond of a round that drafts k tokens."""
        if not self.one_token_ns:  # nothing measured: relative costs, R = 0, d = 0
            return expected_tokens(self.acceptance(), k) / (1.0 + 0.1 * k)
        return expected_tokens(self.hopeful_acceptance(), k) / self._drafting_round_ns(k)

    def mixed_tokens_per_ns(self, k: int) -> float:
        """Expected output tokens per nanosecond of rounds that draft k tokens when the
        drafter proposes (share f of its turns) and are one plain step when it does not."""
        f = self.proposal_rate()
        tokens = f * expected_tokens(self.hopeful_acceptance(), k) + (1.0 - f)
        return tokens / (f * self._drafting_round_ns(k) + (1.0 - f) * self._drafting_round_ns(0))

    def _drafting_round_ns(self, k: int) -> float:
        """A round that drafts k tokens (k = 0: the drafter proposed nothing)."""
        return k * self.draft_token_ns + self.compute_ns(k + 1) + self.overhead_ns

    def compute_ns(self, width: int) -> float:
        """c(width): the target's pass over `width` tokens."""
        per_token = self.per_token_ns if self.per_token_ns is not None else 0.1 * self.one_token_ns
        return self.one_token_ns + per_token * (width - 1)

    def _start_ns(self) -> float:
        """What starting a stretch costs besides its tokens, and speculating again after
        it (prior: 2 R, the stream's round trip and the next round's)."""
        return self.stream_start_ns if self.stream_start_ns is not None else 2 * self.overhead_ns

    def solo_cost_ns(self) -> float:
        """s: time per token decoding alone, as stretches measured it (c(1) before any).
        Not bounded by the line's c(1): it is extrapolated from wider passes, and one
        noisy wide pass can move it by a third (Qwen2.5-Coder 1.5B: 143 ms against the
        285 ms its stretches took), which made speculation at 1.2x look like a loss."""
        return self.solo_token_ns if self.solo_token_ns is not None else self.one_token_ns

    def observe(self, round_stats: RoundStats, elapsed_ns: int) -> None:
        self._observe_load(round_stats.step)
        if round_stats.streamed:  # the stretch as a whole is observed by observe_stretch
            self._observe_compute(1, round_stats.target_compute_ns, SOLO_TOKEN_WEIGHT, age=False)
            self.one_token_measured = True
            return
        self._observe_compute(round_stats.num_drafted + 1, round_stats.target_compute_ns)
        self.rounds_since_solo += 1
        self.rounds_since_solo_ns += elapsed_ns
        self.one_token_measured |= round_stats.num_drafted == 0
        drafting_ns = round_stats.draft_ns if round_stats.num_drafted else 0  # a search that found nothing is overhead
        overhead = max(0, elapsed_ns - drafting_ns - round_stats.target_compute_ns)
        self.overhead_ns = _blend(self.overhead_ns if self.measured else overhead, overhead, self.decay)
        self.measured = True
        if round_stats.num_drafted > 0:
            self._count_turn(proposed=True)
            self.next_empty_solo = self.first_solo
            rejected = round_stats.num_accepted < round_stats.num_drafted
            self.accepted = self.decay * self.accepted + round_stats.num_accepted
            self.trials = self.decay * self.trials + round_stats.num_accepted + rejected
            per_token = round_stats.draft_ns / round_stats.num_drafted
            self.draft_token_ns = _blend(self.draft_token_ns or per_token, per_token, self.decay)

    def observe_stretch(self, num_tokens: int, elapsed_ns: int, token_ns: int, empty_turns: int = 0) -> None:
        """Learns from a whole stretch of target-only decoding: elapsed_ns from deciding
        on it to being ready to draft again after its num_tokens, which came token_ns
        apart. Past the tokens themselves, that is what starting a stretch costs (the
        stream's first token, bringing the draft up to date with what it did not see;
        across the services also the caller's stream and a new call), which sizes the
        next stretches. token_ns itself is s, and bounds c(1). A stretch that ended where
        the drafter would propose again saw empty_turns turns in which it would not
        have: they count towards f as empty rounds would have."""
        for _ in range(empty_turns):
            self._count_turn(proposed=False)
        if token_ns < self.one_token_ns:  # c(1) is at most a stretch's time per token
            self._observe_compute(1, token_ns, SOLO_TOKEN_WEIGHT * num_tokens, age=False)
        self.one_token_measured = True
        # s ages by the rounds since it was measured, as passes do by later passes.
        self.solo_token_ns = _blend(self.solo_token_ns, token_ns, self.decay ** (1 + self.rounds_since_solo))
        self.rounds_since_solo, self.rounds_since_solo_ns = 0, 0.0
        self.stream_start_ns = _blend(self.stream_start_ns, max(0.0, elapsed_ns - num_tokens * token_ns), self.decay)

    def _observe_load(self, step: StepLoad | None) -> None:
        """The target's batching, as its last step reported it."""
        if step is None or not step.batch_sessions:
            return
        self.batch_sessions = _blend(self.batch_sessions, step.batch_sessions, self.decay)
        if step.cost_base_ns or step.cost_per_token_ns:  # already averaged over its recent steps
            self.step_base_ns, self.step_token_ns = step.cost_base_ns, step.cost_per_token_ns

    def _count_turn(self, proposed: bool) -> None:
        self.proposals = self.decay * self.proposals + proposed
        self.turns = self.decay * self.turns + 1.0

    def _observe_compute(self, width: int, compute_ns: float, weight: float = 1.0, age: bool = True) -> None:
        """Refits c(w) = c(1) + g (w - 1) by decayed least squares over all passes, each
        sample clipped to SLOW_PASS_CLIP times what the line predicts (one slow pass moves it little, and
        every pass, whatever its width, corrects it)."""
        if self._sums[0]:
            predicted = self.compute_ns(width)
            compute_ns = min(compute_ns, SLOW_PASS_CLIP * predicted)  # a fast pass is real, a slow one may be a spike
        self._add_sample(width - 1, compute_ns, weight, age)
        n, sx, sxx, sc, sxc = self._sums
        mean_x, mean_c = sx / n, sc / n
        prior = 0.1 * mean_c / (1.0 + 0.1 * mean_x)  # g where one width tells nothing
        g = (sxc / n - mean_x * mean_c + _SLOPE_PRIOR_WEIGHT * prior) / (sxx / n - mean_x**2 + _SLOPE_PRIOR_WEIGHT)
        g = min(max(g, 0.0), mean_c / (1.0 + mean_x))  # 0 <= g <= c(1)
        self.one_token_ns, self.per_token_ns = mean_c - g * mean_x, g

    def _add_sample(self, x: float, compute_ns: float, weight: float, age: bool = True) -> None:
        decayed = [self.decay * total if age else total for total in self._sums]
        self._sums = [decayed[0] + weight, decayed[1] + weight * x, decayed[2] + weight * x * x,
                      decayed[3] + weight * compute_ns, decayed[4] + weight * x * compute_ns]


PRIOR_TRIALS = 2.0  # the weight of a's prior, in draft tokens
HOPE = 1.0  # accepted draft tokens added to the evidence when deciding (see hopeful_acceptance)
# A token decoded alone weighs this much of a pass in the fit of c(w), and does not age
# the passes: a long stretch must refine c(1), not erase what wider passes cost (64
# one-token samples left the slope to its prior, 20 ms where passes measured 130).
SOLO_TOKEN_WEIGHT = 0.1
# A pass slower than this many times the line counts as this slow: on a shared machine
# passes came 1.7-2.4x the line in bursts (Qwen2.5-Coder 1.5B, 497-788 ms against ~300),
# and at twice the line a burst at a call's end was carried into the next call's first
# decisions. A lasting slowdown is still learnt, by at most 2.5% a pass.
SLOW_PASS_CLIP = 1.25
_SLOPE_PRIOR_WEIGHT = 0.25  # of the prior slope against the widths' variance
# Stretches after empty turns grow to at most this many times first_solo (32 tokens):
# fewer restarts where nothing can be copied, while text to copy is found within 32 tokens.
MAX_EMPTY_STRETCH_FACTOR = 4


def _blend(old: float | None, new: float, decay: float) -> float:
    """The decayed average of old and new; new alone while nothing is measured (None)."""
    return new if old is None else decay * old + (1.0 - decay) * new


def _too_little_after(remaining: int | None, stretch: int, least: int) -> bool:
    """Whether fewer than `least` of the `remaining` tokens would be left after the
    stretch: too few to bring the draft up to date for and speculate on (None: the
    call's length is not known)."""
    return remaining is not None and remaining - stretch < least


def _ceil(x: float) -> int:
    """ceil, blind to float noise (a ratio that is 20 on paper must not become 21)."""
    return math.ceil(round(x, 6))
