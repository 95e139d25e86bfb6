"""Drafters: n-gram lookup, the model drafter's proposals, and its draft lag; lookup
then model."""

from __future__ import annotations

import random

import pytest

from foundation.errors import InvalidArgument
from speculative.drafters import ModelDrafter
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter, lookup_continuation
from speculative.sampling import SamplingParams


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),  # 2-gram [1, 2] seen at 0: what followed
        ([1, 2, 3, 9, 1, 2], 1, [3]),
        ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, [7, 1]),  # the earliest occurrence wins
        ([4, 1, 2, 3, 5, 1, 2, 3], 2, [5, 1]),  # the longest suffix (3-gram) wins
        ([1, 2, 3, 4], 3, []),  # nothing repeats
        ([7, 7], 3, []),  # too short for a 2-gram match with a continuation
        ([1, 2, 1, 2], 5, [1, 2]),  # the continuation may run into the suffix itself
        ([1, 2, 3, 1, 2], 0, []),
        ([1, 9, 1, 2, 5, 1, 2], 2, [5, 1]),  # a start like the suffix's is passed over
        ([5, 1, 2], 3, []),  # the suffix itself is no earlier occurrence
    ],
)
def test_lookup_continuation(tokens, k, expected):
    assert lookup_continuation(tokens, k, min_ngram=2, max_ngram=4) == expected


def _lookup_by_definition(tokens, k, min_ngram, max_ngram):
    """Every window compared: what followed the earliest occurrence of the longest suffix."""
    for n in range(max_ngram, min_ngram - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
        if starts and k > 0:
            return tokens[starts[0] + n : starts[0] + n + k]
    return []


def test_lookup_continuation_follows_its_definition_on_random_sequences():
    rng = random.Random(21)
    for _ in range(3000):  # small vocabularies: many partial matches
        tokens = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randrange(30))]
        min_ngram = rng.randint(1, 4)
        max_ngram, k = rng.randint(min_ngram, 8), rng.randrange(5)
        assert lookup_continuation(tokens, k, min_ngram, max_ngram) == _lookup_by_definition(
            tokens, k, min_ngram, max_ngram
        ), (tokens, k, min_ngram, max_ngram)


def test_single_token_matches_when_allowed():
    assert lookup_continuation([3, 8, 4, 3], 2, min_ngram=1, max_ngram=3) == [8, 4]
    assert lookup_continuation([3, 8, 4, 3], 2, min_ngram=2, max_ngram=3) == []


def test_ngram_session_follows_verdicts():
    session = NgramDrafter().open([1, 2, 3, 4, 1, 2], SamplingParams())
    assert session.propose(2).token_ids == [3, 4]
    assert session.length == 8
    session.truncate_to(7)  # one accepted
    session.append([9])  # the recovered token
    assert session.length == 8


def test_bad_ngram_sizes():
    for sizes in [(3, 2), (0, 2), (2, 33)]:
        with pytest.raises(
            InvalidArgument, match="1 <= prompt_lookup_min <= prompt_lookup_max <= 32"
        ):
            NgramDrafter(*sizes)


def test_model_draft_lag_runs_pending_tokens_together(tiny_target, prompt_ids):
    """After a fully accepted proposal the draft's own last token and the bonus token are
    both pending and run in one pass."""
    session = ModelDrafter(tiny_target).open(prompt_ids[0], SamplingParams())
    length = session.length
    proposal = session.propose(3)
    assert session.session.cached_length == length + 2  # the last draft never ran
    session.truncate_to(length + 3)
    session.append([42])
    passes = session.session.num_forward_passes
    session.propose(1)
    assert session.session.num_forward_passes == passes + 1
    assert session.session.cached_length == length + 4
    assert len(proposal) == 3 and proposal.draft_probs is None


def test_model_draft_sampling_sends_exact_sparse_distributions(tiny_target, prompt_ids):
    session = ModelDrafter(tiny_target, draft_top_k=5).open(
        prompt_ids[0], SamplingParams(temperature=1.0, seed=3)
    )
    proposal = session.propose(4)
    assert len(proposal.draft_probs) == 4
    for token_id, probs in zip(proposal.token_ids, proposal.draft_probs):
        assert len(probs.token_ids) == 5
        assert abs(float(probs.probs.sum()) - 1.0) < 1e-6
        assert probs.prob_of(token_id) > 0


def test_lookup_then_model_copies_where_it_can_and_drafts_with_the_model_elsewhere(tiny_target):
    drafter = LookupThenModelDrafter(ModelDrafter(tiny_target), NgramDrafter())
    prompt = list(range(10, 30))  # nothing repeats: the model drafts
    session = drafter.open(prompt, SamplingParams())
    expected = ModelDrafter(tiny_target).open(prompt, SamplingParams()).propose(3).token_ids
    assert session.propose(3).token_ids == expected
    assert session.lookup.length == session.model.length == len(prompt) + 3

    session.truncate_to(len(prompt))
    session.append([12, 13])  # "12 13" occurred: lookup copies what followed
    assert session.propose(3).token_ids == [14, 15, 16]
    assert session.lookup.length == session.model.length == len(prompt) + 5

    # Two copied tokens accepted, a bonus token appended: the model runs the copied
    # tokens it never saw with its next pass, and drafts what a fresh session would.
    session.truncate_to(len(prompt) + 4)
    session.append([99])
    sequence = prompt + [12, 13, 14, 15, 99]
    expected = ModelDrafter(tiny_target).open(sequence, SamplingParams()).propose(2).token_ids
    assert session.propose(2).token_ids == expected
