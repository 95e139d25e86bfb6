"""Tests of the acceptance rule (speculative.rejection), in three tiers:

1. crafted cases of verify_greedy and verify_sampled with exact answers;
2. exact enumeration: the module's own rule functions (acceptance_probability,
   recovered_probs), run as repeated speculative rounds over a tiny vocabulary, give every
   emitted sequence exactly the target's autoregressive probability (with a wrong rule as a
   negative control, so the check can fail);
3. a statistical test of the real sampling path (verify_sampled with real generators),
   again with a deliberately biased sampler as a negative control.
"""

from __future__ import annotations

import bisect
import itertools
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from functools import cache

import pytest
import scipy.stats
import torch

from foundation.errors import InvalidArgument
from speculative import rejection
from speculative.rejection import (
    NextTokenKind,
    Verdict,
    acceptance_probability,
    check_draft_tokens,
    recovered_probs,
    verify_greedy,
    verify_sampled,
)
from speculative.sampling import SamplingParams, SparseProbs, logits_to_probs, make_generator

# --- crafted greedy cases ---------------------------------------------------------------

VOCAB_SIZE = 8


def _target_logits_with_argmax(target_token_ids: Sequence[int]) -> torch.Tensor:
    """[len, VOCAB_SIZE] random logits whose argmax at row i is target_token_ids[i]."""
    generator = torch.Generator().manual_seed(len(target_token_ids))
    logits = torch.randn(len(target_token_ids), VOCAB_SIZE, generator=generator)
    for row, token_id in enumerate(target_token_ids):
        logits[row, token_id] = logits[row].max() + 1.0
    return logits


def test_greedy_all_accepted_gives_bonus():
    target_logits = _target_logits_with_argmax([3, 5, 1, 7])
    draft_token_ids = [3, 5, 1]
    verdict = verify_greedy(draft_token_ids, target_logits)
    assert verdict == Verdict(3, 7, NextTokenKind.BONUS)
    assert verdict.committed_tokens(draft_token_ids) == [3, 5, 1, 7]


def test_greedy_first_rejected_recovers_the_target_argmax():
    target_logits = _target_logits_with_argmax([3, 5, 1, 7])
    draft_token_ids = [4, 5, 1]
    verdict = verify_greedy(draft_token_ids, target_logits)
    assert verdict == Verdict(0, 3, NextTokenKind.RECOVERED)
    assert verdict.committed_tokens(draft_token_ids) == [3]


def test_greedy_middle_rejection():
    target_logits = _target_logits_with_argmax([3, 5, 1, 7])
    draft_token_ids = [3, 2, 1]  # the third draft token matches but comes after a rejection
    verdict = verify_greedy(draft_token_ids, target_logits)
    assert verdict == Verdict(1, 5, NextTokenKind.RECOVERED)
    assert verdict.committed_tokens(draft_token_ids) == [3, 5]
    verdict = verify_greedy([3, 5, 0], target_logits)
    assert verdict == Verdict(2, 1, NextTokenKind.RECOVERED)


def test_greedy_k0_is_a_plain_step():
    target_logits = _target_logits_with_argmax([6])
    verdict = verify_greedy([], target_logits)
    assert verdict == Verdict(0, 6, NextTokenKind.BONUS)
    assert verdict.committed_tokens([]) == [6]


def test_greedy_ties_take_the_first_index():
    target_logits = torch.zeros(2, VOCAB_SIZE)
    target_logits[0, [2, 4]] = 1.0
    assert verify_greedy([4], target_logits) == Verdict(0, 2, NextTokenKind.RECOVERED)
    assert verify_greedy([2], target_logits) == Verdict(1, 0, NextTokenKind.BONUS)


def test_check_draft_tokens():
    check_draft_tokens([], VOCAB_SIZE)
    check_draft_tokens([0, VOCAB_SIZE - 1], VOCAB_SIZE)
    with pytest.raises(InvalidArgument) as error:
        check_draft_tokens([1, VOCAB_SIZE], VOCAB_SIZE)
    assert str(VOCAB_SIZE) in str(error.value) and "position 1" in str(error.value)
    with pytest.raises(InvalidArgument):
        check_draft_tokens([-1], VOCAB_SIZE)


