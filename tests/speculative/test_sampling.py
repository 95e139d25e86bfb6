"""Unit tests of speculative.sampling: parameters, logits processing, inverse-CDF sampling,
sparse draft distributions and per-request generators. Crafted inputs, exact answers."""

from __future__ import annotations

import math
import re

import pytest
import torch

from foundation.errors import InvalidArgument
from foundation.limits import MAX_SPECULATIVE_TOKENS, validate_num_speculative_tokens
from speculative.sampling import (
    SamplingParams,
    SparseProbs,
    greedy_tokens,
    logits_to_probs,
    make_generator,
    sample_from,
)

# --- SamplingParams.validate ------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", -1e-12),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.0000001),
        ("top_p", 2.0),
        ("top_p", -0.5),
        ("top_p", float("nan")),
        ("max_new_tokens", 0),
        ("max_new_tokens", -1),
        ("seed", -1),
        ("seed", 2**63),
        ("stop_token_ids", (2, -1)),
    ],
)
def test_validate_rejects_bad_value_naming_the_field(field, value):
    params = SamplingParams(temperature=1.0).replace(**{field: value})
    with pytest.raises(InvalidArgument) as error:
        params.validate()
    assert field in str(error.value)


def test_validate_accepts_defaults_and_good_values():
    defaults = SamplingParams()
    assert defaults.validate() is defaults
    assert defaults.greedy
    good = SamplingParams(
        temperature=0.7, top_k=50, top_p=0.9, seed=0, max_new_tokens=1, stop_token_ids=(0, 2)
    )
    assert good.validate() is good
    assert not good.greedy
    # The boundary values of each range are valid.
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=2**63 - 1).validate()


def test_invalid_argument_is_a_value_error():
    # Callers outside the services may catch ValueError.
    with pytest.raises(ValueError):
        SamplingParams(top_k=-3).validate()


# --- validate_num_speculative_tokens ----------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, MAX_SPECULATIVE_TOKENS])
def test_num_speculative_tokens_in_range(k):
    assert validate_num_speculative_tokens(k) == k


@pytest.mark.parametrize("k", [-1, MAX_SPECULATIVE_TOKENS + 1])
def test_num_speculative_tokens_out_of_range(k):
    with pytest.raises(InvalidArgument) as error:
        validate_num_speculative_tokens(k)
    assert re.search(r"\bk\b", str(error.value))


# --- logits_to_probs --------------------------------------------------------------------


def _random_logits(num_positions: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_positions, vocab_size, generator=generator) * 3.0


def test_temperature_matches_softmax_exactly():
    logits = _random_logits(4, 17, seed=0)
    for temperature in (0.3, 1.0, 2.5):
        target_probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
        assert target_probs.dtype == torch.float32
        assert torch.equal(target_probs, torch.softmax(logits / temperature, dim=-1))


def test_half_precision_logits_are_processed_in_fp32():
    logits = _random_logits(2, 9, seed=1).half()
    target_probs = logits_to_probs(logits, SamplingParams(temperature=0.8))
    assert target_probs.dtype == torch.float32
    assert torch.equal(target_probs, torch.softmax(logits.float() / 0.8, dim=-1))


@pytest.mark.parametrize("top_k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_k_tokens_and_renormalises(top_k):
    logits = _random_logits(6, 10, seed=2)
    assert all(len(set(row.tolist())) == 10 for row in logits)  # distinct logits
    temperature = 0.9
    target_probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k))
    for row_logits, row_probs in zip(logits, target_probs):
        kept = set(torch.nonzero(row_probs).flatten().tolist())
        top = torch.topk(row_logits, top_k).indices
        assert kept == set(top.tolist())
        expected = torch.softmax(row_logits[top] / temperature, dim=-1)
        torch.testing.assert_close(row_probs[top], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(target_probs.sum(-1), torch.ones(6), rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_k", [10, 11, 1000])
def test_top_k_at_or_above_vocab_size_is_a_no_op(top_k):
    logits = _random_logits(3, 10, seed=3)
    with_top_k = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
    assert torch.equal(with_top_k, logits_to_probs(logits, SamplingParams(temperature=1.0)))


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log().float()


@pytest.mark.parametrize(
    ("top_p", "num_kept"),
    # mass: 0.5, 0.75, 0.9, 1.0 -- each top_p sits well inside one interval.
    [(0.3, 1), (0.5 - 1e-3, 1), (0.6, 2), (0.8, 3), (0.95, 4), (0.999, 4)],
)
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, num_kept):
    logits = _probs_logits([0.15, 0.5, 0.1, 0.25])  # sorted order: 1, 3, 0, 2
    target_probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))[0]
    kept = [1, 3, 0, 2][:num_kept]
    assert set(torch.nonzero(target_probs).flatten().tolist()) == set(kept)
    full = torch.tensor([0.15, 0.5, 0.1, 0.25])
    expected = torch.zeros(4)
    expected[kept] = full[kept] / full[kept].sum()
    torch.testing.assert_close(target_probs, expected, rtol=0, atol=1e-6)


