"""AdaptiveK chooses between k = 1..max_k and target-only decoding from measured
acceptance and costs (round trip included); exactness never depends on its choices."""

from __future__ import annotations

import dataclasses

import pytest

from speculative.drafters import DraftSession, NgramDrafter
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK, MeasuredCosts, SpeculationPolicy, expected_tokens
from speculative.rejection import NextTokenKind
from speculative.sampling import SamplingParams
from speculative.stats import RoundStats, StepLoad

MS = 1_000_000  # nanoseconds


def _round(num_drafted, num_accepted, compute_ms, overhead_ms=0.0, draft_ms=0.0):
    """A round's statistics and its elapsed time: drafting + target compute + overhead."""
    stats = RoundStats(
        0, 0, num_drafted, num_accepted, num_accepted + 1, NextTokenKind.BONUS,
        int(draft_ms * MS), int((compute_ms + overhead_ms) * MS), int(compute_ms * MS),
    )
    return stats, int((draft_ms + compute_ms + overhead_ms) * MS)


def _streamed(compute_ms, overhead_ms=0.0):
    elapsed = int((compute_ms + overhead_ms) * MS)
    stats = RoundStats(0, 0, 0, 0, 1, NextTokenKind.BONUS, 0, elapsed, int(compute_ms * MS), streamed=True)
    return stats, elapsed


def _settled(policy, rounds, times=100):
    """Observes the rounds `times` over: the decayed averages forget the priors."""
    for _ in range(times):
        for observed in rounds:
            policy.observe(*observed)
    return policy


def test_one_rejected_first_round_does_not_stop_speculation():
    """c(1) = 265 ms, c(3) = 318 ms, drafting 102 ms a token (as Qwen2.5-Coder 0.5B ->
    1.5B measured in process): a first round of k = 2 with nothing accepted reads
    a = 0.32 (0.9 accepted of 2.8 decayed trials), at which k = 1 (E = 1.32 tokens per
    c(2) + d = 291.5 + 102 ms) loses to decoding alone (265 ms a token); decided with
    one more accepted token, a = 0.5 and k = 1 pays (1.5 tokens), so the next round
    measures instead of a stretch. (A token decoded alone measured c(1) first: else the
    thin lead would be checked by a stretch, see the test of exploring.)"""
    policy = AdaptiveK(8)
    policy.observe(*_streamed(265.0))
    policy.observe(*_round(2, 0, 318.0, overhead_ms=0.2, draft_ms=204.0))
    assert policy.acceptance() == pytest.approx(0.9 / 2.8)
    assert policy.solo_tokens() == 0 and policy.next_k() == 1


def test_an_earlier_calls_acceptance_carries_a_first_rejection():
    """Through the services with Qwen2.5-Coder 0.5B -> 1.5B (+1 ms), a code edit's first
    round (k = 1) was rejected after calls that accepted 85%; from the default prior
    (a = 0.5) that reads 0.32 (hopeful 0.5), and with c(1) = 267 ms, c(2) = 287 ms,
    drafting 110 ms a token and R = 7 ms, decoding alone (3.74 tokens/s) beat k = 1
    (1.5 tokens per 404 ms: 3.71/s): the call handed 39 tokens to the target, while the
    rest of its drafts were accepted 16 of 17. With the earlier calls' 85% as the prior,
    the rejection reads 0.55 (hopeful 0.67, 4.12 tokens/s): the call measures on."""
    calls = [_round(4, 4, 344.0, overhead_ms=7.0, draft_ms=440.0), _round(4, 2, 344.0, overhead_ms=7.0, draft_ms=440.0),
             _round(0, 0, 265.0, overhead_ms=7.0)]
    earlier = _settled(AdaptiveK(8), calls, times=50)
    assert earlier.acceptance() == pytest.approx(0.85, abs=0.01)
    first_round = _round(1, 0, 292.0, overhead_ms=7.0, draft_ms=110.0)
    seeded = AdaptiveK(8, costs=earlier.costs())
    seeded.observe(*first_round)
    assert seeded.hopeful_acceptance() == pytest.approx(0.666, abs=0.01)
    assert seeded.solo_tokens() == 0
    unseeded = AdaptiveK(8, costs=dataclasses.replace(earlier.costs(), acceptance=None))
    unseeded.observe(*first_round)
    assert unseeded.acceptance() == pytest.approx(0.9 / 2.8)
    assert unseeded.solo_tokens() > 0