# --- crafted sampled cases --------------------------------------------------------------


def _random_target_probs(num_positions: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_positions, vocab_size, generator=generator)
    return logits_to_probs(logits, SamplingParams(temperature=1.0))


def test_draft_token_with_target_prob_zero_is_always_rejected():
    target_probs = _random_target_probs(3, 6, seed=0)
    target_probs[0, 2] = 0.0
    target_probs[0] /= target_probs[0].sum()
    # The draft put most of its mass on token 2, which the target never emits.
    draft_probs = [
        SparseProbs(torch.tensor([2, 0, 5]), torch.tensor([0.7, 0.2, 0.1])),
        SparseProbs.one_hot(1),
    ]
    residual = recovered_probs(target_probs[0], draft_probs[0].to_dense(6))
    seen = set()
    for seed in range(300):
        verdict = verify_sampled([2, 1], draft_probs, target_probs, make_generator(seed))
        assert verdict.num_accepted == 0
        assert verdict.next_token_kind is NextTokenKind.RECOVERED
        assert verdict.next_token_id != 2
        assert residual[verdict.next_token_id] > 0  # drawn from the residual's support
        seen.add(verdict.next_token_id)
    assert seen == set(torch.nonzero(residual).flatten().tolist())


def test_draft_identical_to_target_accepts_everything():
    k = 4
    full = _random_target_probs(k + 1, 7, seed=1)
    draft_probs = [SparseProbs.truncate(row, 4) for row in full[:k]]
    # The target at the draft positions is exactly the draft's (sparse) distribution.
    target_probs = torch.stack([*(d.to_dense(7) for d in draft_probs), full[k]])
    draft_generator = make_generator(99)
    for seed in range(20):
        draft_token_ids = [
            d.sample(float(torch.rand(1, generator=draft_generator, dtype=torch.float64)))
            for d in draft_probs
        ]
        verdict = verify_sampled(draft_token_ids, draft_probs, target_probs, make_generator(seed))
        assert verdict.num_accepted == k
        assert verdict.next_token_kind is NextTokenKind.BONUS
        assert full[k, verdict.next_token_id] > 0


def test_draft_token_with_draft_prob_zero_raises():
    target_probs = _random_target_probs(3, 6, seed=2)
    draft_probs = [
        SparseProbs(torch.tensor([1, 2]), torch.tensor([0.5, 0.5])),
        SparseProbs.one_hot(3),
    ]
    with pytest.raises(InvalidArgument) as error:
        verify_sampled([4, 3], draft_probs, target_probs, make_generator(0))
    assert "position 0" in str(error.value)
    # At position 1, behind a draft token the target surely accepts (it agrees with the
    # one-hot draft there).
    draft_probs = [
        SparseProbs.one_hot(3),
        SparseProbs(torch.tensor([1, 2]), torch.tensor([0.5, 0.5])),
    ]
    target_probs[0] = SparseProbs.one_hot(3).to_dense(6)
    with pytest.raises(InvalidArgument) as error:
        verify_sampled([3, 4], draft_probs, target_probs, make_generator(0))
    assert "position 1" in str(error.value)
    # A token listed in the support with probability exactly 0 is just as impossible.
    draft_probs = [SparseProbs(torch.tensor([3, 4]), torch.tensor([1.0, 0.0]))]
    with pytest.raises(InvalidArgument):
        verify_sampled([4], draft_probs, target_probs[:2], make_generator(0))


