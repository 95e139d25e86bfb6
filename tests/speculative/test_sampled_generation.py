"""Sampling through the whole generator: seeded runs reproduce, and the output follows
the target's own distribution (a chi-square test that a wrong rule fails)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scipy.stats import chisquare

from model_runtime.step_scheduler import StepScheduler
from speculative import rejection
from speculative.drafters import ModelDrafter
from speculative.generator import LocalVerifier, SpeculativeGenerator
from speculative.policy import FixedK
from speculative.prompt_lookup import LookupRounds, LookupStop, LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams, logits_to_probs
from speculative.speculation_loop import speculation_rounds
from speculative.target import TargetSession
from tests.scripted_drafter import counting_proposals

# Each run's first three tokens are one draw from a 4 x 4 x 4 = 64-cell distribution
# (top_k=4), which the test computes exactly from the target model.
PARAMS = SamplingParams(temperature=1.0, top_k=4, max_new_tokens=3)
NUM_RUNS = 1500
# False-fail probability of the goodness-of-fit test for a correct sampler: 1e-3
# (deterministic in CI because every run is seeded; a new seed set fails 1 time in 1000).
ALPHA = 1e-3


def _exact_target_distribution(
    loaded, prompt: list[int], params: SamplingParams = PARAMS
) -> dict[tuple[int, ...], float]:
    """P(y1, ..., yn) = prod p(y_i | prompt, y_<i) for n = max_new_tokens, enumerated
    with the target model."""

    def next_probs(prefix):
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1:]
        return logits_to_probs(logits, params)[0].double()

    distribution = {(): 1.0}
    for _ in range(params.max_new_tokens):
        grown = {}
        for prefix, mass in distribution.items():
            probs = next_probs(prefix)
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        distribution = grown
    return distribution


def _chi_square_p_value(samples: Counter, exact: dict) -> float:
    """Goodness of fit; cells expected fewer than 5 times are pooled into one."""
    if set(samples) - set(exact):
        return 0.0  # a sequence the target cannot produce
    total = sum(samples.values())
    observed, expected, pooled_observed, pooled_expected = [], [], 0, 0.0
    for cell, probability in exact.items():
        if probability * total >= 5:
            observed.append(samples[cell])
            expected.append(probability * total)
        else:
            pooled_observed += samples[cell]
            pooled_expected += probability * total
    observed.append(pooled_observed)
    expected.append(pooled_expected)
    scale = total / sum(expected)  # absorbs fp32 rounding of the exact probabilities
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def _sample_runs(tiny_target, drafter, prompt, k, num_runs) -> tuple[Counter, float]:
    generator = SpeculativeGenerator(tiny_target, drafter)
    samples, drafted, accepted = Counter(), 0, 0
    for seed in range(num_runs):
        result = generator.generate(prompt, PARAMS.replace(seed=seed), k=k)
        samples[tuple(result.token_ids)] += 1
        drafted += result.stats.num_drafted
        accepted += result.stats.num_accepted
    return samples, accepted / drafted


@pytest.fixture(scope="module")
def exact(tiny_target, prompt_ids):
    return _exact_target_distribution(tiny_target, prompt_ids[0])


def test_speculative_sampling_follows_the_target_distribution(
    tiny_target, tiny_perturbed, prompt_ids, exact
):
    samples, acceptance = _sample_runs(
        tiny_target, ModelDrafter(tiny_perturbed), prompt_ids[0], 2, NUM_RUNS
    )
    assert 0.2 < acceptance < 0.9, f"the draft should be partly right, acceptance {acceptance:.2f}"
    assert _chi_square_p_value(samples, exact) > ALPHA


def test_lookup_then_model_sampling_follows_the_target_distribution(
    tiny_target, tiny_perturbed, prompt_ids
):
    """Looked-up tokens are proposed with certainty, the model's drawn from its
    distribution; the mix must still sample the target's. The prompt ends with its own
    first two tokens, so lookup proposes at the first turn (and wherever the draws go on
    copying), the model at the others."""
    prompt = prompt_ids[0] + prompt_ids[0][:2]
    lookup = counting_proposals(NgramDrafter())
    model = counting_proposals(ModelDrafter(tiny_perturbed))
    samples, acceptance = _sample_runs(
        tiny_target, LookupThenModelDrafter(model, lookup), prompt, 2, NUM_RUNS
    )
    assert lookup.proposals > 100 and model.proposals > 100
    assert 0.1 < acceptance < 0.9, f"the drafts should be partly right, acceptance {acceptance:.2f}"
    assert _chi_square_p_value(samples, _exact_target_distribution(tiny_target, prompt)) > ALPHA


def test_a_stretch_that_verifies_prompt_lookup_samples_the_target_distribution(
    tiny_bigram, prompt_ids
):
    """The target running a prompt-lookup drafter's rounds inside a stretch judges each
    looked-up token as proposed with certainty: its tokens follow its own distribution.
    The prompt ends with the target's own greedy text, which repeats, so lookup proposes
    at the first pass, often the token the target draws."""
    greedy = SpeculativeGenerator(tiny_bigram).generate(
        prompt_ids[0], SamplingParams(max_new_tokens=16), k=0
    )
    prompt = prompt_ids[0] + greedy.token_ids
    lookup = LookupRounds(LookupStop(1, 2), 2)
    samples, drafted, accepted = Counter(), 0, 0
    for seed in range(NUM_RUNS):
        target = TargetSession(tiny_bigram, prompt, PARAMS.replace(seed=seed))
        results = list(target.decode(len(prompt), PARAMS.max_new_tokens, lookup=lookup))
        samples[tuple(t for r in results for t in r.token_ids)] += 1
        drafted += sum(r.num_drafted for r in results)
        accepted += sum(r.verdict.num_accepted for r in results)
    assert drafted > NUM_RUNS and 0.1 < accepted / drafted < 0.9, (drafted, accepted)
    assert _chi_square_p_value(samples, _exact_target_distribution(tiny_bigram, prompt)) > ALPHA


def test_the_distribution_test_catches_a_biased_rule(
    tiny_target, tiny_perturbed, prompt_ids, exact, monkeypatch
):
    """Negative control: always accepting the draft token must fail the same test."""
    monkeypatch.setattr(rejection, "acceptance_probability", lambda target_prob, draft_prob: 1.0)
    samples, _ = _sample_runs(
        tiny_target, ModelDrafter(tiny_perturbed), prompt_ids[0], 2, NUM_RUNS // 3
    )
    assert _chi_square_p_value(samples, exact) < ALPHA


@pytest.mark.parametrize("drafter_name", ["perturbed", "unrelated", "ngram"])
def test_a_seed_reproduces_a_run_bit_for_bit(
    tiny_target, tiny_perturbed, tiny_unrelated, prompt_ids, drafter_name
):
    drafter = {
        "perturbed": ModelDrafter(tiny_perturbed),
        "unrelated": ModelDrafter(tiny_unrelated),
        "ngram": NgramDrafter(),
    }[drafter_name]
    generator = SpeculativeGenerator(tiny_target, drafter)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=32)
    runs = [
        generator.generate(prompt_ids[7], params.replace(seed=seed), k=3).token_ids
        for seed in (11, 11, 12)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_exact_distribution_is_a_distribution(exact):
    assert abs(sum(exact.values()) - 1.0) < 1e-6  # fp32 softmax rows
    assert len(exact) == 4**3
    assert all(len(cell) == 3 for cell in itertools.islice(exact, 5))


class _BatchedVerifier(LocalVerifier):
    """The loop's Verifier through a step scheduler: the session's passes share steps
    with every other session's."""

    def __init__(self, scheduler, target):
        super().__init__(target)
        self.scheduler = scheduler

    def _verify(self, base_len, draft_token_ids, draft_probs):
        result, step = self.scheduler.submit(
            self.target.verify_steps(base_len, draft_token_ids, draft_probs)
        )
        return dataclasses.replace(result, step=step)