def test_before_any_measurement_it_drafts_what_the_priors_favour():
    # Prior acceptance 0.5, each draft token +10% verification, no delay: k = 2.
    policy = AdaptiveK(6)
    assert policy.solo_tokens() == 0 and policy.next_k() == 2
    assert AdaptiveK(1).next_k() == 1


def test_high_acceptance_and_cheap_verification_keep_k_high():
    policy = _settled(AdaptiveK(8), [_round(8, 8, 13.0), _streamed(10.0)])
    assert policy.solo_tokens() == 0 and policy.next_k() == 8


def test_rejected_drafts_hand_over_to_target_only_decoding_with_growing_stretches():
    policy = _settled(AdaptiveK(8, first_solo=8, max_solo=64), [_round(4, 0, 14.0), _round(1, 0, 11.0)])
    stretches = []
    for _ in range(5):
        stretches.append(policy.solo_tokens())
        assert policy.solo_tokens() == 0  # a probe round follows each stretch
        policy.observe(*_round(1, 0, 11.0))
    assert stretches == [8, 16, 32, 64, 64]
    assert policy.next_k() == 1  # the probe drafts what is cheapest to re-measure with


def test_a_stretch_runs_to_the_end_when_a_probe_after_it_could_not_pay():
    """After a stretch of 8, fewer than 8 tokens left: speculating on them, should the
    probe win, cannot repay bringing the draft up to date, so the stretch takes them."""
    policy = _settled(AdaptiveK(8, first_solo=8, max_solo=64), [_round(4, 0, 14.0), _round(1, 0, 11.0)])
    assert policy.solo_tokens(remaining=16) == 8
    policy.observe(*_round(1, 0, 11.0))  # the probe, still losing: the next stretch is 16
    assert policy.solo_tokens() == 0
    assert policy.solo_tokens(remaining=31) == 31
    assert AdaptiveK(8).solo_tokens(remaining=5) == 0  # nothing measured yet: a round first


def _bf16_qwen_rounds():
    """Qwen2.5-Coder 0.5B -> 1.5B in bf16 in process: rounds of k = 1, 360 ms each (the
    draft 105 ms), 5 of 6 accepted. With one width seen, c(1) is the slope's prior:
    327 ms (it is 213 ms), and k = 1 reads 1.26x faster than decoding alone (0.82x)."""
    policy = AdaptiveK(8)
    for observed in ([_round(1, 1, 360.0, draft_ms=105.0)] * 5 + [_round(1, 0, 360.0, draft_ms=105.0)]) * 2:
        policy.observe(*observed)
    assert policy.one_token_ns == pytest.approx(327 * MS, rel=0.01)
    assert policy.tokens_per_ns(1) * policy.solo_cost_ns() == pytest.approx(1.26, abs=0.01)
    return policy


@pytest.mark.parametrize("services", [False, True])
def test_a_lead_over_an_extrapolated_c1_is_checked_by_a_stretch(services):
    """One stretch measures c(1) (in process from each token's compute, across the
    services as at most the stretch's 215 ms a token); after the probe, decoding alone
    wins. Where the call could not speculate after a stretch, no stretch."""
    assert _bf16_qwen_rounds().solo_tokens(remaining=15) == 0
    policy = _bf16_qwen_rounds()
    assert policy.solo_tokens(remaining=64) == 8
    if not services:
        for _ in range(8):
            policy.observe(*_streamed(213.0))
    policy.observe_stretch(8, 8 * 215 * MS + 30 * MS, 215 * MS)
    assert policy.one_token_measured and policy.solo_cost_ns() == pytest.approx(215 * MS, rel=0.01)
    assert policy.solo_tokens(remaining=56) == 0  # the probe
    policy.observe(*_round(1, 1, 360.0, draft_ms=105.0))
    assert policy.solo_tokens(remaining=54) == 8
    # The next call starts from what this one measured: decoding alone, 215 ms a token,
    # still beats a round of k = 1 that took 398 + 90 ms and was accepted.
    seeded = AdaptiveK(8, costs=policy.costs())
    assert seeded.one_token_measured and seeded.solo_cost_ns() == pytest.approx(215 * MS)
    seeded.observe(*_round(1, 1, 398.0, draft_ms=90.0))
    assert seeded.solo_tokens(remaining=62) > 0