@pytest.mark.parametrize(
    ("case", "expected_num_accepted"),
    [("all_accepted", 3), ("first_rejected", 0), ("k0", 0)],
)
def test_exactly_k_plus_1_uniforms_per_call(case, expected_num_accepted):
    vocab_size = 6
    full = _random_target_probs(4, vocab_size, seed=3)
    draft_probs = [SparseProbs.one_hot(token_id) for token_id in (1, 2, 3)]
    target_probs = full.clone()
    if case == "all_accepted":  # the target agrees with the one-hot draft
        target_probs[:3] = torch.stack([d.to_dense(vocab_size) for d in draft_probs])
        draft_token_ids = [1, 2, 3]
    elif case == "first_rejected":  # the target never emits the first draft token
        target_probs[0, 1] = 0.0
        draft_token_ids = [1, 2, 3]
    else:
        draft_token_ids, draft_probs, target_probs = [], [], full[:1]
    k = len(draft_token_ids)
    for seed in range(5):
        generator, reference = make_generator(seed), make_generator(seed)
        verdict = verify_sampled(draft_token_ids, draft_probs, target_probs, generator)
        assert verdict.num_accepted == expected_num_accepted
        torch.rand(k + 1, generator=reference, dtype=torch.float64)
        assert torch.equal(generator.get_state(), reference.get_state())
        assert torch.equal(
            torch.rand(3, generator=generator, dtype=torch.float64),
            torch.rand(3, generator=reference, dtype=torch.float64),
        )


def test_seeds_reproduce_a_sequence_of_verdicts():
    vocab_size, k = 6, 3
    world = _World(seed=5, vocab_size=vocab_size, draft_support=3)

    def run(seed: int) -> list[Verdict]:
        generator, draft_generator = make_generator(seed), make_generator(seed + 10_000)
        return [
            _round(world, (), k, generator, draft_generator, verify_sampled)[1] for _ in range(60)
        ]

    first = run(7)
    assert run(7) == first
    assert run(8) != first
    assert len({(v.num_accepted, v.next_token_kind) for v in first}) > 1  # a mix of outcomes


# --- a world of target and draft distributions conditioned on the context ---------------


class _World:
    """Target distributions target(context) and sparse draft distributions draft(context),
    each a deterministic function of (seed, context): a stand-in for a target and a draft
    model. The target is top-k limited, so some tokens have target probability 0; the draft
    is truncated to its `draft_support` most likely tokens, as the real drafter does."""

    def __init__(self, seed: int, vocab_size: int, draft_support: int):
        self.seed = seed
        self.vocab_size = vocab_size
        self.draft_support = draft_support
        self.target = cache(self._target)
        self.draft = cache(self._draft)
        self.target64 = cache(self._target64)
        self.draft64 = cache(self._draft64)
        self.draft_cdf = cache(self._draft_cdf)
        self.stacked_target = cache(self._stacked_target)

    def _logits(self, context: tuple[int, ...], role: str) -> torch.Tensor:
        key = zlib.crc32(repr((self.seed, role, context)).encode())
        generator = torch.Generator().manual_seed(key)
        return torch.randn(1, self.vocab_size, generator=generator) * 1.5

    def _target(self, context: tuple[int, ...]) -> torch.Tensor:
        """[vocab_size] float32, what the target service verifies against."""
        params = SamplingParams(temperature=1.0, top_k=self.vocab_size - 1)
        return logits_to_probs(self._logits(context, "target"), params)[0]

    def _draft(self, context: tuple[int, ...]) -> SparseProbs:
        """What the draft samples its token from at this context: a noisy copy of the
        target's logits, so the two partly agree, as a small draft model does."""
        logits = self._logits(context, "target") + self._logits(context, "draft")
        full = logits_to_probs(logits, SamplingParams(temperature=1.0))
        return SparseProbs.truncate(full[0], self.draft_support)

    def _target64(self, context: tuple[int, ...]) -> torch.Tensor:
        target = self.target(context).double()
        return target / target.sum()

    def _draft64(self, context: tuple[int, ...]) -> torch.Tensor:
        draft = self.draft(context).to_dense(self.vocab_size).double()
        return draft / draft.sum()

    def _draft_cdf(self, context: tuple[int, ...]) -> tuple[list[int], list[float]]:
        draft = self.draft(context)
        return draft.token_ids.tolist(), list(itertools.accumulate(draft.probs.double().tolist()))

    def _stacked_target(
        self, context: tuple[int, ...], draft_token_ids: tuple[int, ...]
    ) -> torch.Tensor:
        """[k + 1, vocab_size]: row i scores the position of draft token i."""
        rows = [self.target(context + draft_token_ids[:i]) for i in range(len(draft_token_ids) + 1)]
        return torch.stack(rows)

    def autoregressive_prob(self, tokens: tuple[int, ...]) -> float:
        """prod_i target(tokens[i] | tokens[:i]), in float64."""
        prob = 1.0
        for i, token_id in enumerate(tokens):
            prob *= float(self.target64(tokens[:i])[token_id])
        return prob


