"""CostEstimator: each estimate follows what the call measures, and no single noisy
sample rules a choice out."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundation.load import StepLoad
from speculative.estimator import HOPE, PRIOR_TRIALS, CostEstimator, expected_tokens
from speculative.pass_costs import SLOW_PASS_CLIP, pass_x
from speculative.policy import SpeculationPolicy
from speculative.rejection import NextTokenKind
from speculative.stats import LookupCheck, RoundStats
from speculative.stretch_costs import SOLO_TOKEN_WEIGHT

MS = 1_000_000  # nanoseconds


def round_(num_drafted, num_accepted, compute_ms, overhead_ms=0.0, draft_ms=0.0, step=None):
    """A round's statistics and its elapsed time: drafting + target compute + overhead."""
    stats = RoundStats(
        index=0,
        base_len=0,
        num_drafted=num_drafted,
        num_accepted=num_accepted,
        num_committed=num_accepted + 1,
        next_token_kind=NextTokenKind.BONUS,
        draft_ns=int(draft_ms * MS),
        verify_ns=int((compute_ms + overhead_ms) * MS),
        target_compute_ns=int(compute_ms * MS),
        step=step,
    )
    return stats, int((draft_ms + compute_ms + overhead_ms) * MS)


def streamed(compute_ms, overhead_ms=0.0, looked_up=0, accepted=0):
    """One pass of a stretch: one token, or a looked-up proposal verified and accepted."""
    elapsed = int((compute_ms + overhead_ms) * MS)
    stats = RoundStats(
        index=0,
        base_len=0,
        num_drafted=looked_up,
        num_accepted=accepted,
        num_committed=accepted + 1,
        next_token_kind=NextTokenKind.BONUS,
        draft_ns=0,
        verify_ns=elapsed,
        target_compute_ns=int(compute_ms * MS),
        streamed=True,
    )
    return stats, elapsed


def settled(observer, rounds, times=100):
    """A policy or an estimator observes the rounds `times` over: the decayed averages
    forget the priors."""
    observe = (
        observer.observe_round if isinstance(observer, SpeculationPolicy) else observer.observe
    )
    for _ in range(times):
        for observed in rounds:
            observe(*observed)
    return observer


def test_acceptance_counts_accepted_tokens_and_the_first_rejection():
    """2 of 4 accepted each round: 2 accepted and 1 rejected trial, settling at 2/3; the
    decision reads it with one more accepted (HOPE)."""
    fresh = CostEstimator(4)
    # a prior as light as two draft tokens
    assert (fresh.acceptances.rate(), fresh.acceptances.trials) == (0.5, PRIOR_TRIALS)
    estimator = settled(fresh, [round_(4, 2, 14.0)])
    assert estimator.acceptances.rate() == pytest.approx(2 / 3, abs=1e-4)
    hopeful = (estimator.acceptances.accepted + HOPE) / (estimator.acceptances.trials + HOPE)
    assert (
        estimator.estimates().acceptance
        == pytest.approx(hopeful)
        == pytest.approx(21 / 31, abs=1e-4)
    )


def test_the_target_line_and_the_round_trip_are_fitted_from_rounds():
    estimator = settled(
        CostEstimator(8), [round_(4, 2, 14.0, overhead_ms=5.0), round_(0, 0, 10.0, overhead_ms=5.0)]
    )
    e = estimator.estimates()
    assert e.compute_ns(1) == pytest.approx(10 * MS, rel=0.01) and e.compute_ns(5) == pytest.approx(
        14 * MS, rel=0.01
    )
    assert e.overhead_ns == pytest.approx(5 * MS, rel=0.01)
    assert e.round_ns(4) == pytest.approx(19 * MS, rel=0.01)


# What a CPU target timed its passes of 1-9 tokens to cost, as it runs them (ms; passes
# of 1-4 tokens padded to 6, a 5-token pass dearer than a 6-token one).
STEP_MS = (181.0, 181.0, 181.0, 181.0, 189.0, 181.0, 228.0, 230.0, 231.0)