def test_break_even_round_trip_matches_the_cost_model():
    """2 of 4 drafts accepted each round: 2 accepted and 1 rejected trial a round, so
    the decayed counts settle at 20 of 30, decided on with one more accepted
    (HOPE): a = 21/31. c(1) = 10 ms, c(5) = 14 ms (interpolated between), solo 10 ms
    per token: speculation at k = 4 yields E = 2.658 tokens per c(5) + R, so it stops
    paying at R* = 26.58 - 14 = 12.58 ms (k = 1..3 break even earlier: 5.77, 9.36,
    11.47 ms)."""
    measured = [_round(4, 2, 14.0), _streamed(10.0)]
    break_even_ms = expected_tokens(21 / 31, 4) * 10.0 - 14.0
    assert break_even_ms == pytest.approx(12.58, abs=0.01)
    below = _settled(AdaptiveK(4), [_round(4, 2, 14.0, overhead_ms=break_even_ms - 0.3), measured[1]])
    above = _settled(AdaptiveK(4), [_round(4, 2, 14.0, overhead_ms=break_even_ms + 0.3), measured[1]])
    assert below.hopeful_acceptance() == pytest.approx(21 / 31, abs=1e-4)
    assert below.solo_tokens() == 0 and below.next_k() == 4
    assert above.solo_tokens() > 0


def _drafter_turns(policy, pattern, times=30, overhead_ms=5.0):
    """The drafter's turns, `pattern` over and over: P proposes (a = 3/4, c(5) = 14 ms,
    R = overhead_ms), E proposes nothing. The stretches asked for instead of the E rounds."""
    stretches = []
    for _ in range(times):
        for turn in pattern:
            if turn == "P":
                policy.observe(*_round(4, 3, 14.0, overhead_ms=overhead_ms))
            else:
                stretches.append(policy.tokens_instead_of_empty_round())
    return stretches


def test_an_empty_proposal_is_worth_a_round_trip_only_while_proposals_pay_for_it():
    """c(1) = 10 ms, c(5) = 14 ms, R = 5 ms, solo 10 ms per token, k = 4 at a = 3/4
    (E = 3.05 tokens for 19 ms). With a share f of turns proposing, rounds yield
    (3.05 f + 1 - f) / (19 f + 15 (1 - f)) tokens per ms, which beats 0.1 for
    f >= 0.5 / 1.65 = 0.30: a drafter proposing every other turn (f ~ 0.47) is worth an
    empty round; one proposing every fifth turn (f <= 0.22) is not, and the target
    decodes a stretch instead, long enough that starting it (its round trip and the
    next round's, 2 x 5 ms) is at most 5% of it: 10 ms / (0.05 * 10 ms) = 20 tokens, and
    twice the last after each further empty turn, up to 4 x 8 = 32 tokens."""
    def settled():
        return _settled(AdaptiveK(4), [_round(4, 3, 14.0, overhead_ms=5.0), _streamed(10.0)], times=30)
    often, rarely = settled(), settled()
    assert often.next_k() == 4
    assert set(_drafter_turns(often, "PE")) == {0}
    assert _drafter_turns(rarely, "PEEEE")[-4:] == [20, 20, 32, 32]
    assert AdaptiveK(4).tokens_instead_of_empty_round() == 0  # nothing measured yet