# --- exact enumeration ------------------------------------------------------------------

AcceptanceRule = Callable[[float, float], float]
RecoveryRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _round_outcomes(
    world: _World,
    context: tuple[int, ...],
    k: int,
    accept: AcceptanceRule,
    recover: RecoveryRule,
) -> dict[tuple[int, ...], float]:
    """The exact probability of each token tuple one speculative round commits."""
    outcomes: dict[tuple[int, ...], float] = defaultdict(float)

    def walk(draft_token_ids: tuple[int, ...], prob: float) -> None:
        target_probs = world.target64(context + draft_token_ids)
        if len(draft_token_ids) == k:  # every draft token accepted: the bonus token
            for bonus, target_prob in enumerate(target_probs.tolist()):
                outcomes[draft_token_ids + (bonus,)] += prob * target_prob
            return
        draft_probs = world.draft64(context + draft_token_ids)
        residual = recover(target_probs, draft_probs).tolist()
        for token_id in torch.nonzero(draft_probs).flatten().tolist():  # the draft proposes
            draft_prob = float(draft_probs[token_id])
            accepted = accept(float(target_probs[token_id]), draft_prob)
            if accepted > 0.0:
                walk(draft_token_ids + (token_id,), prob * draft_prob * accepted)
            for recovered, residual_prob in enumerate(residual):
                outcomes[draft_token_ids + (recovered,)] += (
                    prob * draft_prob * (1.0 - accepted) * residual_prob
                )

    walk((), 1.0)
    return outcomes


def _enumerate_generation(
    world: _World,
    k: int,
    length: int,
    accept: AcceptanceRule = acceptance_probability,
    recover: RecoveryRule = recovered_probs,
) -> dict[tuple[int, ...], float]:
    """Exact probability of each sequence of `length` emitted tokens when rounds of k draft
    tokens run from an empty prefix until `length` tokens are out."""
    return _enumerate_rounds(
        lambda context: _round_outcomes(world, context, k, accept, recover), length
    )


def _enumerate_rounds(
    round_outcomes: Callable[[tuple[int, ...]], dict[tuple[int, ...], float]], length: int
) -> dict[tuple[int, ...], float]:
    """Exact probability of each sequence of `length` emitted tokens when rounds, each
    committing what round_outcomes(context) gives with its probability, run from an empty
    prefix (the last round's extra tokens cut off). A dynamic programme over the
    committed prefix."""
    finished: dict[tuple[int, ...], float] = defaultdict(float)
    pending: dict[tuple[int, ...], float] = {(): 1.0}
    while pending:
        next_pending: dict[tuple[int, ...], float] = defaultdict(float)
        for context, prob in pending.items():
            for committed, round_prob in round_outcomes(context).items():
                tokens = (context + committed)[:length]
                (finished if len(tokens) == length else next_pending)[tokens] += prob * round_prob
        pending = next_pending
    return finished


def _max_error(world: _World, enumerated: dict[tuple[int, ...], float], length: int) -> float:
    sequences = [()]
    for _ in range(length):
        sequences = [s + (t,) for s in sequences for t in range(world.vocab_size)]
    assert set(enumerated) <= set(sequences)
    return max(abs(enumerated.get(s, 0.0) - world.autoregressive_prob(s)) for s in sequences)