def test_a_target_that_reports_its_step_costs_is_priced_by_them():
    """Passes that cost 1.1 times what the worker timed (a longer context): told the
    worker's curve, the fit scales it to what the call measures, a 5-token pass dearer
    than a 6-token one and a token in a padded pass free; a line over the widths cannot
    (the control)."""
    rounds = [round_(k, k // 2, 1.1 * STEP_MS[k]) for k in range(1, 9)]
    told = CostEstimator(8)
    told.passes.step_costs = STEP_MS
    e = settled(told, rounds).estimates()
    for width in range(1, 10):
        assert e.compute_ns(width) == pytest.approx(1.1 * STEP_MS[width - 1] * MS, rel=0.01), width
    assert e.compute_ns(5) > e.compute_ns(6) and e.widening_ns(5) == pytest.approx(
        0.0, abs=0.01 * MS
    )
    blind = settled(CostEstimator(8), rounds).estimates()
    assert (
        blind.compute_ns(5) <= blind.compute_ns(6)
        and blind.widening_ns(5) > 0.02 * 1.1 * STEP_MS[0] * MS / 5
    )


def test_a_pass_is_placed_on_the_line_by_its_timed_cost():
    assert [pass_x((), w) for w in (1, 3)] == [0.0, 2.0]  # nothing timed: w - 1
    assert [pass_x((100.0, 50.0, 150.0), w) for w in (1, 2, 3, 4)] == [
        1.0,
        0.0,
        2.0,
        2.5,
    ]  # on at the mean slope


def test_one_slow_pass_does_not_rule_anything_out():
    """A cold first pass at some width, or a slow streamed token, must not make that
    choice look too costly to ever be tried (and re-measured) again."""
    estimator = settled(
        CostEstimator(8), [round_(1, 1, 11.0, overhead_ms=2.0), streamed(10.0)], times=30
    )
    estimator.observe(*round_(4, 4, 300.0, overhead_ms=2.0))  # 30x a one-token pass
    # clipped to the line times the clip
    assert estimator.estimates().compute_ns(5) < SLOW_PASS_CLIP * 14.0 * MS
    for _ in range(10):
        estimator.observe(*round_(8, 8, 18.0, overhead_ms=2.0))
    assert estimator.estimates().compute_ns(9) == pytest.approx(18.0 * MS, rel=0.1)


def test_a_cold_first_pass_is_forgotten_even_at_one_width():
    estimator = CostEstimator(2)
    estimator.observe(*round_(2, 1, 300.0))
    for _ in range(40):
        estimator.observe(*round_(2, 1, 12.0))
    assert estimator.estimates().compute_ns(3) == pytest.approx(12.0 * MS, rel=0.1)


def test_a_long_stretch_refines_c1_without_erasing_the_slope():
    """64 tokens decoded alone weigh SOLO_TOKEN_WEIGHT of a pass each and do not age the
    wider passes: c(1) follows them, the slope stays what the passes measured."""
    assert SOLO_TOKEN_WEIGHT < 1.0
    passes = [
        round_(w - 1, w - 1, 213.0 + 130.0 * (w - 1), draft_ms=100.0 * (w - 1))
        for w in (2, 3, 4, 5)
    ]
    estimator = settled(CostEstimator(8), passes, times=5)
    for _ in range(64):
        estimator.observe(*streamed(213.0))
    e = estimator.estimates()
    assert e.one_token_ns == pytest.approx(213 * MS, rel=0.07)
    assert e.per_token_ns == pytest.approx(130 * MS, rel=0.1)


def test_a_stretch_measures_decoding_alone_and_its_start():
    """Tokens 11 ms apart, the whole stretch 30 ms longer than its tokens: s = 11 ms and
    o = 30 ms; a stretch that ended at text to copy counts its empty turns into f."""
    estimator = settled(CostEstimator(4), [round_(4, 3, 14.0, overhead_ms=5.0)], times=30)
    assert estimator.estimates().stretch.start_ns == pytest.approx(10 * MS, rel=0.01)  # prior: 2 R
    for _ in range(100):
        estimator.stretches.observe_stretch(20, 20 * 11 * MS + 30 * MS, 11 * MS)
    e = estimator.estimates()
    assert (e.stretch.solo_token_ns, e.stretch.start_ns) == (
        pytest.approx(11 * MS),
        pytest.approx(30 * MS),
    )
    assert e.stretch.solo_measured and e.stretch.after_stretch
    counted, stretched = CostEstimator(4), CostEstimator(4)
    for _ in range(9):
        counted.stretches.observe_turn(proposed=False)
    stretched.stretches.observe_turn(proposed=False)
    stretched.stretches.observe_stretch(9, 100 * MS, 10 * MS, empty_turns=8)
    rate = stretched.estimates().stretch.proposal_rate
    assert rate == pytest.approx(counted.estimates().stretch.proposal_rate) and rate < 0.1


def test_costs_carry_to_the_next_call():
    earlier = settled(CostEstimator(4), [round_(4, 2, 14.0, overhead_ms=20.0), streamed(10.0)])
    seeded = CostEstimator(4, costs=earlier.costs())
    assert seeded.acceptances.rate() == pytest.approx(2 / 3, abs=1e-3)
    assert seeded.acceptances.trials == 2.0  # a light prior
    assert seeded.estimates().round_ns(4) == pytest.approx(
        earlier.estimates().round_ns(4), rel=0.01
    )
    assert seeded.measured and not CostEstimator(4).measured


def test_the_depth_profile_carries_to_the_next_call_as_a_light_prior():
    """A draft right for 2 tokens and wrong at the third: the next call starts knowing
    the third is accepted less often than the first (as lightly as its pooled prior), and
    its own rounds outweigh that soon."""
    earlier = settled(CostEstimator(4), [round_(4, 2, 14.0)])
    seeded = CostEstimator(4, costs=earlier.costs())
    assert seeded.acceptances.depth_rates()[2] < 0.55 < 0.7 < seeded.acceptances.depth_rates()[0]
    pooled_only = CostEstimator(4, costs=dataclasses.replace(earlier.costs(), depth_acceptance=()))
    assert pooled_only.acceptances.depth_rates()[2] == pytest.approx(pooled_only.acceptances.rate())
    later = settled(seeded, [round_(4, 4, 14.0)], times=10)
    assert later.acceptances.depth_rates()[2] > 0.8


def _cascade_round(num_drafted, num_accepted, lookup_turn):
    """A cascade's round of 14 ms: lookup's (it took the turn) or the model's, lookup's
    guess of 8 tokens checked beside it."""
    stats, elapsed = round_(num_drafted, num_accepted, 14.0, draft_ms=0.0 if lookup_turn else 8.0)
    check = LookupCheck(3, 8, num_accepted if lookup_turn else 0, proposed=lookup_turn)
    return dataclasses.replace(stats, lookup=check, lookup_turn=lookup_turn), elapsed


def test_a_cascade_whose_lookup_took_turns_hands_on_no_acceptance():
    """Its model drafted only what lookup left (what the prompt did not copy): the next
    prompt copies more or less, so the next call starts from the default prior, its
    costs still seeded."""
    earlier = settled(
        CostEstimator(4), [_cascade_round(4, 1, lookup_turn=False), _cascade_round(8, 8, True)]
    )
    handed = earlier.costs()
    assert handed.acceptance is None and handed.depth_acceptance == ()
    seeded = CostEstimator(4, costs=handed)
    assert seeded.acceptances.rate() == 0.5 and seeded.acceptances.depth_rates() == (0.5,) * 4
    assert seeded.estimates().round_ns(4) == pytest.approx(
        earlier.estimates().round_ns(4), rel=0.01
    )


def test_a_cascade_whose_lookup_only_guessed_hands_on_the_models_acceptance():
    """Lookup checked beside every round but took none: the model drafted every position."""
    earlier = settled(CostEstimator(4), [_cascade_round(4, 1, lookup_turn=False)])
    handed = earlier.costs()
    assert handed.acceptance == pytest.approx(0.5, abs=1e-3)  # 1 accepted, 1 rejected
    assert handed.depth_acceptance[0] > handed.depth_acceptance[1]


# Under load: the target batches B sessions per step, a step of T tokens costing about
# base + per_token * T (what SmolLM2-135M fp32 on 2 cores measured: 40 ms + 0.9 ms a token).


def _worker_k(sessions, accepted_of_4=2, base_ms=40.0, per_token_ms=0.9):
    return _settled_under_load(sessions, [accepted_of_4], base_ms, per_token_ms).worker_k()


def _settled_under_load(sessions, accepted_of_4, base_ms=40.0, per_token_ms=0.9):
    """An estimator after rounds of 4 draft tokens, of which accepted_of_4[i] in turn."""
    rounds = []
    for accepted in accepted_of_4:
        stats, elapsed = round_(4, accepted, base_ms + per_token_ms * sessions * 5)
        step = StepLoad(
            0,
            stats.target_compute_ns,
            sessions * 5,
            sessions,
            sessions,
            base_ms * MS,
            per_token_ms * MS,
        )
        rounds.append((dataclasses.replace(stats, step=step), elapsed))
    return settled(CostEstimator(4), rounds)


# Rounds whose every draft token is accepted with probability 2/3 once the ones before
# it were: 0, 1, 2, 3 and 4 accepted 27, 18, 12, 8 and 16 times in 81 rounds, in turn.
IID_TWO_THIRDS = [0, 1, 4, 0, 2, 1, 0, 3, 4] * 8 + [0, 1, 2, 0, 1, 2, 0, 2, 2]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(1, 64),
    st.integers(0, 4),
    st.floats(5.0, 200.0),
    st.floats(0.1, 5.0),
)
def test_more_sessions_per_step_never_raise_k(fewer, more, accepted, base_ms, per_token_ms):
    fewer, more = sorted((fewer, more))
    assert _worker_k(more, accepted, base_ms, per_token_ms) <= _worker_k(
        fewer, accepted, base_ms, per_token_ms
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.integers(0, 4), st.integers(0, 4))
def test_higher_acceptance_never_lowers_k_under_load(sessions, lower, higher):
    lower, higher = sorted((lower, higher))
    assert _worker_k(sessions, lower) <= _worker_k(sessions, higher)


def test_the_load_cap_binds_only_when_crowded():
    crowded, alone = (_settled_under_load(n, IID_TWO_THIRDS).worker_k() for n in (64, 1))
    assert alone == 4 and crowded < 4
    assert settled(CostEstimator(4), [round_(4, 4, 50.0)]).worker_k() == 4  # no step cost reported


def test_expected_tokens_is_leviathans_formula():
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert (expected_tokens(0.0, 4), expected_tokens(1.0, 4)) == (1.0, 5.0)


def test_shadow_proposals_during_stretches_count_as_rounds_would():
    """A free drafter's proposals, checked against the tokens a stretch decoded, move
    the acceptance and proposal rate exactly as the same rounds would."""
    shadowed, rounds = CostEstimator(4), CostEstimator(4)
    for drafted, accepted in [(4, 1), (0, 0), (3, 3), (4, 0)]:
        shadowed.observe_shadow(drafted, accepted)
        rounds.stretches.observe_turn(proposed=drafted > 0)
        if drafted:
            rounds.observe(*round_(drafted, accepted, 10.0))
    assert shadowed.acceptances.rate() == pytest.approx(rounds.acceptances.rate())
    assert shadowed.estimates().stretch.proposal_rate == pytest.approx(
        rounds.estimates().stretch.proposal_rate
    )
    assert shadowed.estimates().stretch.measure and not rounds.estimates().stretch.measure


def test_the_load_cap_reads_the_measured_acceptance():
    """At 24 sessions a step of 40 ms + 0.9 ms a token gives a draft token 1.7 ms of
    shared base against 0.9 ms of the whole batch's time: one pays above an acceptance
    of about 0.35. Rounds settling at 0.332 must not buy the batch drafts on hope
    (which reads 0.393)."""
    step = StepLoad(0, 50 * MS, 24, 24, 24, 40.0 * MS, 0.9 * MS)
    estimator = settled(
        CostEstimator(4), [round_(1, accepted, 50.0, step=step) for accepted in (0, 1, 0)]
    )
    assert estimator.acceptances.rate() == pytest.approx(0.332, abs=0.01)
    assert estimator.estimates().acceptance > 0.38
    assert estimator.worker_k() == 0


def test_the_load_carries_to_the_next_call():
    """A call's first decision already knows the worker's load as the last call saw it."""
    step = StepLoad(0, 50 * MS, 16, 16, 16, 40.0 * MS, 0.9 * MS)
    earlier = settled(CostEstimator(4), [round_(1, 0, 50.0, step=step)])
    assert earlier.worker_k() == 0
    earlier.observe_shadow(4, 0)
    seeded = CostEstimator(4, costs=earlier.costs())
    assert seeded.worker_k() == 0 and seeded.estimates().stretch.measure
    assert CostEstimator(4).worker_k() == 4  # nothing seen: no cap


def test_alone_on_the_target_the_load_cap_hopes_as_the_call_does():
    """One session (B = 1) pays for its own exploring: before any draft token is
    measured, the cap reads a with the call's hope, and leaves the deep k the call's
    own decision takes (steps of 58 ms + 2.4 ms a token: a copying drafter's k = 8
    costs a third more than one token). At B = 16 the same hope is shared out."""

    def capped(sessions):
        stats, elapsed = streamed(60.0)
        step = StepLoad(0, 60 * MS, sessions, sessions, sessions, 58.0 * MS, 2.4 * MS)
        estimator = CostEstimator(8)
        estimator.observe(dataclasses.replace(stats, step=step), elapsed)
        return estimator

    alone = capped(1)
    assert (
        alone.worker_k()
        >= dataclasses.replace(alone.estimates(), overhead_ns=0.0, worker_k=8).best_k()
        >= 4
    )
    assert capped(16).worker_k() < alone.worker_k()


def test_a_rounds_time_away_from_the_target_counts_under_load():
    """8 sessions, steps of 50 ms + 4.7 ms a token, 2 of 3 drafts accepted: with rounds
    that come straight back, k = 1 commits the most; with 40 ms away per round (the
    session misses most of a step) decoding alone does."""
    step = StepLoad(0, 90 * MS, 8, 8, 8, 50.0 * MS, 4.7 * MS)
    quick = settled(
        CostEstimator(4), [round_(1, accepted, 90.0, step=step) for accepted in (1, 1, 0)]
    )
    away = settled(
        CostEstimator(4),
        [round_(1, accepted, 90.0, overhead_ms=40.0, step=step) for accepted in (1, 1, 0)],
    )
    assert quick.worker_k() == 1 and away.worker_k() == 0


def test_a_round_drafted_ahead_leaves_the_round_trip_alone():
    """Its drafting fell within the round before, so its elapsed time holds no R."""
    estimator = settled(
        CostEstimator(4, overlaps=True), [round_(4, 3, 14.0, overhead_ms=5.0, draft_ms=8.0)]
    )
    stats, elapsed = round_(4, 3, 14.0, draft_ms=8.0)
    estimator.observe(dataclasses.replace(stats, drafted_ahead=True), elapsed - int(8.0 * MS))
    assert estimator.estimates().overhead_ns == pytest.approx(5.0 * MS)
    assert estimator.estimates().overlaps


def test_a_draft_token_that_came_with_the_prefill_is_not_counted_as_a_pass():
    """d is per pass: a first round after the draft's prefill drafts k tokens in k - 1."""
    estimator = CostEstimator(4)
    stats, elapsed = round_(4, 3, 14.0, draft_ms=30.0)
    estimator.observe(dataclasses.replace(stats, draft_warm=True), elapsed)
    assert estimator.estimates().draft_token_ns == pytest.approx(10.0 * MS)
    estimator.observe(*round_(4, 3, 14.0, draft_ms=40.0))
    assert estimator.estimates().draft_token_ns == pytest.approx(10.0 * MS)


# Acceptance by depth: a_i, the chance that draft token i is accepted once 1..i-1 were.


def test_a_copy_that_runs_on_or_stops_is_worth_long_proposals():
    """Half the rounds accept all 4 drafts, half reject the first: one pooled rate reads
    a = 4/5 and E[tokens] of 8 drafts as 4.2; by depth the first is accepted half the
    time and every later one once the first was, so 8 drafts yield nearly 5 tokens."""
    estimator = settled(CostEstimator(8), [round_(4, 4, 14.0), round_(4, 0, 14.0)])
    e = estimator.estimates()
    assert estimator.acceptances.rate() == pytest.approx(0.8, abs=0.03)
    assert e.depth_acceptance[0] == pytest.approx(0.5, abs=0.07)
    assert min(e.depth_acceptance[1:]) > 0.85  # depths 5-8, never reached, read at depth 4
    assert e.expected_tokens(8) > 4.5 > expected_tokens(e.acceptance, 8)


def test_a_draft_always_wrong_at_the_same_depth_is_read_so():
    """Settled (about 10 rounds' weight against the prior's 2 tokens, the depth above's)."""
    e = settled(CostEstimator(4), [round_(4, 2, 14.0)]).estimates()
    assert e.depth_acceptance[:2] == pytest.approx((1.0, 1.0), abs=0.06)
    assert e.depth_acceptance[2] == e.depth_acceptance[3] < 0.2
    assert e.reach(2) > 0.9 and e.reach(3) < 0.2


def test_depths_never_reached_are_read_at_the_deepest_reached():
    e = settled(CostEstimator(8), [round_(2, 2, 14.0), round_(2, 1, 14.0)]).estimates()
    assert e.depth_acceptance[2:] == (e.depth_acceptance[1],) * 6
    assert e.depth_acceptance[1] == pytest.approx(0.5, abs=0.06)


def test_a_depth_few_rounds_reach_reads_near_the_one_above():
    """One round in ten reaches the third draft token and has it rejected: its rate stays
    near the second's, not the 0 of its one draw, so k = 3 is not written off."""
    rounds = [round_(2, 2, 14.0)] * 9 + [round_(3, 2, 14.0)]
    e = settled(CostEstimator(4), rounds, times=1).estimates()
    assert e.depth_acceptance[2] > 0.5 * e.depth_acceptance[1]


def test_by_depth_and_pooled_agree_before_any_round():
    e = CostEstimator(4).estimates()
    assert e.depth_acceptance == (e.acceptance,) * 4
    assert e.expected_tokens(4) == pytest.approx(expected_tokens(e.acceptance, 4))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=30))