def test_an_empty_turn_near_the_end_of_the_call_decodes_to_the_end():
    """The stretch instead of an empty round (32 tokens once turns stay empty, as above)
    runs to the end of the call when fewer than first_solo (8) tokens would remain
    after it: asking the drafter again could not win back the start of another stretch
    there."""
    rarely = _settled(AdaptiveK(4), [_round(4, 3, 14.0, overhead_ms=5.0), _streamed(10.0)], times=30)
    assert _drafter_turns(rarely, "PEEEE")[-1] == 32
    assert [rarely.tokens_instead_of_empty_round(remaining) for remaining in (100, 40, 39, 33, 5)] \
        == [32, 32, 39, 33, 5]


def test_a_lookup_drafters_stretch_runs_until_it_would_propose_again():
    """c(1) = 10 ms, R = 5 ms: an empty round costs 15 ms for its token, decoding alone
    10 ms a token, starting a stretch 20 ms. A stretch that ends by itself where prompt
    lookup finds text to copy costs 10 + 20 / gap a token over the gap of 1 / f tokens
    until the drafter proposes again: with a proposal every other turn (gap 2: 20 ms) the
    empty rounds are cheaper; with one every fifth turn (gap 5: 14 ms) the stretch,
    which then runs to the end of the call unless text to copy ends it first."""
    def settled():
        policy = _settled(AdaptiveK(4), [_round(4, 3, 14.0, overhead_ms=5.0), _streamed(10.0)], times=30)
        policy.observe_stretch(20, (20 * 10 + 20) * MS, 10 * MS)
        return policy
    often, rarely = settled(), settled()
    for _ in range(30):
        often.observe(*_round(4, 3, 14.0, overhead_ms=5.0))
        assert often.tokens_instead_of_empty_round(100, ends_at_match=True) == 0
    for _ in range(30):
        rarely.observe(*_round(4, 3, 14.0, overhead_ms=5.0))
        decisions = [rarely.tokens_instead_of_empty_round(100, ends_at_match=True) for _ in range(4)]
    assert decisions[-1] == 100
    assert 0.15 < rarely.proposal_rate() < 0.25 and 0.4 < often.proposal_rate() < 0.6


def test_a_stretch_that_ended_at_text_to_copy_counts_its_empty_turns():
    """Its tokens but the last were turns in which the drafter would have found nothing:
    f falls as if they had been empty rounds, and the expected gap grows with it."""
    counted, stretched = AdaptiveK(4), AdaptiveK(4)
    for _ in range(9):
        counted.tokens_instead_of_empty_round()
    stretched.tokens_instead_of_empty_round()
    stretched.observe_stretch(9, 100 * MS, 10 * MS, empty_turns=8)
    assert stretched.proposal_rate() == pytest.approx(counted.proposal_rate())
    assert stretched.proposal_rate() < 0.1


class _StretchesToCopies(AdaptiveK):
    """AdaptiveK deciding as over a slow link (each call starts from SLOW_LINK, which
    what it measures in process moves only slowly), recording each stretch it asked
    for at an empty turn with what it decoded."""

    def __init__(self):
        super().__init__(4, decay=0.99, costs=SLOW_LINK)
        self.asked = None  # the stretch last asked for at an empty turn (None: by solo_tokens)
        self.stretches = []  # (asked, decoded)

    def solo_tokens(self, remaining=None):
        tokens = super().solo_tokens(remaining)
        self.asked = None if tokens else self.asked
        return tokens

    def tokens_instead_of_empty_round(self, remaining=None, ends_at_match=False):
        assert ends_at_match  # an n-gram drafter's stretches end at text to copy
        self.asked = super().tokens_instead_of_empty_round(remaining, ends_at_match)
        return self.asked

    def observe_stretch(self, num_tokens, elapsed_ns, token_ns, empty_turns=0):
        if self.asked:
            self.stretches.append((self.asked, num_tokens))
        assert empty_turns == (num_tokens - 1 if self.asked else 0)
        super().observe_stretch(num_tokens, elapsed_ns, token_ns, empty_turns)