ENUMERATION_VOCAB_SIZE, ENUMERATION_DRAFT_SUPPORT, ENUMERATION_LENGTH = 5, 3, 3


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_exact_enumeration_matches_the_target(k, seed):
    world = _World(seed, ENUMERATION_VOCAB_SIZE, ENUMERATION_DRAFT_SUPPORT)
    enumerated = _enumerate_generation(world, k, ENUMERATION_LENGTH)
    assert sum(enumerated.values()) == pytest.approx(1.0, abs=1e-9)
    assert _max_error(world, enumerated, ENUMERATION_LENGTH) < 1e-6


def test_exact_enumeration_world_is_nontrivial():
    # The draft disagrees with the target (rejections happen) and some tokens have target
    # probability 0 (the always-reject path is exercised).
    world = _World(0, ENUMERATION_VOCAB_SIZE, ENUMERATION_DRAFT_SUPPORT)
    assert float((world.target64(()) == 0).sum()) == 1
    assert float((world.draft64(()) > 0).sum()) == ENUMERATION_DRAFT_SUPPORT
    overlap = float(torch.minimum(world.target64(()), world.draft64(())).sum())
    assert 0.1 < overlap < 0.95


def _recover_from_target(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """WRONG on purpose: resamples from the target instead of the residual."""
    return target_probs


def _accept_with_target_prob(target_prob: float, draft_prob: float) -> float:
    """WRONG on purpose: accepts with probability target_prob, ignoring the draft."""
    return target_prob


@pytest.mark.parametrize("wrong_rule", ["recover_from_target", "accept_with_target_prob"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_exact_enumeration_rejects_a_wrong_rule(wrong_rule, k):
    """Negative control: the enumeration is sharp enough to see a plausible mistake."""
    world = _World(0, ENUMERATION_VOCAB_SIZE, ENUMERATION_DRAFT_SUPPORT)
    if wrong_rule == "recover_from_target":
        enumerated = _enumerate_generation(
            world, k, ENUMERATION_LENGTH, recover=_recover_from_target
        )
    else:
        enumerated = _enumerate_generation(
            world, k, ENUMERATION_LENGTH, accept=_accept_with_target_prob
        )
    assert sum(enumerated.values()) == pytest.approx(1.0, abs=1e-9)  # still a distribution
    assert _max_error(world, enumerated, ENUMERATION_LENGTH) > 1e-3


# --- statistical test of the real sampling path -----------------------------------------

Verifier = Callable[[Sequence[int], Sequence[SparseProbs], torch.Tensor, torch.Generator], Verdict]


def _round(
    world: _World,
    context: tuple[int, ...],
    k: int,
    generator: torch.Generator,
    draft_generator: torch.Generator,
    verify: Verifier,
) -> tuple[list[int], Verdict]:
    """One round as the services run it: the draft samples k tokens from its sparse
    distributions, the target verifies them with the request's generator."""
    draft_token_ids: list[int] = []
    draft_probs: list[SparseProbs] = []
    uniforms = torch.rand(k, generator=draft_generator, dtype=torch.float64).tolist()
    for uniform in uniforms:
        probs = world.draft(context + tuple(draft_token_ids))
        token_ids, cdf = world.draft_cdf(context + tuple(draft_token_ids))
        # The draft's own inverse-CDF draw, in plain Python (the draft's sampler is not under
        # test here, and this keeps the many rounds below fast).
        draft_token_ids.append(
            token_ids[min(bisect.bisect_right(cdf, uniform * cdf[-1]), len(cdf) - 1)]
        )
        draft_probs.append(probs)
    target_probs = world.stacked_target(context, tuple(draft_token_ids))
    return draft_token_ids, verify(draft_token_ids, draft_probs, target_probs, generator)


def _generate(world: _World, k: int, length: int, num_runs: int, seed: int, verify: Verifier):
    """`num_runs` independent generations of `length` tokens, each by repeated rounds."""
    generator, draft_generator = make_generator(seed), make_generator(seed + 1)
    sequences = []
    for _ in range(num_runs):
        tokens: tuple[int, ...] = ()
        while len(tokens) < length:
            draft_token_ids, verdict = _round(world, tokens, k, generator, draft_generator, verify)
            tokens += tuple(verdict.committed_tokens(draft_token_ids))
        sequences.append(tokens[:length])
    return sequences


def _chisquare_pvalue(observed: Counter, expected_probs: dict) -> float:
    """Goodness of fit of the observed counts to expected_probs (cell -> probability).

    An observation in a cell of probability 0 is impossible under the hypothesis: p = 0.
    Cells expected fewer than 5 times are pooled, so the chi-square approximation holds."""
    total = sum(observed.values())
    if any(expected_probs.get(cell, 0.0) == 0.0 for cell in observed):
        return 0.0
    norm = sum(expected_probs.values())
    cells = sorted(
        (total * p / norm, observed[cell]) for cell, p in expected_probs.items() if p > 0
    )
    pooled_expected, pooled_observed = 0.0, 0
    while cells and (cells[0][0] < 5 or 0 < pooled_expected < 5):
        expected, count = cells.pop(0)
        pooled_expected, pooled_observed = pooled_expected + expected, pooled_observed + count
    if pooled_expected:
        cells.append((pooled_expected, pooled_observed))
    f_exp = [e for e, _ in cells]
    f_obs = [o for _, o in cells]
    return float(scipy.stats.chisquare(f_obs, f_exp).pvalue)


# Under an exact sampler each p-value below is (up to the chi-square approximation)
# uniform on [0, 1], so one test fails with probability ALPHA = 1e-4 and the pair with at
# most 2e-4. The seed is fixed, so the test is deterministic: it either always passes or,
# with a broken sampler, always fails.
ALPHA = 1e-4
STAT_VOCAB_SIZE, STAT_K, STAT_DRAFT_SUPPORT, STAT_NUM_RUNS, STAT_SEED = 6, 2, 3, 20_000, 2024


def _first_and_pair_pvalues(verify: Verifier, num_runs: int = STAT_NUM_RUNS) -> tuple[float, float]:
    world = _World(STAT_SEED, STAT_VOCAB_SIZE, STAT_DRAFT_SUPPORT)
    sequences = _generate(world, STAT_K, 2, num_runs, STAT_SEED, verify)
    vocab = range(STAT_VOCAB_SIZE)
    # The first emitted token against target(. | ()).
    first = _chisquare_pvalue(
        Counter(s[0] for s in sequences), {a: float(world.target64(())[a]) for a in vocab}
    )
    # The pair against target(a | ()) * target(b | (a,)): the second token follows the target
    # given the first, whether it came in the same round (accepted first token) or the next.
    pair = _chisquare_pvalue(
        Counter(sequences),
        {(a, b): world.autoregressive_prob((a, b)) for a in vocab for b in vocab},
    )
    return first, pair


def test_verify_sampled_follows_the_target_distribution():
    first, pair = _first_and_pair_pvalues(verify_sampled)
    assert first >= ALPHA, first
    assert pair >= ALPHA, pair


def _verify_always_accepting(draft_token_ids, draft_probs, target_probs, generator) -> Verdict:
    """WRONG on purpose: accepts every draft token, then draws the bonus token as the real
    rule would (one uniform per position, the bonus from the last target row)."""
    k = len(draft_token_ids)
    bonus_verdict = verify_sampled([], [], target_probs[k:], generator)
    torch.rand(k, generator=generator, dtype=torch.float64)  # keep k + 1 draws per round
    return Verdict(k, bonus_verdict.next_token_id, NextTokenKind.BONUS)


def test_biased_sampler_fails_the_same_test():
    """Negative control: the statistical test has the power to catch a broken rule."""
    first, pair = _first_and_pair_pvalues(_verify_always_accepting)
    assert first < ALPHA, first
    assert pair < ALPHA, pair


def test_recovering_from_the_target_fails_the_same_test(monkeypatch):
    """Negative control with a subtler mistake inside the real verify_sampled: the recovered
    token drawn from the target instead of the residual. A quarter of the runs suffice."""
    monkeypatch.setattr(rejection, "recovered_probs", _recover_from_target)
    first, pair = _first_and_pair_pvalues(verify_sampled, STAT_NUM_RUNS // 4)
    assert first < ALPHA, first
    assert pair < ALPHA, pair