def test_batched_speculative_sampling_follows_the_target_distribution(
    tiny_target, tiny_perturbed, prompt_ids, exact
):
    """The same chi-square test with 12 sessions at a time sharing the target's steps;
    and each seeded run equals the same seed's run alone, token for token."""
    prompt, drafter = prompt_ids[0], ModelDrafter(tiny_perturbed)
    scheduler = StepScheduler(tiny_target.model)
    batch_sizes = []

    def run(seed: int) -> tuple[int, ...]:
        params = PARAMS.replace(seed=seed)
        target = TargetSession(tiny_target, prompt, params, prefill=False)
        scheduler.submit(target.prefill_steps())
        tokens = []
        for result in speculation_rounds(
            _BatchedVerifier(scheduler, target),
            drafter.open(prompt, params),
            len(prompt),
            params,
            FixedK(2),
            tiny_target.context_length,
        ):
            tokens += result.token_ids
            batch_sizes.append(result.stats.step.batch_sessions)
        return tuple(tokens)

    try:
        with ThreadPoolExecutor(12) as pool:
            runs = list(pool.map(run, range(NUM_RUNS)))
    finally:
        scheduler.stop()
    assert max(batch_sizes) > 1, "sessions should have shared steps"
    assert _chi_square_p_value(Counter(runs), exact) > ALPHA
    generator = SpeculativeGenerator(tiny_target, drafter)
    for seed in range(40):
        assert (
            tuple(generator.generate(prompt, PARAMS.replace(seed=seed), k=2).token_ids)
            == runs[seed]
        )