def test_pooled_acceptance_is_the_depth_counts_summed(rounds):
    """a's counts are a_i's over every depth plus the prior: the two never drift apart."""
    estimator = CostEstimator(6)
    for drafted, accepted in rounds:
        estimator.observe(*round_(drafted, min(accepted, drafted), 14.0))
    prior = estimator.decay ** len(rounds) * PRIOR_TRIALS  # the prior's weight, aged by every round
    accepted = 0.5 * prior + sum(a for a, _ in estimator.acceptances.depth_counts)
    trials = prior + sum(n for _, n in estimator.acceptances.depth_counts)
    counts = estimator.acceptances
    assert (counts.accepted, counts.trials) == (pytest.approx(accepted), pytest.approx(trials))


def test_leviathan_speedup_is_expected_tokens_over_a_round_s_cost():
    from speculative.estimator import leviathan_speedup, round_speedup

    # a = 0.8, k = 4: 3.3616 tokens a round for 4 draft steps of 10 and a pass of 120
    assert leviathan_speedup(0.8, 4, 10.0, 100.0, 120.0) == pytest.approx(3.3616 * 100 / 160)
    assert leviathan_speedup(1.0, 2, 0.0, 50.0, 50.0) == 3.0  # every token accepted, free drafts
    assert round_speedup(1.0, 0, 5.0, 100.0, 100.0) == 1.0  # k = 0 is target-only