def test_top_p_matches_a_float64_reference_on_random_rows():
    logits = _random_logits(50, 12, seed=4)
    for top_p in (0.2, 0.55, 0.9):
        target_probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        full = torch.softmax(logits.double(), dim=-1)
        for row_full, row_probs in zip(full, target_probs):
            sorted_probs, order = torch.sort(row_full, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=0)
            num_kept = int((cumulative < top_p).sum()) + 1  # smallest prefix reaching top_p
            kept = order[:num_kept]
            assert set(torch.nonzero(row_probs).flatten().tolist()) == set(kept.tolist())
            expected = row_full[kept] / row_full[kept].sum()
            torch.testing.assert_close(row_probs[kept].double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_p", [1e-9, 1e-3])
def test_tiny_top_p_keeps_only_the_argmax(top_p):
    logits = _random_logits(5, 8, seed=5)
    target_probs = logits_to_probs(logits, SamplingParams(temperature=1.3, top_p=top_p))
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 8).float()
    assert torch.equal(target_probs, expected)


def test_top_p_keeps_the_argmax_of_a_dominant_token():
    # The argmax alone holds more than top_p: exactly one token survives.
    logits = _probs_logits([0.02, 0.95, 0.03])
    target_probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.equal(target_probs, torch.tensor([[0.0, 1.0, 0.0]]))


def test_top_k_then_top_p_combined():
    # top_k=3 keeps 0.4, 0.3, 0.2 (renormalised: 4/9, 3/9, 2/9); top_p=0.6 then keeps the
    # first two (4/9 < 0.6 <= 7/9): 4/7 and 3/7.
    logits = _probs_logits([0.05, 0.4, 0.2, 0.05, 0.3])
    target_probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    expected = torch.tensor([[0.0, 4 / 7, 0.0, 0.0, 3 / 7]])
    torch.testing.assert_close(target_probs, expected, rtol=0, atol=1e-6)
    # At top_p=0.8 the mass before the third top-k token is 7/9 < 0.8: all three stay.
    target_probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    expected = torch.tensor([[0.0, 4 / 9, 2 / 9, 0.0, 3 / 9]])
    torch.testing.assert_close(target_probs, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.05),
        SamplingParams(temperature=7.0, top_k=3),
        SamplingParams(temperature=0.6, top_p=0.7),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.95),
    ],
)
def test_rows_sum_to_one(params):
    logits = _random_logits(32, 64, seed=6)
    target_probs = logits_to_probs(logits, params)
    assert target_probs.shape == logits.shape
    assert bool((target_probs >= 0).all())
    torch.testing.assert_close(target_probs.sum(-1), torch.ones(32), rtol=0, atol=1e-5)


def test_greedy_params_take_the_argmax_path():
    with pytest.raises(AssertionError):
        logits_to_probs(_random_logits(1, 5, seed=7), SamplingParams())


def test_greedy_tokens_is_argmax_first_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    assert greedy_tokens(logits) == [1, 0]


# --- sample_from ------------------------------------------------------------------------

# Zeros at the start, in the middle and at the end: cdf = [0, 0, .25, .25, .75, 1, 1].
_WITH_ZEROS = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
_JUST_BELOW_ONE = math.nextafter(1.0, 0.0)


@pytest.mark.parametrize(
    ("uniform", "token_id"),
    [
        (0.0, 2),  # the first nonzero token
        (0.1, 2),
        (math.nextafter(0.25, 0.0), 2),
        (0.25, 4),  # a cdf boundary goes to the next nonzero token, never the zero at 3
        (0.5, 4),
        (math.nextafter(0.75, 0.0), 4),
        (0.75, 5),
        (0.9, 5),
        (_JUST_BELOW_ONE, 5),  # the last nonzero token, never the trailing zero
    ],
)
def test_sample_from_inverse_cdf(uniform, token_id):
    assert sample_from(_WITH_ZEROS, uniform) == token_id
    # Unnormalised weights sample the same way (the cdf is scaled by its total).
    assert sample_from(_WITH_ZEROS * 3.0, uniform) == token_id


def test_sample_from_never_picks_a_zero_probability_token():
    nonzero = set(torch.nonzero(_WITH_ZEROS).flatten().tolist())
    boundaries = [0.0, 0.25, 0.75, _JUST_BELOW_ONE]
    around = [math.nextafter(b, d) for b in (0.25, 0.75) for d in (0.0, 1.0)]
    grid = [i / 1000 for i in range(1000)]
    for uniform in boundaries + around + grid:
        assert sample_from(_WITH_ZEROS, uniform) in nonzero
        assert sample_from(_WITH_ZEROS.double(), uniform) in nonzero