# Rounds that propose win (k = 4 at a = 0.93: 4.6 tokens for 14 + 20 ms, against 10 ms a
# token alone); an empty round (30 ms) loses to a stretch until text to copy (10 ms a
# token and 20 ms to start, over the 2 tokens f = 0.5 expects).
SLOW_LINK = MeasuredCosts(one_token_ns=10 * MS, per_token_ns=1 * MS, overhead_ns=20 * MS, solo_token_ns=10 * MS,
                          stream_start_ns=20 * MS, draft_token_ns=0.0, acceptance=0.9, one_token_measured=True)


def test_in_process_stretches_end_at_text_to_copy_and_the_output_stays_exact(tiny_target, prompt_ids):
    plain = SpeculativeGenerator(tiny_target)
    lookup = SpeculativeGenerator(tiny_target, NgramDrafter(min_ngram=1, max_ngram=2))
    params = SamplingParams(max_new_tokens=24)
    ended_at_copies = 0
    for ids in prompt_ids:
        policy = _StretchesToCopies()
        assert lookup.generate(ids, params, k=policy).token_ids == plain.generate(ids, params, k=0).token_ids
        # Each runs to the end of the call unless text to copy ends it first (9 of 20 here).
        ended_at_copies += sum(decoded < asked for asked, decoded in policy.stretches)
    assert ended_at_copies >= 5


def test_in_process_an_empty_round_costs_next_to_nothing():
    """With R = 0.1 ms, an empty round costs what a solo token does, so even a drafter
    proposing every fifth turn keeps the rounds (its proposals pay)."""
    local = _settled(AdaptiveK(4), [_round(4, 3, 14.0, overhead_ms=0.1), _streamed(10.0, overhead_ms=0.1)])
    assert set(_drafter_turns(local, "PEEEE", overhead_ms=0.1)) == {0}


def test_a_measured_handoff_sizes_the_next_stretches():
    """Stretches handed off came back 30 ms later than their tokens (received 11 ms
    apart: 1 ms past the target's 10 ms): a stretch now costs 11 ms a token (at most
    c(1) + R = 15 ms), and starting one 30 ms, so one is 30 / (0.05 * 11) = 54.5 -> 55 tokens (for
    a drafter proposing every eighth turn, f <= 0.16, under the 0.22 that now pays)."""
    policy = _settled(AdaptiveK(4), [_round(4, 3, 14.0, overhead_ms=5.0), _streamed(10.0)], times=30)
    for _ in range(100):
        policy.observe_stretch(20, 20 * 11 * MS + 30 * MS, 11 * MS)
    assert policy.solo_cost_ns() == pytest.approx(11 * MS, rel=1e-4)
    assert set(_drafter_turns(policy, "PEEEEEEE")[-7:]) == {55}  # past the 32 for empty turns


def test_costs_measured_by_an_earlier_call_decide_the_first_round():
    earlier = _settled(AdaptiveK(4), [_round(4, 2, 14.0, overhead_ms=20.0), _streamed(10.0)])
    seeded = AdaptiveK(4, costs=earlier.costs())  # acceptance: the earlier one, as a light prior
    assert seeded.acceptance() == pytest.approx(2 / 3, abs=1e-3) and seeded.trials == 2.0
    # a = 2/3 cannot pay a 20 ms round trip: decode alone, long enough that a probe's
    # round trips (its own, and the next stretch's first token's: 2 x 20 ms) are at most
    # 5% of the stretch (10 ms per token): 80 tokens.
    assert seeded.solo_tokens() == 80
    assert AdaptiveK(4).solo_tokens() == 0  # unseeded: measure first


def test_one_slow_pass_does_not_rule_anything_out():
    """A cold first pass at some width, or a slow streamed token, must not make that
    choice look too costly to ever be tried (and re-measured) again."""
    policy = _settled(AdaptiveK(8), [_round(1, 1, 11.0, overhead_ms=2.0), _streamed(10.0)], times=30)
    policy.observe(*_round(4, 4, 300.0, overhead_ms=2.0))  # 30x a one-token pass
    assert policy.compute_ns(5) < 1.25 * 14.0 * MS  # clipped to 1.25 times the line's 14 ms
    assert policy.next_k() == 8  # everything accepted, so long proposals still pay...
    for _ in range(10):
        policy.observe(*_round(8, 8, 18.0, overhead_ms=2.0))
    assert policy.compute_ns(9) == pytest.approx(18.0 * MS, rel=0.1)  # ...and re-measure the line
    policy.observe(*_streamed(300.0))
    assert policy.solo_cost_ns() <= policy.one_token_ns + policy.overhead_ns


