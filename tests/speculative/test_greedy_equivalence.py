"""Greedy speculative output equals target-only greedy output, token for token, always.

Tiny fp32 models on CPU, 20 prompts x k in {1, 2, 3, 5, 8} x five drafters. No
tolerance: one differing token fails the test.
"""

from __future__ import annotations

import pytest
import torch

from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams
from speculative.types import FinishReason
from tests.scripted_drafter import ScriptedDrafter, counting_proposals

K_VALUES = [1, 2, 3, 5, 8]
MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def references(tiny_target, prompt_ids) -> list[list[int]]:
    """Target-only greedy outputs (our plain decoding path)."""
    generator = SpeculativeGenerator(tiny_target)
    return [generator.generate(ids, GREEDY, k=0).token_ids for ids in prompt_ids]


def test_plain_decoding_matches_hugging_face_generate(tiny_target, prompt_ids, references):
    """Our target-only path is itself the reference users know."""
    for ids, reference in zip(prompt_ids[:5], references):
        input_ids = torch.tensor([ids])
        output = tiny_target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
        )
        generated = output[0, len(ids) :].tolist()
        # generate() stops at the end-of-text token; ours was told no stop tokens.
        assert generated == reference[: len(generated)]
        assert len(generated) == MAX_NEW_TOKENS or generated[-1] == tiny_target.eos_token_id


def _check_all(tiny_target, prompt_ids, references, make_drafter):
    mismatches = []
    for prompt_index, (ids, reference) in enumerate(zip(prompt_ids, references)):
        for k in K_VALUES:
            drafter = make_drafter(ids, reference)
            result = SpeculativeGenerator(tiny_target, drafter).generate(ids, GREEDY, k=k)
            if result.token_ids != reference:
                mismatches.append((prompt_index, k))
            assert result.finish_reason is FinishReason.LENGTH
            assert result.stats.num_generated_tokens == MAX_NEW_TOKENS
    assert not mismatches, f"(prompt, k) pairs whose output differs from target-only: {mismatches}"


def test_same_model_draft_accepts_everything(tiny_target, prompt_ids, references):
    drafter = ModelDrafter(tiny_target)
    _check_all(tiny_target, prompt_ids, references, lambda ids, ref: drafter)
    result = SpeculativeGenerator(tiny_target, drafter).generate(prompt_ids[0], GREEDY, k=5)
    assert result.stats.acceptance_rate == 1.0
    # 24 tokens at 6 per round (5 accepted + bonus), the last round shortened.
    assert result.stats.num_rounds == 4


def test_unrelated_draft_is_mostly_rejected(tiny_target, tiny_unrelated, prompt_ids, references):
    drafter = ModelDrafter(tiny_unrelated)
    _check_all(tiny_target, prompt_ids, references, lambda ids, ref: drafter)
    result = SpeculativeGenerator(tiny_target, drafter).generate(prompt_ids[0], GREEDY, k=4)
    assert result.stats.acceptance_rate < 0.2


@pytest.mark.parametrize("num_correct", [0, 1, 2, 4])
def test_scripted_draft_right_for_n_tokens(tiny_target, prompt_ids, references, num_correct):
    def make(ids, reference):
        return ScriptedDrafter(ids + reference, num_correct, tiny_target.vocab_size)

    _check_all(tiny_target, prompt_ids, references, make)
    # Every right token is accepted, every token after the first wrong one is not.
    drafter = make(prompt_ids[0], references[0])
    stats = SpeculativeGenerator(tiny_target, drafter).generate(prompt_ids[0], GREEDY, k=5).stats
    assert stats.drafted_per_position[4] > 0  # some rounds drafted all 5 tokens
    assert stats.accepted_per_position[num_correct:] == [0] * (5 - num_correct)
    assert stats.accepted_per_position[:num_correct] == stats.drafted_per_position[:num_correct]


def test_ngram_draft(tiny_target, prompt_ids, references):
    drafter = NgramDrafter()
    _check_all(tiny_target, prompt_ids, references, lambda ids, ref: drafter)


def test_draft_with_partial_acceptance(tiny_target, tiny_perturbed, prompt_ids, references):
    drafter = ModelDrafter(tiny_perturbed)
    _check_all(tiny_target, prompt_ids[:5], references[:5], lambda ids, ref: drafter)


def test_stop_token_ends_generation_inside_an_accepted_run(tiny_target, prompt_ids, references):
    """A stop token among accepted draft tokens cuts the round after it."""
    ids, reference = prompt_ids[0], references[0]
    stop = reference[10]
    first = reference.index(stop)
    params = GREEDY.replace(stop_token_ids=(stop,))
    result = SpeculativeGenerator(tiny_target, ModelDrafter(tiny_target)).generate(ids, params, k=8)
    assert result.token_ids == reference[: first + 1]
    assert result.finish_reason is FinishReason.STOP_TOKEN


def test_lookup_then_model_equals_target_only(tiny_target, tiny_perturbed, prompt_ids, references):
    lookup = counting_proposals(NgramDrafter())
    model = counting_proposals(ModelDrafter(tiny_perturbed))
    drafter = LookupThenModelDrafter(model, lookup)
    _check_all(tiny_target, prompt_ids, references, lambda ids, ref: drafter)
    # lookup copied somewhere, the model drafted elsewhere
    assert lookup.proposals > 0 and model.proposals > 0