def test_sample_from_float32_rows_that_do_not_sum_to_one():
    # A float32 row from a softmax sums to 1 only up to rounding; the last nonzero token is
    # still chosen for a uniform just below 1, and a one-hot row always gives its token.
    row = logits_to_probs(_random_logits(1, 11, seed=8), SamplingParams(temperature=1.0, top_k=4))[
        0
    ]
    last_nonzero = int(torch.nonzero(row).max())
    assert sample_from(row, _JUST_BELOW_ONE) == last_nonzero
    one_hot = torch.zeros(11)
    one_hot[6] = 1.0
    for uniform in (0.0, 0.5, _JUST_BELOW_ONE):
        assert sample_from(one_hot, uniform) == 6


def test_sample_from_frequencies_follow_the_probs():
    # Equally spaced uniforms: the count of each token is its probability times the count.
    counts = torch.zeros(7)
    num = 4000
    for i in range(num):
        counts[sample_from(_WITH_ZEROS, (i + 0.5) / num)] += 1
    assert torch.equal(counts, _WITH_ZEROS * num)


# --- SparseProbs ------------------------------------------------------------------------


def test_truncate_keeps_the_top_m_and_renormalises():
    draft_full = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    draft_probs = SparseProbs.truncate(draft_full, 3)
    assert draft_probs.token_ids.tolist() == [1, 3, 4]  # most likely first
    assert draft_probs.token_ids.dtype == torch.int64
    assert draft_probs.probs.dtype == torch.float32
    torch.testing.assert_close(
        draft_probs.probs, torch.tensor([0.4, 0.3, 0.15]) / 0.85, rtol=0, atol=1e-7
    )
    assert float(draft_probs.probs.sum()) == pytest.approx(1.0, abs=1e-7)


def test_truncate_never_keeps_zero_probability_tokens():
    draft_full = torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0])
    draft_probs = SparseProbs.truncate(draft_full, 4)
    assert sorted(draft_probs.token_ids.tolist()) == [1, 3]
    assert bool((draft_probs.probs > 0).all())


def test_truncate_float64_input():
    draft_full = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    draft_probs = SparseProbs.truncate(draft_full, 1)
    assert draft_probs.token_ids.tolist() == [1]
    assert draft_probs.probs.tolist() == [1.0]


def test_prob_of_and_to_dense():
    draft_probs = SparseProbs.truncate(torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]), 3)
    assert draft_probs.prob_of(1) == pytest.approx(0.4 / 0.85, abs=1e-7)
    assert draft_probs.prob_of(4) == pytest.approx(0.15 / 0.85, abs=1e-7)
    assert draft_probs.prob_of(0) == 0.0
    assert draft_probs.prob_of(2) == 0.0
    dense = draft_probs.to_dense(5)
    assert dense.dtype == torch.float32
    assert dense.shape == (5,)
    for token_id in range(5):
        assert float(dense[token_id]) == draft_probs.prob_of(token_id)
    assert dense[0] == 0 and dense[2] == 0


def test_one_hot():
    draft_probs = SparseProbs.one_hot(3)
    assert draft_probs.prob_of(3) == 1.0
    assert draft_probs.prob_of(2) == 0.0
    assert torch.equal(draft_probs.to_dense(5), torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]))
    for uniform in (0.0, 0.5, _JUST_BELOW_ONE):
        assert draft_probs.sample(uniform) == 3


def test_sparse_sample_maps_back_to_token_ids():
    draft_probs = SparseProbs(torch.tensor([7, 2, 9]), torch.tensor([0.5, 0.25, 0.25]))
    assert draft_probs.sample(0.0) == 7
    assert draft_probs.sample(0.5) == 2
    assert draft_probs.sample(0.75) == 9
    assert draft_probs.sample(_JUST_BELOW_ONE) == 9


# --- make_generator ---------------------------------------------------------------------


def test_same_seed_same_draws():
    first, second = make_generator(1234), make_generator(1234)
    assert first.device == torch.device("cpu")
    for _ in range(3):
        draws = torch.rand(5, generator=first, dtype=torch.float64)
        assert torch.equal(draws, torch.rand(5, generator=second, dtype=torch.float64))
    other = make_generator(1235)
    assert not torch.equal(
        torch.rand(5, generator=make_generator(1234)), torch.rand(5, generator=other)
    )


def test_no_seed_gives_a_random_seed():
    first, second = make_generator(None), make_generator(None)
    assert first.initial_seed() != second.initial_seed()
    assert not torch.equal(torch.rand(8, generator=first), torch.rand(8, generator=second))
    # The random seed is an ordinary seed: it reproduces the same draws.
    replay = make_generator(first.initial_seed())
    again = make_generator(first.initial_seed())
    assert torch.equal(torch.rand(8, generator=replay), torch.rand(8, generator=again))