def test_a_cold_first_pass_is_forgotten_even_at_one_width():
    """Calls that always verify the same width never see c(1) alone: the line still
    follows what the passes measure."""
    policy = AdaptiveK(2)
    policy.observe(*_round(2, 1, 300.0))  # the first pass, cold
    for _ in range(40):
        policy.observe(*_round(2, 1, 12.0))
    assert policy.compute_ns(3) == pytest.approx(12.0 * MS, rel=0.1)


def test_a_costly_draft_lowers_k():
    """The same acceptance pays for a long proposal from a cheap drafter, not a costly one."""
    fast = _settled(AdaptiveK(8), [_round(4, 2, 12.0), _round(1, 1, 10.5)], times=30)
    slow = _settled(AdaptiveK(8), [_round(4, 2, 12.0, draft_ms=40.0), _round(1, 1, 10.5, draft_ms=10.0)], times=30)
    assert slow.next_k() < fast.next_k()


def test_adaptive_generation_is_still_exact(tiny_target, prompt_ids):
    params = SamplingParams(max_new_tokens=24)
    plain = SpeculativeGenerator(tiny_target)
    adaptive = SpeculativeGenerator(tiny_target, NgramDrafter())
    for ids in prompt_ids[:6]:
        assert adaptive.generate(ids, params, k=AdaptiveK(8)).token_ids == plain.generate(ids, params, k=0).token_ids


class _Alternating(SpeculationPolicy):
    """Target-only stretches of `solo` tokens between rounds of k: every boundary."""

    def __init__(self, k, solo):
        self.max_k, self.solo, self.drafting = k, solo, True

    def next_k(self):
        return self.max_k

    def solo_tokens(self, remaining=None):
        self.drafting = not self.drafting
        return 0 if self.drafting else self.solo


@pytest.mark.parametrize(("k", "solo"), [(1, 1), (3, 2), (4, 5)])
def test_stretches_of_target_only_decoding_keep_greedy_and_seeded_output_exact(tiny_target, tiny_perturbed, prompt_ids, k, solo):
    from speculative.drafters import ModelDrafter

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
    assert mixed.generate(ids, stop, k=_Alternating(k, solo)).token_ids == plain.generate(ids, stop, k=0).token_ids
    # Seeded sampling: the same run twice draws the same tokens.
    seeded = SamplingParams(temperature=0.8, seed=7, max_new_tokens=21)
    first = mixed.generate(ids, seeded, k=_Alternating(k, solo)).token_ids
    assert mixed.generate(ids, seeded, k=_Alternating(k, solo)).token_ids == first


class _StretchLog(_Alternating):
    def __init__(self, k, solo):
        super().__init__(k, solo)
        self.stretches = []

    def observe_stretch(self, num_tokens, elapsed_ns, token_ns, empty_turns=0):
        self.stretches.append((num_tokens, elapsed_ns, token_ns))


class _CallLog(DraftSession):
    """A draft session that logs which of its methods were called, in order."""

    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    @property
    def length(self):
        return self.inner.length

    def propose(self, k):
        self.calls.append("propose")
        return self.inner.propose(k)

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


