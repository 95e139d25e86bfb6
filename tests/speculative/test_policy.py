"""The policy: properties any correct `decide` satisfies (over random estimates), replays
of measured calls, and the speculation loop driven by policies (exactness never
depends on their choices)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from foundation.load import StepLoad
from speculative.drafter_base import DraftSession
from speculative.drafters import ModelDrafter
from speculative.estimator import Estimates, MeasuredCosts
from speculative.generator import LocalVerifier, SpeculativeGenerator
from speculative.pass_costs import SLOPE_PRIOR
from speculative.policy import (
    TAKE_ROUND,
    Action,
    AdaptiveK,
    FixedK,
    SpeculationPolicy,
    branch_reach,
    decide,
    draft_ahead,
    stop_reach,
)
from speculative.prompt_lookup import NgramDrafter
from speculative.sampling import SamplingParams
from speculative.speculation_loop import speculation_rounds
from speculative.stretch_costs import StretchEstimates
from speculative.stretch_policy import StretchRules, Turn
from speculative.target import TargetSession
from speculative.types import NextTokenKind, Verdict, VerifyResult
from tests.speculative.test_estimator import MS, round_, settled, streamed

# --- properties -------------------------------------------------------------------------


@st.composite
def estimates(draw, **fixed) -> Estimates:
    """Measured estimates anywhere a real call could be (times in ms scaled to ns)."""
    one_token_ms = draw(st.floats(1.0, 500.0))
    overhead_ms = draw(st.floats(0.0, 200.0))
    values = dict(
        max_k=draw(st.integers(1, 8)),
        acceptance=draw(st.floats(0.01, 0.99)),
        proposal_rate=draw(st.floats(0.01, 1.0)),
        draft_token_ns=draw(st.floats(0.0, 200.0)) * MS,
        one_token_ns=one_token_ms * MS,
        per_token_ns=draw(st.floats(0.0, 1.0)) * one_token_ms * MS,
        overhead_ns=overhead_ms * MS,
        solo_token_ns=draw(st.floats(0.5, 2.0)) * one_token_ms * MS,
        solo_measured=draw(st.booleans()),
        one_token_measured=True,
        start_ns=draw(st.floats(0.0, 4.0)) * (overhead_ms + one_token_ms) * MS,
        worker_k=8,
        measure=draw(st.booleans()),
        after_stretch=False,
        losing_in_a_row=draw(st.integers(0, 6)),
        empty_turns_in_a_row=draw(st.integers(1, 10)),
        rounds_since_ns=draw(st.floats(0.0, 1e4)) * MS,
        overlaps=draw(st.booleans()),
    )
    values.update(fixed)
    return flat_estimates(**values)


STRETCH_FIELDS = {field.name for field in dataclasses.fields(StretchEstimates)}


def flat_estimates(**values) -> Estimates:
    """Estimates from one set of fields, what stretches measured among them."""
    stretch = StretchEstimates(
        **{name: values.pop(name) for name in list(values) if name in STRETCH_FIELDS}
    )
    return Estimates(**values, stretch=stretch)


def with_stretch(e: Estimates, **changes) -> Estimates:
    return dataclasses.replace(e, stretch=dataclasses.replace(e.stretch, **changes))


remaining_tokens = st.one_of(st.none(), st.integers(1, 512))
turns = st.sampled_from(list(Turn))
PROPERTY = settings(max_examples=300, deadline=None)


def _is_round(action: Action) -> bool:
    return action.stretch == 0


def _k(action: Action) -> int:
    """The k of a round (-1 for a stretch)."""
    return action.k if _is_round(action) else -1


@PROPERTY
@given(estimates(), remaining_tokens, turns)
def test_a_stretch_never_passes_the_call_nor_the_longest(e, remaining, turn):
    action = decide(e, remaining, turn)
    assert action.stretch >= 0 and (action.stretch == 0 or action.k == 0)
    if action.stretch:
        assert remaining is None or action.stretch <= remaining
        assert action.stretch <= StretchRules().longest or action.stretch == remaining
    elif turn is Turn.DRAFT:
        assert 1 <= action.k <= e.max_k


@PROPERTY
@given(estimates(), st.floats(0.01, 0.99), st.floats(0.01, 0.99), remaining_tokens)
def test_higher_acceptance_never_lowers_k_nor_stops_speculation(e, lower, higher, remaining):
    lower, higher = sorted((lower, higher))
    worse, better = (dataclasses.replace(e, acceptance=a) for a in (lower, higher))
    assert worse.best_k() <= better.best_k()
    if _is_round(decide(worse, remaining)):
        assert _is_round(decide(better, remaining))


@PROPERTY
@given(estimates(), st.floats(0.0, 200.0), st.floats(0.0, 200.0), remaining_tokens, turns)
def test_a_slower_link_never_takes_more_rounds(e, faster_ms, slower_ms, remaining, turn):
    """Where a round is taken over the slower link, it is over the faster one too."""
    faster_ms, slower_ms = sorted((faster_ms, slower_ms))
    fast, slow = (dataclasses.replace(e, overhead_ns=ms * MS) for ms in (faster_ms, slower_ms))
    if _is_round(decide(slow, remaining, turn)):
        assert _is_round(decide(fast, remaining, turn))


@PROPERTY
@given(
    estimates(draft_token_ns=0.0),
    st.one_of(st.none(), st.integers(100, 512)),
    st.sampled_from([Turn.NOTHING_PROPOSED, Turn.NOTHING_UNTIL_MATCH]),
)
def test_a_free_drafter_with_nothing_to_propose_never_costs_a_round_trip_per_token(
    e, remaining, turn
):
    """It almost never proposes (f <= 2%), a round trip costs at least a pass and
    decoding alone at most one: every empty turn gives the target a stretch."""
    e = dataclasses.replace(e, overhead_ns=max(e.overhead_ns, e.one_token_ns))
    e = with_stretch(
        e,
        proposal_rate=min(e.stretch.proposal_rate, 0.02),
        solo_token_ns=min(e.stretch.solo_token_ns, e.one_token_ns),
        start_ns=min(e.stretch.start_ns, 20 * e.overhead_ns),
    )
    assert decide(e, remaining, turn).stretch > 0


@PROPERTY
@given(estimates(target_runs_lookup=True), remaining_tokens, turns)
def test_where_the_target_runs_lookup_no_round_costs_a_round_trip(e, remaining, turn):
    """A prompt-lookup drafter whose rounds the target runs inside stretches: every
    action is a stretch, whose passes verify at most max_k looked-up tokens, only
    where such rounds beat decoding alone (none on a worker with no room for drafts)."""
    action = decide(e, remaining, turn)
    assert action.stretch > 0 and action.k == 0 and 0 <= action.lookup_k <= e.max_k
    inside = dataclasses.replace(e, overhead_ns=0.0, draft_token_ns=0.0, overlaps=False)
    if action.lookup_k:
        assert e.worker_k > 0 and inside.tokens_per_ns(action.lookup_k) > inside.tokens_per_ns(0)


@PROPERTY
@given(
    estimates(target_runs_lookup=True),
    remaining_tokens,
    st.floats(0.01, 0.99),
    st.floats(0.01, 0.99),
)
def test_where_the_target_runs_lookup_higher_acceptance_never_lowers_its_k(
    e, remaining, lower, higher
):
    lower, higher = sorted((lower, higher))
    assert (
        decide(dataclasses.replace(e, acceptance=lower), remaining).lookup_k
        <= decide(dataclasses.replace(e, acceptance=higher), remaining).lookup_k
    )


def test_where_the_target_runs_lookup_stretches_double_and_k_follows_what_they_measured():
    """A call's first k rests on priors alone, so its first stretch is short; each
    stretch after it is twice as long, up to the longest, and k is chosen again with
    what the stretch's passes and shadow rounds measured (a copy that goes on: more)."""
    policy, rules = AdaptiveK(8), StretchRules()
    policy.lookup_runs_on_target()
    sizes, ks = [], []
    for _ in range(6):
        action = policy.next_action(remaining=None)
        sizes.append(action.stretch)
        ks.append(action.lookup_k)
        for _ in range(action.stretch // 8):  # what the stretch measured: copies of 8 that go on
            policy.observe_round(*streamed(60.0, looked_up=8, accepted=8))
            policy.observe_shadow(8, 8)
        policy.observe_stretch(action.stretch, action.stretch * 60 * MS, 60 * MS)
    assert sizes == [rules.first * 2**i for i in range(4)] + [rules.longest] * 2
    assert ks[0] < ks[1] <= ks[-1] == 8
    # stretches' passes alone: the worker hands them to the next call
    assert policy.measured


@PROPERTY
@given(estimates(target_runs_lookup=True, worker_k=0), remaining_tokens)
def test_where_the_target_runs_lookup_and_has_no_room_for_drafts_one_stretch_runs_the_longest(
    e, remaining
):
    """No k to learn: every restart would only cost the session a step it misses."""
    rules = StretchRules()
    action = decide(e, remaining)
    longest = (
        rules.longest
        if remaining is None or remaining - rules.longest >= rules.first
        else remaining
    )
    assert (action.lookup_k, action.stretch) == (0, longest)


def test_where_the_target_runs_lookup_a_costly_restart_makes_the_next_stretch_long():
    """On a loaded target a restart misses a step: with a start measured at 300 ms
    against 60 ms tokens, the next stretch is long enough that its start is at most
    start_share of its time, not merely twice the first."""
    policy, rules = AdaptiveK(8), StretchRules()
    policy.lookup_runs_on_target()
    first = policy.next_action(remaining=None).stretch
    for _ in range(first):
        policy.observe_round(*streamed(60.0))
    policy.observe_stretch(first, (first * 60 + 300) * MS, 60 * MS)
    assert first == rules.first
    assert (
        policy.next_action(remaining=None).stretch
        == math.ceil(300 / (rules.start_share * 60))
        > 2 * first
    )


@PROPERTY
@given(estimates(), remaining_tokens)
def test_rounds_are_chosen_only_where_they_beat_decoding_alone(e, remaining):
    action = decide(e, remaining)
    lead = e.tokens_per_ns(e.best_k()) * e.stretch.solo_token_ns
    assert _is_round(action) == (lead >= 1.0)
    if _is_round(action):
        assert action.k == e.best_k()


@PROPERTY
@given(estimates(), st.sampled_from([0, 8]), remaining_tokens, turns)
def test_without_stretches_a_round_of_the_fastest_k_or_the_plain_step(e, worker_k, remaining, turn):
    """Stretches off (rules=None): never a stretch; the plain step (a round of k = 0, R
    paid) only where it beats rounds of the fastest k, or after an empty turn."""
    e = dataclasses.replace(e, worker_k=worker_k)
    action = decide(e, remaining, turn, rules=None)
    assert action.stretch == 0
    k = e.best_k()
    plain = turn is not Turn.DRAFT or e.worker_k == 0 or e.tokens_per_ns(k) < e.tokens_per_ns(0)
    assert action.k == (0 if plain else k)


def test_a_policy_told_the_loop_cannot_stretch_asks_for_rounds_only():
    """Drafts never accepted, decoding alone 10 ms a token: a stretch either way. Without
    one, the alternative is the plain step, which pays the round trip R as a round does:
    it wins at R = 1 ms (10.85 ms a token against 10.90 for k = 1), not at R = 20 ms
    (29.9 against 28.3: a round's hopeful chance of a second token then outweighs the
    1 ms its draft adds to the pass)."""
    for overhead_ms, expected_k in ((1.0, 0), (20.0, 1)):
        policy = AdaptiveK(8)
        settled(
            policy,
            [
                round_(4, 0, 14.0, overhead_ms=overhead_ms),
                round_(1, 0, 11.0, overhead_ms=overhead_ms),
                streamed(9.0),
            ],
        )
        assert policy.next_action().stretch > 0
        without = policy.next_action(stretches=False)
        assert (without.stretch, without.k) == (0, expected_k)


@PROPERTY
@given(estimates(), remaining_tokens, turns)
def test_first_a_round_then_a_probe_after_each_stretch(e, remaining, turn):
    unmeasured = dataclasses.replace(e, one_token_ns=0.0)
    expected = Action(k=unmeasured.best_k(), ahead=True) if turn is Turn.DRAFT else TAKE_ROUND
    assert decide(unmeasured, remaining, turn) == expected
    assert _is_round(decide(with_stretch(e, after_stretch=True, measure=False), remaining))


@PROPERTY
@given(estimates(measure=True), remaining_tokens)
def test_a_stretch_that_measured_needs_no_probe(e, remaining):
    """After a stretch that measured acceptance, the decision is the one a round's
    estimates would give: a round only while speculation leads."""
    assert decide(with_stretch(e, after_stretch=True), remaining) == decide(e, remaining)


@PROPERTY
@given(estimates(worker_k=0), st.integers(1, 512))
def test_a_worker_with_no_room_for_drafts_decodes_alone(e, remaining):
    assert decide(e, remaining).stretch > 0


@PROPERTY
@given(estimates(worker_k=0, measure=True), remaining_tokens)
def test_a_loaded_worker_decodes_alone_in_the_longest_stretches_where_they_measure(e, remaining):
    """No probes and no stretch ended early: each restart would cost the session a step."""
    longest = StretchRules().longest
    expected = (
        longest if remaining is None or remaining >= longest + StretchRules().first else remaining
    )
    assert decide(e, remaining) == Action(stretch=expected)


@PROPERTY
@given(estimates(), remaining_tokens)
def test_stretches_grow_while_probes_lose(e, remaining):
    shorter = decide(e, remaining)
    longer = decide(with_stretch(e, losing_in_a_row=e.stretch.losing_in_a_row + 1), remaining)
    assume(shorter.stretch and remaining is None)
    assert longer.stretch >= shorter.stretch


@PROPERTY
@given(estimates(), st.integers(1, 8), st.floats(0.01, 0.99), st.floats(0.01, 0.99))
def test_drafting_ahead_only_grows_with_acceptance_and_is_free_for_a_free_drafter(
    e, k, lower, higher
):
    lower, higher = sorted((lower, higher))
    if draft_ahead(dataclasses.replace(e, acceptance=lower), k):
        assert draft_ahead(dataclasses.replace(e, acceptance=higher), k)
    assert draft_ahead(dataclasses.replace(e, draft_token_ns=0.0), k)


@PROPERTY
@given(estimates(overlaps=True), st.integers(1, 8))
def test_where_the_target_overlaps_a_round_never_costs_more_than_waiting_for_its_verdict(e, k):
    assert e.round_ns(k) <= e.sync_round_ns(k)
    assert (e.round_ns(k) < e.sync_round_ns(k)) <= draft_ahead(e, k)


@PROPERTY
@given(estimates(), st.integers(1, 8))
def test_a_draft_slower_than_the_pass_never_drafts_ahead_of_a_round_that_never_survives(e, k):
    """With nothing accepted (a = 0) a proposal drafted ahead is always wasted: it pays
    only where drafting it is hidden within the verification anyway."""
    e = dataclasses.replace(e, acceptance=0.0)
    outlasts = (k + 1) * e.draft_token_ns > e.compute_ns(k + 1) + e.overhead_ns
    assert draft_ahead(e, k) != outlasts


# --- replays of measured calls ----------------------------------------------------------


def test_drafting_ahead_prefers_rounds_short_enough_to_survive():
    """Qwen2.5-Coder 0.5B -> 1.5B, one CPU each: c(1) = 594 ms, 20 ms a token more,
    drafting 198 ms a token, R = 4 ms, a = 0.8. Waiting for each verdict, k = 2 yields
    E = 2.44 tokens per 1.03 s. Drafted ahead, a round of k = 2 survives with
    0.8^3 = 0.51, and then the next follows max(c(3), 3 d) = 0.63 s after it: k = 2 at
    0.83 s a round, 1.25x the rounds that wait (a longer k survives too rarely)."""
    costs = dict(
        max_k=4,
        acceptance=0.8,
        proposal_rate=1.0,
        draft_token_ns=198 * MS,
        one_token_ns=594 * MS,
        per_token_ns=20 * MS,
        overhead_ns=4 * MS,
        solo_token_ns=594 * MS,
        solo_measured=True,
        one_token_measured=True,
        start_ns=8 * MS,
        worker_k=8,
        measure=False,
    )
    waiting, overlapping = flat_estimates(**costs), flat_estimates(**costs, overlaps=True)
    action = decide(overlapping, remaining=64)
    assert (action.k, action.ahead, action.stretch) == (2, True, 0)
    assert overlapping.round_ns(2) == pytest.approx(0.83e9, rel=0.01)
    assert overlapping.tokens_per_ns(2) / waiting.tokens_per_ns(waiting.best_k()) == pytest.approx(
        1.25, abs=0.01
    )


def test_one_rejected_first_round_does_not_stop_speculation():
    """c(1) = 265 ms, c(3) = 318 ms, drafting 102 ms a token (Qwen2.5-Coder 0.5B -> 1.5B
    in process): a first round of k = 2 with nothing accepted reads a = 0.32, at which
    k = 1 loses to decoding alone; read with one more accepted token (0.5) k = 1 pays,
    so the next round measures instead of a stretch."""
    policy = AdaptiveK(8)
    policy.observe_round(*streamed(265.0))
    policy.observe_round(*round_(2, 0, 318.0, overhead_ms=0.2, draft_ms=204.0))
    assert policy.end_call().acceptance == pytest.approx(0.9 / 2.8)
    assert _k(policy.next_action()) == 1


def test_an_earlier_calls_acceptance_carries_a_first_rejection():
    """Through the services with the Qwen pair (+1 ms): a first round of k = 1 rejected
    after calls that accepted 85%. From the default prior it reads a = 0.32 and the call
    stops speculating; with the earlier 85% as the prior it reads 0.55 and measures on."""
    calls = [
        round_(4, 4, 344.0, overhead_ms=7.0, draft_ms=440.0),
        round_(4, 2, 344.0, overhead_ms=7.0, draft_ms=440.0),
        round_(0, 0, 265.0, overhead_ms=7.0),
    ]
    earlier = AdaptiveK(8)
    settled(earlier, calls, times=50)
    assert earlier.end_call().acceptance == pytest.approx(0.85, abs=0.01)
    first_round = round_(1, 0, 292.0, overhead_ms=7.0, draft_ms=110.0)
    seeded = AdaptiveK(8, costs=earlier.end_call())
    seeded.observe_round(*first_round)
    assert seeded.estimates().acceptance == pytest.approx(0.666, abs=0.01) and _is_round(
        seeded.next_action()
    )
    unseeded = AdaptiveK(
        8,
        costs=dataclasses.replace(earlier.end_call(), acceptance=None, depth_acceptance=()),
    )
    unseeded.observe_round(*first_round)
    assert unseeded.next_action().stretch > 0


def test_before_any_measurement_it_drafts_what_the_priors_favour():
    # Prior acceptance 0.5, each draft token +SLOPE_PRIOR (10%) verification, no delay: k = 2.
    assert SLOPE_PRIOR == 0.1
    assert _k(AdaptiveK(6).next_action()) == 2 and _k(AdaptiveK(1).next_action()) == 1
    assert _k(AdaptiveK(8).next_action(remaining=5)) == 2


def test_rejected_drafts_hand_over_to_stretches_that_double_while_probes_lose():
    policy = AdaptiveK(8, rules=StretchRules(first=8, longest=64))
    settled(policy, [round_(4, 0, 14.0), round_(1, 0, 11.0)])
    stretches = []
    for _ in range(5):
        stretches.append(policy.next_action().stretch)
        policy.observe_stretch(stretches[-1], stretches[-1] * 10 * MS + MS, 10 * MS)
        assert _k(policy.next_action()) == 1  # the probe drafts what is cheapest to re-measure with
        policy.observe_round(*round_(1, 0, 11.0))
    assert stretches == [8, 16, 32, 64, 64]


def test_a_stretch_runs_to_the_end_when_a_probe_after_it_could_not_pay():
    """After a stretch of 8, fewer than 8 tokens left: speculating on them, should the
    probe win, cannot repay bringing the draft up to date, so the stretch takes them."""
    policy = AdaptiveK(8, rules=StretchRules(first=8, longest=64))
    settled(policy, [round_(4, 0, 14.0), round_(1, 0, 11.0)])
    assert policy.next_action(remaining=16).stretch == 8
    policy.observe_stretch(8, 81 * MS, 10 * MS)
    policy.observe_round(*round_(1, 0, 11.0))  # the probe, still losing: the next stretch is 16
    assert policy.next_action(remaining=31).stretch == 31


def _bf16_qwen_rounds() -> AdaptiveK:
    """Qwen2.5-Coder 0.5B -> 1.5B in bf16 in process: rounds of k = 1, 360 ms each (the
    draft 105 ms), 5 of 6 accepted. With one width seen, c(1) is the slope's prior:
    327 ms (it is 213 ms), and k = 1 reads 1.27x faster than decoding alone (0.82x)."""
    policy = AdaptiveK(8)
    for observed in (
        [round_(1, 1, 360.0, draft_ms=105.0)] * 5 + [round_(1, 0, 360.0, draft_ms=105.0)]
    ) * 2:
        policy.observe_round(*observed)
    e = policy.estimates()
    assert e.one_token_ns == pytest.approx(327 * MS, rel=0.01)
    assert e.tokens_per_ns(1) * e.stretch.solo_token_ns == pytest.approx(1.27, abs=0.01)
    return policy


def test_a_lead_over_an_extrapolated_c1_is_checked_by_a_stretch():
    """One stretch measures c(1) (215 ms a token); after the probe, decoding alone wins.
    Where the call could not speculate after a stretch, no stretch."""
    assert _is_round(_bf16_qwen_rounds().next_action(remaining=15))
    policy = _bf16_qwen_rounds()
    assert policy.next_action(remaining=64).stretch == 8
    policy.observe_stretch(8, 8 * 215 * MS + 30 * MS, 215 * MS)
    e = policy.estimates()
    assert e.one_token_measured and e.stretch.solo_token_ns == pytest.approx(215 * MS)
    assert _is_round(policy.next_action(remaining=56))  # the probe
    policy.observe_round(*round_(1, 1, 360.0, draft_ms=105.0))
    assert policy.next_action(remaining=54).stretch == 16  # the probe lost: twice the last
    # The next call starts from what this one measured.
    seeded = AdaptiveK(8, costs=policy.end_call())
    seeded.observe_round(*round_(1, 1, 398.0, draft_ms=90.0))
    assert seeded.next_action(remaining=62).stretch > 0


def test_break_even_round_trip_matches_the_cost_model():
    """2 of 4 drafts accepted every round: the first two always, the third never (read
    0.95, 0.99 and 0.17, each with the rate above it as a light prior); c(1) = 10 ms,
    c(5) = 14 ms, solo 10 ms a token: k = 3 yields E = 3.05 tokens per c(4) + R = 13 ms
    + R, the best k, so speculation stops paying at R* = 30.5 - 13 = 17.5 ms."""
    break_even_ms = 17.5
    below, above = AdaptiveK(4), AdaptiveK(4)
    settled(below, [round_(4, 2, 14.0, overhead_ms=break_even_ms - 0.3), streamed(10.0)])
    settled(above, [round_(4, 2, 14.0, overhead_ms=break_even_ms + 0.3), streamed(10.0)])
    assert below.estimates().expected_tokens(3) == pytest.approx(3.05, abs=0.005)
    assert _k(below.next_action()) == 3 and above.next_action().stretch > 0


def _settled_policy(overhead_ms=5.0) -> AdaptiveK:
    """c(1) = 10 ms, c(5) = 14 ms, R = overhead_ms, solo 10 ms a token, 3 of 4 drafts
    accepted every round (the fourth never): k = 3, E = 4 tokens."""
    policy = AdaptiveK(4)
    settled(
        policy,
        [round_(4, 3, 14.0, overhead_ms=overhead_ms), streamed(10.0, overhead_ms)],
        times=30,
    )
    return policy


def _drafter_turns(
    policy,
    pattern,
    times=30,
    overhead_ms=5.0,
    remaining=None,
    turn=Turn.NOTHING_PROPOSED,
    start_ms=None,
    token_ms=10.0,
):
    """The drafter's turns, `pattern` over and over: P proposes, E proposes nothing.
    The stretches decided on at the E turns, each observed as decoded whole at token_ms
    a token after a start of start_ms (default 2 R, the prior)."""
    start_ms = 2 * overhead_ms if start_ms is None else start_ms
    stretches = []
    for _ in range(times):
        for kind in pattern:
            policy.observe_turn(proposed=kind == "P")
            if kind == "P":
                policy.observe_round(*round_(4, 3, 14.0, overhead_ms=overhead_ms))
                continue
            stretches.append(policy.next_action(remaining, turn).stretch)
            if stretches[-1]:
                policy.observe_stretch(
                    stretches[-1],
                    int((stretches[-1] * token_ms + start_ms) * MS),
                    int(token_ms * MS),
                )
    return stretches


def test_an_empty_proposal_is_worth_a_round_trip_only_while_proposals_pay_for_it():
    """Rounds with a share f proposing yield (4 f + 1 - f) / (18 f + 15 (1 - f)) tokens
    per ms, which beats 0.1 from f >= 0.19: a drafter proposing every other turn is
    worth an empty round; one proposing every seventh is not: a stretch, long enough
    that its start (2 R = 10 ms) is at most 5% of it (20 tokens), and twice the last
    after each further empty turn, up to 4 x 8."""
    assert set(_drafter_turns(_settled_policy(), "PE")) == {0}
    assert _drafter_turns(_settled_policy(), "PEEEEEE")[-6:] == [20, 20, 32, 32, 32, 32]
    # nothing measured yet
    assert AdaptiveK(4).next_action(turn=Turn.NOTHING_PROPOSED) == TAKE_ROUND


def test_an_empty_turn_near_the_end_of_the_call_decodes_to_the_end():
    rarely = _settled_policy()
    assert _drafter_turns(rarely, "PEEEE")[-1] == 32
    assert [rarely.next_action(n, Turn.NOTHING_PROPOSED).stretch for n in (100, 40, 39, 33, 5)] == [
        32,
        32,
        39,
        33,
        5,
    ]


def test_a_lookup_drafters_stretch_runs_until_it_would_propose_again():
    """An empty round costs 15 ms for its token, decoding alone 10 ms a token, starting a
    stretch 20 ms: over a gap of 2 tokens (a proposal every other turn) the empty rounds
    are cheaper; over 5 the stretch, which runs to the end unless text to copy ends it."""
    often, rarely = _settled_policy(), _settled_policy()
    for policy in (often, rarely):
        policy.observe_stretch(20, (20 * 10 + 20) * MS, 10 * MS)
    decided = _drafter_turns(often, "PE", remaining=100, turn=Turn.NOTHING_UNTIL_MATCH, start_ms=20)
    # Empty rounds, and now and then one first-size stretch (20 ms / (5% of 10 ms): 40
    # tokens) re-measuring s, once that risks at most 5% of the rounds' time since.
    assert decided.count(0) >= len(decided) - 2 and set(decided) <= {0, 40}
    assert (
        _drafter_turns(rarely, "PEEEE", remaining=100, turn=Turn.NOTHING_UNTIL_MATCH, start_ms=20)[
            -1
        ]
        == 100
    )


def test_in_process_an_empty_round_costs_next_to_nothing():
    """With R = 0.1 ms an empty round costs what a token decoded alone does: even a
    drafter proposing every fifth turn keeps the rounds."""
    assert set(_drafter_turns(_settled_policy(overhead_ms=0.1), "PEEEE", overhead_ms=0.1)) == {0}


def test_a_measured_stretch_sizes_the_next_stretches():
    """Stretches came 11 ms a token and 30 ms to start: one is 30 / (0.05 * 11) = 55 tokens."""
    policy = _settled_policy()
    for _ in range(100):
        policy.observe_stretch(20, 20 * 11 * MS + 30 * MS, 11 * MS)
    assert set(_drafter_turns(policy, "PEEEEEEE", start_ms=30, token_ms=11)[-5:]) == {55}


def test_costs_measured_by_an_earlier_call_decide_the_first_round():
    """a = 2/3 cannot pay a 20 ms round trip: decode alone, long enough that its start
    (prior 2 R = 40 ms) is at most 5% of it at 10 ms a token: 80 tokens."""
    earlier = AdaptiveK(4)
    settled(earlier, [round_(4, 2, 14.0, overhead_ms=20.0), streamed(10.0)])
    assert AdaptiveK(4, costs=earlier.end_call()).next_action().stretch == 80
    assert _k(AdaptiveK(4).next_action()) == 2  # unseeded: measure first


def test_a_stretch_that_came_out_slow_is_measured_again():
    """Empty rounds cost 49 ms a token; the one stretch measured came 57 ms a token (a
    burst of load), so rounds win and s would never be measured again. Once a first-size
    stretch risks at most 5% of the rounds' time since (70 ms: from 30 rounds), one
    re-measures it: 46 ms, and decoding alone wins."""
    policy = AdaptiveK(4)
    settled(policy, [round_(0, 0, 46.0, overhead_ms=3.0)], times=30)
    policy.observe_stretch(8, (8 * 57 + 4) * MS, 57 * MS)
    decisions = []
    while len(decisions) < 100 and not (decisions and decisions[-1]):
        policy.observe_turn(proposed=False)
        decisions.append(policy.next_action(1000, Turn.NOTHING_PROPOSED).stretch)
        if not decisions[-1]:
            policy.observe_round(*round_(0, 0, 46.0, overhead_ms=3.0))
    assert (len(decisions) - 1, decisions[-1]) == (30, 8)
    policy.observe_stretch(8, (8 * 46 + 4) * MS, 46 * MS)
    assert policy.estimates().stretch.solo_token_ns == pytest.approx(46.5 * MS, rel=0.01)
    assert policy.next_action(1000, Turn.NOTHING_PROPOSED).stretch > 0


def test_decoding_alone_costs_what_its_stretches_measured():
    """Qwen pair through the services: a stretch came 285 ms a token; then rounds of
    k = 2, 2, 3, every draft accepted, put c(1) near 200 ms, yet decoding alone still
    costs the 285 ms measured, and k = 3 at 94% leads it."""
    policy = AdaptiveK(8)
    policy.observe_round(*round_(2, 2, 308.0, overhead_ms=5.0, draft_ms=239.0))
    # c(1) not measured yet: a stretch measures it
    assert policy.next_action(remaining=61).stretch == 8
    policy.observe_stretch(8, (8 * 285 + 300) * MS, 285 * MS)
    for k, draft_ms, compute_ms in [(2, 216.0, 342.0), (2, 227.0, 304.0), (3, 555.0, 422.0)]:
        assert _is_round(policy.next_action(remaining=50))
        policy.observe_round(*round_(k, k, compute_ms, overhead_ms=3.0, draft_ms=draft_ms))
    e = policy.estimates()
    assert e.stretch.solo_token_ns == 285 * MS and e.one_token_ns < 240 * MS
    assert _is_round(policy.next_action(remaining=43))


def test_a_costly_draft_lowers_k():
    fast, slow = AdaptiveK(8), AdaptiveK(8)
    settled(fast, [round_(4, 2, 12.0), round_(1, 1, 10.5)], times=30)
    settled(
        slow,
        [round_(4, 2, 12.0, draft_ms=40.0), round_(1, 1, 10.5, draft_ms=10.0)],
        times=30,
    )
    assert slow.estimates().best_k() < fast.estimates().best_k()


def test_rejected_drafts_on_a_crowded_worker_hand_over_to_decoding_alone():
    """Drafts never accepted cost the batch (32 sessions, 40 ms + 0.9 ms a token) and
    yield nothing: the target decodes alone, whatever the session's own rounds favour."""
    stats, elapsed = round_(1, 0, 40.0 + 0.9 * 64)
    loaded = dataclasses.replace(
        stats, step=StepLoad(0, stats.target_compute_ns, 64, 32, 32, 40.0 * MS, 0.9 * MS)
    )
    policy = AdaptiveK(4)
    settled(policy, [(loaded, elapsed)])
    assert policy.estimates().worker_k == 0 and policy.next_action(remaining=1000).stretch > 0


# --- the loop, driven by policies -------------------------------------------------------


def test_adaptive_generation_is_still_exact(tiny_target, prompt_ids):
    params = SamplingParams(max_new_tokens=24)
    plain = SpeculativeGenerator(tiny_target)
    adaptive = SpeculativeGenerator(tiny_target, NgramDrafter())
    for ids in prompt_ids[:6]:
        assert (
            adaptive.generate(ids, params, k=AdaptiveK(8)).token_ids
            == plain.generate(ids, params, k=0).token_ids
        )


@pytest.mark.parametrize("max_k", [1, 3, 8])
def test_a_lookup_drafters_rounds_run_by_the_target_keep_the_output_exact(
    tiny_bigram, prompt_ids, max_k
):
    """Where the target runs prompt lookup's rounds (LocalVerifier(runs_lookup=True) in
    process), the call is stretches whose passes verify looked-up tokens: no round of
    the draft's, the target's greedy output token for token."""
    params = SamplingParams(max_new_tokens=40)
    plain = SpeculativeGenerator(tiny_bigram)
    accepted = 0
    for ids in prompt_ids[:6]:
        target = TargetSession(tiny_bigram, ids, params)
        loop = speculation_rounds(
            LocalVerifier(target, runs_lookup=True),
            NgramDrafter(1, 3).open(ids, params),
            len(ids),
            params,
            AdaptiveK(max_k),
            tiny_bigram.context_length,
        )
        results = list(loop)
        assert [t for r in results for t in r.token_ids] == plain.generate(
            ids, params, k=0
        ).token_ids
        assert all(r.stats.streamed and r.stats.num_drafted <= max_k for r in results)
        accepted += sum(r.stats.num_accepted for r in results)
    assert accepted >= 20


# Rounds that propose win (k = 4 at a = 0.93: 4.6 tokens for 14 + 20 ms, against 10 ms a
# token alone); an empty round (30 ms) loses to a stretch until text to copy (10 ms a
# token and 20 ms to start, over the 2 tokens f = 0.5 expects).
SLOW_LINK = MeasuredCosts(
    one_token_ns=10 * MS,
    per_token_ns=1 * MS,
    overhead_ns=20 * MS,
    solo_token_ns=10 * MS,
    stream_start_ns=20 * MS,
    draft_token_ns=0.0,
    acceptance=0.9,
    one_token_measured=True,
)


class _StretchesToCopies(AdaptiveK):
    """AdaptiveK deciding as over a slow link, recording each stretch it asked for at an
    empty turn with what it decoded."""

    def __init__(self):
        super().__init__(4, decay=0.99, costs=SLOW_LINK)
        self.asked = 0  # the stretch last asked for at an empty turn
        self.stretches = []  # (asked, decoded)

    def observe_stretch(self, num_tokens, elapsed_ns, token_ns, empty_turns=0, passes_ns=None):
        if self.asked:
            self.stretches.append((self.asked, num_tokens))
        assert empty_turns == (num_tokens - 1 if self.asked else 0)
        super().observe_stretch(num_tokens, elapsed_ns, token_ns, empty_turns)

    def next_action(self, remaining=None, turn=Turn.DRAFT, stretches=True):
        action = super().next_action(remaining, turn, stretches)
        # an n-gram drafter's stretches end at text to copy
        assert turn is not Turn.NOTHING_PROPOSED
        if turn is Turn.NOTHING_UNTIL_MATCH or action.stretch:
            self.asked = action.stretch if turn is Turn.NOTHING_UNTIL_MATCH else 0
        return action


def test_in_process_stretches_end_at_text_to_copy_and_the_output_stays_exact(
    tiny_target, prompt_ids
):
    plain = SpeculativeGenerator(tiny_target)
    lookup = SpeculativeGenerator(tiny_target, NgramDrafter(min_ngram=1, max_ngram=2))
    params = SamplingParams(max_new_tokens=24)
    ended_at_copies = 0
    for ids in prompt_ids:
        policy = _StretchesToCopies()
        assert (
            lookup.generate(ids, params, k=policy).token_ids
            == plain.generate(ids, params, k=0).token_ids
        )
        ended_at_copies += sum(decoded < asked for asked, decoded in policy.stretches)
    assert ended_at_copies >= 5


class _Alternating(SpeculationPolicy):
    """Target-only stretches of `solo` tokens between rounds of k: every boundary."""

    def __init__(self, k, solo):
        super().__init__(k)
        self.solo, self.drafting = solo, True
        self.stretches = []

    def observe_stretch(self, num_tokens, elapsed_ns, token_ns, empty_turns=0, passes_ns=None):
        self.stretches.append((num_tokens, elapsed_ns, token_ns))

    def next_action(self, remaining=None, turn=Turn.DRAFT, stretches=True):
        if turn is not Turn.DRAFT:
            return TAKE_ROUND
        self.drafting = not self.drafting
        return Action(k=self.max_k, ahead=True) if self.drafting else Action(stretch=self.solo)


@pytest.mark.parametrize(("k", "solo"), [(1, 1), (3, 2), (4, 5)])
def test_stretches_of_target_only_decoding_keep_greedy_and_seeded_output_exact(
    tiny_target, tiny_perturbed, prompt_ids, k, solo
):
    plain = SpeculativeGenerator(tiny_target)
    mixed = SpeculativeGenerator(tiny_target, ModelDrafter(tiny_perturbed))
    greedy = SamplingParams(max_new_tokens=21)
    for ids in prompt_ids[:4]:
        result = mixed.generate(ids, greedy, k=_Alternating(k, solo))
        assert result.token_ids == plain.generate(ids, greedy, k=0).token_ids
        assert result.stats.num_streamed > 0 and result.stats.num_drafted > 0
        assert result.stats.num_generated_tokens == 21
    # A stop token inside a stretch ends the generation there.
    ids = prompt_ids[0]
    reference = plain.generate(ids, greedy, k=0).token_ids
    stop = SamplingParams(max_new_tokens=21, stop_token_ids=(reference[solo],))
    assert (
        mixed.generate(ids, stop, k=_Alternating(k, solo)).token_ids
        == plain.generate(ids, stop, k=0).token_ids
    )
    # Seeded sampling: the same run twice draws the same tokens.
    seeded = SamplingParams(temperature=0.8, seed=7, max_new_tokens=21)
    first = mixed.generate(ids, seeded, k=_Alternating(k, solo)).token_ids
    assert mixed.generate(ids, seeded, k=_Alternating(k, solo)).token_ids == first


class _CallLog(DraftSession):
    """A draft session that logs which of its methods were called, in order."""

    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    @property
    def length(self):
        return self.inner.length

    def propose(self, k, min_reach=0.0):
        self.calls.append("propose")
        return self.inner.propose(k, min_reach)

    def append(self, token_ids):
        self.calls.append("append")
        self.inner.append(token_ids)

    def truncate_to(self, length):
        self.inner.truncate_to(length)

    def prefill(self):
        self.calls.append("prefill")
        self.inner.prefill()

    def release(self):
        self.inner.release()


def test_the_draft_catches_up_on_a_stretch_before_drafting_again(
    tiny_target, tiny_perturbed, prompt_ids
):
    """The draft runs the tokens it did not see at the end of a stretch, which the policy
    learns as the cost of starting one, never within the next proposal."""
    calls = []
    drafter = ModelDrafter(tiny_perturbed)
    opened = drafter.open
    drafter.open = lambda ids, params: _CallLog(opened(ids, params), calls)
    policy = _Alternating(2, 3)
    SpeculativeGenerator(tiny_target, drafter).generate(
        prompt_ids[0], SamplingParams(max_new_tokens=20), k=policy
    )
    text = " ".join(calls)
    assert (
        text.count(" ".join(["append"] * 3 + ["prefill", "propose"])) == len(policy.stretches) >= 3
    ), text
    # token_ns: the mean of the n - 1 intervals after the first, all within elapsed.
    assert all(
        n == 3 and elapsed >= (n - 1) * token_ns > 0 for n, elapsed, token_ns in policy.stretches
    )


class _Solo(SpeculationPolicy):
    def __init__(self):
        super().__init__(4)

    def next_action(self, remaining=None, turn=Turn.DRAFT, stretches=True):
        return Action(stretch=remaining)


def test_a_call_the_target_decodes_alone_never_runs_the_draft_model(
    tiny_target, tiny_perturbed, prompt_ids
):
    passes = []
    hook = tiny_perturbed.model.register_forward_hook(lambda *args: passes.append(1))
    try:
        generator = SpeculativeGenerator(tiny_target, ModelDrafter(tiny_perturbed))
        params = SamplingParams(max_new_tokens=12)
        result = generator.generate(prompt_ids[0], params, k=_Solo())
        assert (
            result.token_ids
            == SpeculativeGenerator(tiny_target).generate(prompt_ids[0], params, k=0).token_ids
        )
        assert passes == [] and result.stats.num_streamed == 12
        generator.generate(prompt_ids[0], params, k=4)
        assert passes  # a drafting call still runs it
    finally:
        hook.remove()


class _FirstLook(AdaptiveK):
    """Records whether it had costs to decide with at each decision before drafting."""

    def __init__(self, max_k):
        super().__init__(max_k)
        self.looks = []

    def next_action(self, remaining=None, turn=Turn.DRAFT, stretches=True):
        if turn is Turn.DRAFT:
            self.looks.append(self.measured)
        return super().next_action(remaining, turn, stretches)


def test_in_process_calls_seed_the_next_calls_costs(tiny_target, prompt_ids):
    generator = SpeculativeGenerator(tiny_target, NgramDrafter())
    params = SamplingParams(max_new_tokens=12)
    first, second = _FirstLook(4), _FirstLook(4)
    generator.generate(prompt_ids[0], params, k=first)
    assert generator.measured_costs is not None and generator.measured_costs.one_token_ns > 0
    generator.generate(prompt_ids[1], params, k=second)
    assert first.looks[0] is False and second.looks[0] is True


class _ShadowLog(SpeculationPolicy):
    """One stretch to the end; logs the rounds a free drafter would have run in it."""

    def __init__(self, k):
        super().__init__(k)
        self.shadows = []

    def observe_shadow(self, num_drafted, num_accepted):
        self.shadows.append((num_drafted, num_accepted))

    def next_action(self, remaining=None, turn=Turn.DRAFT, stretches=True):
        return Action(stretch=remaining)


class _RoundLog(FixedK):
    def __init__(self, k):
        super().__init__(k)
        self.rounds = []

    def observe_round(self, round_stats, elapsed_ns):
        self.rounds.append((round_stats.num_drafted, round_stats.num_accepted))


class _ScriptedVerifier:
    """A target whose greedy output is `script`, in process: verdicts accept the draft's
    prefix that matches it; a stretch decodes it."""

    overlaps = runs_lookup = False

    def __init__(self, prompt_len, script):
        self.prompt_len, self.script, self.sent = prompt_len, script, []

    def send(
        self, base_len, draft_token_ids, draft_probs, expected_last_token_id=None, parents=None
    ):
        self.sent.append((base_len, list(draft_token_ids)))

    def receive(self):
        base_len, drafts = self.sent.pop(0)
        ahead = self.script[base_len - self.prompt_len :]
        accepted = next(
            (i for i, (d, t) in enumerate(zip(drafts, ahead)) if d != t),
            min(len(drafts), len(ahead) - 1),
        )
        kind = NextTokenKind.BONUS if accepted == len(drafts) else NextTokenKind.RECOVERED
        tokens = ahead[: accepted + 1]
        return VerifyResult(
            Verdict(accepted, tokens[-1], kind), tokens, base_len + len(tokens), False, 0
        )

    def abandon_last(self):
        self.sent.pop()

    def decode(self, base_len, max_tokens, until=None, lookup=None):
        for i, token in enumerate(self.script[base_len - self.prompt_len :][:max_tokens]):
            yield VerifyResult(
                Verdict(0, token, NextTokenKind.BONUS), [token], base_len + i + 1, False, 0
            )


# Text that repeats with changes: prompt lookup proposes, and is right for a while.
_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 9, 4, 5, 6, 10, 8]
_SCRIPT = [
    1,
    2,
    3,
    4,
    5,
    6,
    11,
    8,
    1,
    2,
    9,
    4,
    5,
    6,
    7,
    8,
    12,
    1,
    2,
    3,
    4,
    5,
    13,
    13,
    1,
    2,
    9,
    4,
    5,
    6,
    10,
    8,
] * 2


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_stretch_measures_the_rounds_a_lookup_drafter_would_have_run(k):
    """The shadow rounds of one stretch are the rounds k = k really runs on the same
    output (those ending before its last k + 1 tokens, where the room cuts k)."""
    params = SamplingParams(max_new_tokens=len(_SCRIPT))
    logs = []
    for policy in (_ShadowLog(k), _RoundLog(k)):
        draft = NgramDrafter(min_ngram=1, max_ngram=3).open(_PROMPT, params)
        loop = speculation_rounds(
            _ScriptedVerifier(len(_PROMPT), _SCRIPT), draft, len(_PROMPT), params, policy, 4096
        )
        assert [t for result in loop for t in result.token_ids] == _SCRIPT
        logs.append(policy.shadows if isinstance(policy, _ShadowLog) else policy.rounds)
    shadows, rounds = logs
    ran, consumed = [], 0
    for drafted, accepted in rounds:  # a plain step commits 1 token, a round accepted + 1
        consumed += accepted + 1
        if consumed <= len(_SCRIPT) - (k + 1):
            ran.append((drafted, accepted))
    assert shadows[: len(ran)] == ran
    assert (
        sum(accepted >= 2 for _, accepted in ran) >= (2 if k > 1 else 0)
        and sum(d > 0 for d, _ in ran) >= 8
    )


