"""The cascade's gate (speculative/lookup_gate.py): prompt lookup takes a turn from the
draft model only where its measured rounds earn more; exact with the gate on and off."""

from __future__ import annotations

import dataclasses

import pytest

from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.lookup_gate import PendingGuess
from speculative.policy import AdaptiveK, FixedK
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams
from speculative.speculation_loop import Features
from speculative.stats import LookupCheck
from tests.scripted_drafter import counting_proposals
from tests.speculative.test_estimator import round_, settled

GREEDY = SamplingParams(max_new_tokens=24)


def _lookup_round(size, drafted, accepted, compute_ms, proposed=True):
    """A round lookup proposed, or a model round (3 of 4 accepted) carrying lookup's guess."""
    if proposed:
        stats, elapsed = round_(drafted, accepted, compute_ms, overhead_ms=1.0)
    else:
        stats, elapsed = round_(4, 3, 14.0, overhead_ms=1.0, draft_ms=8.0)
    check = LookupCheck(size, drafted, accepted, proposed)
    return dataclasses.replace(stats, lookup=check, lookup_turn=proposed), elapsed


def _model_rounds(accepted_of_4: int):
    """The model's rounds: 4 drafted, `accepted_of_4` accepted, c(5) = 14 ms, d = 2 ms."""
    return [round_(4, accepted_of_4, 14.0, overhead_ms=1.0, draft_ms=8.0)]


def test_a_size_whose_rounds_earn_less_than_the_models_is_refused():
    """The model earns 4 tokens a 23 ms round; lookup at size 2 brings 0.2 tokens and its
    target's token a 15 ms round (refused), at size 4 all 4 of its tokens (kept)."""
    policy = AdaptiveK(4)
    settled(
        policy,
        [
            *_model_rounds(3),
            _lookup_round(2, 4, 0, 14.0, proposed=False),
            _lookup_round(4, 4, 4, 14.0),
        ],
        times=30,
    )
    action = policy.next_action(stretches=False)
    assert action.k > 0 and action.refused_lookup == frozenset({2})
    assert action.lookup_tokens == 4  # where it takes the turn: up to the call's largest k


def test_nothing_is_refused_before_anything_is_measured_or_where_lookup_pays():
    assert AdaptiveK(4).next_action(stretches=False).refused_lookup == frozenset()
    policy = AdaptiveK(4)
    settled(policy, [*_model_rounds(1), _lookup_round(3, 4, 3, 14.0)], times=30)
    action = policy.next_action(stretches=False)
    assert action.k > 0 and action.refused_lookup == frozenset()


def test_a_guess_is_followed_across_rounds_until_the_targets_tokens_decide_it():
    """The model's round commits 2 tokens; lookup's 4-token guess matched both: still
    open. The next round's first token differs from its third: decided at 2."""
    pending = PendingGuess()
    pending.start(LookupCheck(3, 4), (5, 6, 7, 8), base_len=10)
    assert pending.follow(10, [5, 6]) is None
    pending.start(LookupCheck(2, 2), (1, 1), base_len=12)  # one guess at a time: ignored
    assert pending.follow(12, [9, 4, 4]) == LookupCheck(3, 4, accepted=2)
    pending.start(LookupCheck(2, 2), (1, 1), base_len=15)
    assert pending.follow(15, [1, 1, 3]) == LookupCheck(2, 2, accepted=2)  # all matched
    pending.start(LookupCheck(2, 2), (1, 1), base_len=18)
    assert pending.follow(30, [1]) is None  # a stretch in between: dropped
    assert pending.check is None


def test_a_refused_lookup_leaves_every_turn_to_the_model(tiny_target, tiny_perturbed, prompt_ids):
    """The gate's path runs: a cascade told to refuse every size never has lookup
    propose, and its output is still target-only's."""

    class RefuseAll(FixedK):
        def next_action(self, remaining=None, turn=None, stretches=True):
            action = super().next_action(remaining)
            return dataclasses.replace(action, refused_lookup=frozenset(range(1, 33)))

    lookup = counting_proposals(NgramDrafter())
    drafter = LookupThenModelDrafter(ModelDrafter(tiny_perturbed), lookup)
    plain = SpeculativeGenerator(tiny_target)
    for ids in prompt_ids[:6]:
        result = SpeculativeGenerator(tiny_target, drafter).generate(ids, GREEDY, k=RefuseAll(4))
        assert result.token_ids == plain.generate(ids, GREEDY, k=0).token_ids
    assert lookup.proposals == 0


@pytest.mark.parametrize("gate", [True, False])
def test_the_cascade_equals_target_only_with_the_gate_on_and_off(
    tiny_target, tiny_perturbed, prompt_ids, gate
):
    """Adaptive (where the gate decides; on tiny CPU models it may find speculation losing
    and take plain steps) and fixed k (lookup takes its turns: the path runs)."""
    lookup = counting_proposals(NgramDrafter(min_ngram=1, max_ngram=3))
    drafter = LookupThenModelDrafter(ModelDrafter(tiny_perturbed), lookup)
    features = Features(stretches=False, lookup_gate=gate)
    generator = SpeculativeGenerator(tiny_target, drafter, features=features)
    plain = SpeculativeGenerator(tiny_target)
    mismatches = [
        (index, policy)
        for index, ids in enumerate(prompt_ids)
        for policy in (AdaptiveK(8), FixedK(3))
        if generator.generate(ids, GREEDY, k=policy).token_ids
        != plain.generate(ids, GREEDY, k=0).token_ids
    ]
    assert mismatches == [] and lookup.proposals > 0