def test_the_draft_catches_up_on_a_stretch_before_drafting_again(tiny_target, tiny_perturbed, prompt_ids):
    """In process, the draft runs the tokens it did not see at the end of a stretch,
    which the policy learns as the cost of starting one, never within the next
    proposal (which would pass it off as drafting time)."""
    from speculative.drafters import ModelDrafter

    calls = []
    drafter = ModelDrafter(tiny_perturbed)
    opened = drafter.open
    drafter.open = lambda ids, params: _CallLog(opened(ids, params), calls)
    policy = _StretchLog(2, 3)
    SpeculativeGenerator(tiny_target, drafter).generate(prompt_ids[0], SamplingParams(max_new_tokens=20), k=policy)
    stretch = ["append"] * 3 + ["prefill", "propose"]
    text = " ".join(calls)
    assert text.count(" ".join(stretch)) == len(policy.stretches) >= 3, text
    # token_ns: the mean of the n - 1 intervals after the first, all within elapsed.
    assert all(n == 3 and elapsed >= (n - 1) * token_ns > 0 for n, elapsed, token_ns in policy.stretches)


class _Solo(SpeculationPolicy):
    max_k = 4

    def next_k(self):
        return self.max_k

    def solo_tokens(self, remaining=None):
        return remaining


def test_a_call_the_target_decodes_alone_never_runs_the_draft_model(tiny_target, tiny_perturbed, prompt_ids):
    """The draft reads the prompt only before its first proposal: where speculation
    does not pay, a call costs what target-only decoding does."""
    from speculative.drafters import ModelDrafter

    passes = []
    hook = tiny_perturbed.model.register_forward_hook(lambda *args: passes.append(1))
    try:
        generator = SpeculativeGenerator(tiny_target, ModelDrafter(tiny_perturbed))
        params = SamplingParams(max_new_tokens=12)
        result = generator.generate(prompt_ids[0], params, k=_Solo())
        assert result.token_ids == SpeculativeGenerator(tiny_target).generate(prompt_ids[0], params, k=0).token_ids
        assert passes == [] and result.stats.num_streamed == 12
        generator.generate(prompt_ids[0], params, k=4)
        assert passes  # a drafting call still runs it
    finally:
        hook.remove()


class _FirstLook(AdaptiveK):
    """Records whether it had costs to decide with at each decision."""

    def __init__(self, max_k):
        super().__init__(max_k)
        self.looks = []

    def solo_tokens(self, remaining=None):
        self.looks.append(self.measured)
        return super().solo_tokens(remaining)


def test_in_process_calls_seed_the_next_calls_costs(tiny_target, prompt_ids):
    generator = SpeculativeGenerator(tiny_target, NgramDrafter())
    params = SamplingParams(max_new_tokens=12)
    first, second = _FirstLook(4), _FirstLook(4)
    generator.generate(prompt_ids[0], params, k=first)
    assert generator.measured_costs is not None and generator.measured_costs.one_token_ns > 0
    generator.generate(prompt_ids[1], params, k=second)
    assert first.looks[0] is False and second.looks[0] is True


def test_a_long_stretch_refines_c1_without_erasing_the_slope():
    """64 tokens decoded alone (213 ms each, in process) after passes over 2-5 tokens
    that cost 130 ms a token more each: c(1) follows the tokens, the slope stays."""
    passes = [_round(w - 1, w - 1, 213.0 + 130.0 * (w - 1), draft_ms=100.0 * (w - 1)) for w in (2, 3, 4, 5)]
    policy = _settled(AdaptiveK(8), passes, times=5)
    for _ in range(64):
        policy.observe(*_streamed(213.0))
    assert policy.one_token_ns == pytest.approx(213 * MS, rel=0.07)
    assert policy.per_token_ns == pytest.approx(130 * MS, rel=0.1)


def test_decoding_alone_costs_what_its_stretches_measured():
    """Through the services (Qwen2.5-Coder 0.5B -> 1.5B chat, loopback): a stretch came
    285 ms a token; then rounds of k = 2, 2, 3, every draft accepted, verified in 342,
    304 and 422 ms. The line through those passes puts c(1) near 200 ms, yet decoding
    alone still costs the 285 ms measured, and k = 3 at 94% leads it: no hand-off."""
    policy = AdaptiveK(8)
    policy.observe(*_round(2, 2, 308.0, overhead_ms=5.0, draft_ms=239.0))
    assert policy.solo_tokens(remaining=61) == 8  # c(1) not measured yet: a stretch measures it
    policy.observe_stretch(8, (8 * 285 + 300) * MS, 285 * MS)
    for k, draft_ms, compute_ms in [(2, 216.0, 342.0), (2, 227.0, 304.0), (3, 555.0, 422.0)]:
        assert policy.solo_tokens(remaining=50) == 0
        policy.observe(*_round(k, k, compute_ms, overhead_ms=3.0, draft_ms=draft_ms))
    assert policy.solo_cost_ns() == 285 * MS and policy.one_token_ns < 240 * MS
    assert policy.solo_tokens(remaining=43) == 0