@given(estimates(after_stretch=True))
@PROPERTY
def test_a_model_drafter_stops_where_its_next_token_earns_less_than_the_round(e):
    """stop_reach: one more draft token costs d + g; it must bring what that time earns
    in rounds of k, so the chance of acceptance below which drafting stops is that
    time over the time per token; a free drafter (d = 0) never stops early."""
    action = decide(e, None)
    if not _is_round(action) or action.k == 0:
        return
    if e.draft_token_ns == 0.0:
        assert action.min_reach == 0.0
    else:
        earned = (e.draft_token_ns + e.widening_ns(action.k)) * e.tokens_per_ns(action.k)
        assert action.min_reach == pytest.approx(min(1.0, earned))
        assert (action.min_reach > 0.0) == (
            earned > 0.0
        ) and action.min_reach <= 1.0  # 0 only by underflow


def test_draft_tokens_within_a_padded_pass_cost_only_their_drafting():
    """A target whose passes of 1-6 tokens all cost one of 6 (a CPU's cheapest width, as
    its step costs say): tokens up to k = 5 widen nothing, so a model drafter stops where
    its next token earns less than d alone, and a tree's branches there are free; past
    it they cost again."""
    plain = flat_estimates(
        max_k=8,
        acceptance=0.7,
        proposal_rate=1.0,
        draft_token_ns=30 * MS,
        one_token_ns=150 * MS,
        per_token_ns=10 * MS,
        overhead_ns=5 * MS,
        solo_token_ns=200 * MS,
        solo_measured=True,
        one_token_measured=True,
        start_ns=0.0,
        worker_k=8,
        measure=False,
    )
    padded = dataclasses.replace(
        plain, per_token_ns=150 * MS, step_costs=(200.0,) * 6 + (250.0, 260.0, 270.0)
    )
    assert padded.compute_ns(2) == padded.compute_ns(6) == 150 * MS < padded.compute_ns(7)
    assert (padded.widening_ns(4), plain.widening_ns(4)) == (0.0, 10 * MS)
    assert stop_reach(padded, 4) == pytest.approx(30 * MS * padded.tokens_per_ns(4))
    assert stop_reach(plain, 4) == pytest.approx(40 * MS * plain.tokens_per_ns(4))
    assert branch_reach(padded, 2) == 0.0 and branch_reach(padded, 6) > 0.0


def test_a_fixed_k_never_stops_a_drafter_early():
    assert FixedK(4).next_action().min_reach == 0.0


@pytest.mark.parametrize("min_reach, expected", [(0.0, 4), (0.999, 1)])
def test_a_model_drafter_stops_below_min_reach(tiny_target, prompt_ids, min_reach, expected):
    """A tiny random model is far from sure of any token: asked to stop below a near-
    certain chance, it drafts one token (the one whose pass it already ran)."""
    session = ModelDrafter(tiny_target).open(prompt_ids[0], SamplingParams())
    assert len(session.propose(4, min_reach)) == expected