def test_a_stretch_that_came_out_slow_is_measured_again():
    """Empty rounds cost c(1) + R = 46 + 3 ms (48.7 ms a token: the prior share of
    proposing turns has not quite decayed); the one stretch measured came out slow (57
    ms a token, a burst of load), so rounds win and s would never be measured again.
    Once the rounds since it took long enough that a first_solo stretch risks at most
    5% of their time (its start, 4 ms, and 8 tokens at 57 - 48.7 ms: 70 ms, so
    0.05 x n x 49 ms >= 70 ms from n = 29 rounds), one re-measures s; aged by those 29
    rounds, the old sample weighs 0.9^30 = 4%: s = 46.5 ms, and decoding alone wins."""
    policy = _settled(AdaptiveK(4), [_round(0, 0, 46.0, overhead_ms=3.0)], times=30)
    policy.observe_stretch(8, (8 * 57 + 4) * MS, 57 * MS)
    turns = []
    while len(turns) < 100 and not (turns and turns[-1]):
        turns.append(policy.tokens_instead_of_empty_round(1000))
        if not turns[-1]:
            policy.observe(*_round(0, 0, 46.0, overhead_ms=3.0))
    assert (len(turns) - 1, turns[-1]) == (29, 8)
    policy.observe_stretch(8, (8 * 46 + 4) * MS, 46 * MS)
    assert policy.solo_cost_ns() == pytest.approx(46.5 * MS, rel=0.01)
    assert policy.tokens_instead_of_empty_round(1000) > 0


# Under load: the target batches B sessions per step, a step of T tokens costing about
# base + per_token * T (what SmolLM2-135M fp32 on 2 cores measured: 40 ms + 0.9 ms a token).


def _loaded_round(num_drafted, num_accepted, sessions, base_ms=40.0, per_token_ms=0.9):
    stats, elapsed = _round(num_drafted, num_accepted, base_ms + per_token_ms * sessions * (num_drafted + 1))
    step = StepLoad(0, stats.target_compute_ns, sessions * (num_drafted + 1), sessions, sessions,
                    base_ms * MS, per_token_ms * MS)
    return dataclasses.replace(stats, step=step), elapsed


def _worker_k(sessions, acceptance_per_4=2, base_ms=40.0, per_token_ms=0.9):
    policy = _settled(AdaptiveK(4), [_loaded_round(4, acceptance_per_4, sessions, base_ms, per_token_ms)])
    return policy.worker_k()


def test_more_sessions_per_step_never_raise_k():
    ks = [_worker_k(sessions) for sessions in (1, 2, 4, 8, 16, 32, 64)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] == 4 and ks[-1] < ks[0]  # alone the cap is loose; crowded it binds


def test_higher_acceptance_never_lowers_k_under_load():
    for sessions in (1, 8, 32):
        ks = [_worker_k(sessions, accepted) for accepted in (0, 1, 2, 3, 4)]
        assert ks == sorted(ks), (sessions, ks)


def test_rejected_drafts_on_a_crowded_worker_hand_over_to_decoding_alone():
    """Drafts that are never accepted cost the batch and yield nothing: the target
    decodes alone, whatever the session's own round times would favour."""
    policy = _settled(AdaptiveK(4), [_loaded_round(1, 0, 32)])
    assert policy.worker_k() == 0
    assert policy.solo_tokens(remaining=1000) > 0


def test_without_a_reported_step_cost_the_policy_is_unchanged():
    policy = _settled(AdaptiveK(4), [_round(4, 4, 50.0)])
    assert policy.worker_k() == 4
