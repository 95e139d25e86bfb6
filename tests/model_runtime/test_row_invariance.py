"""Row invariance (model_runtime/row_invariance.py): every row's logits are the same
bits whatever the pass (width, batch of sessions, place in it), so that greedy
speculative output equals target-only output by construction, in bf16 too.

The sharp model: `near_tied_llama` puts the top two logits within about a bf16 step at
every position, so a row that changes in its last bits flips its greedy token. Each
exactness test has its negative control: the same test with invariance off catches a
difference (it can fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foundation.errors import InvalidArgument
from model_runtime import row_invariance as ri
from model_runtime.batched_forward import Segment, SequenceKV, forward_segments
from model_runtime.loading import _describe, load_model
from model_runtime.model_session import ModelSession
from model_runtime.step_scheduler import StepScheduler
from model_runtime.tiny import byte_tokenizer, near_tied_llama
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.policy import FixedK
from speculative.prompt_lookup import NgramDrafter
from speculative.sampling import SamplingParams
from speculative.target import TargetSession
from tests.model_runtime.test_step_scheduler import _run_threads
from tests.scripted_drafter import ScriptedDrafter
from tests.speculative.test_sampled_generation import (
    ALPHA,
    NUM_RUNS,
    _chi_square_p_value,
    _exact_target_distribution,
    _sample_runs,
)

MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    """Choices measured once per test session, in a cache of its own."""
    monkeypatch.setenv(
        "SPECULATIVE_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels.json")
    )


def near_tied(dtype: torch.dtype, invariant: bool, seed: int = 0):
    model = near_tied_llama(seed).to(dtype)
    loaded = _describe(f"near-tied:{seed}", model, byte_tokenizer())
    loaded.row_invariance = ri.make_row_invariant(model) if invariant else None
    return loaded


@pytest.fixture(scope="module")
def bf16_invariant():
    return near_tied(torch.bfloat16, True)


@pytest.fixture(scope="module")
def bf16_plain():
    return near_tied(torch.bfloat16, False)


@pytest.fixture(scope="module")
def prompts(prompt_ids):
    return prompt_ids[:10]


# --- kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_rows", [1, 4, 8])
def test_blocks_compute_the_linear(block_rows):
    torch.manual_seed(0)
    weight, bias, rows = torch.randn(48, 32), torch.randn(48), torch.randn(21, 32)
    out = ri.run_in_blocks(lambda x: F.linear(x, weight, bias), rows, block_rows)
    torch.testing.assert_close(out, F.linear(rows, weight, bias))


def test_every_kernel_call_has_the_block_shape():
    shapes = []
    ri.run_in_blocks(lambda x: shapes.append(tuple(x.shape)) or x, torch.ones(21, 3), 8)
    assert shapes == [(8, 3)] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chosen_linear_gives_a_row_the_same_bits_at_every_width(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160).to(dtype)
    choice, probed = ri.measure_linear(linear)
    assert probed and choice.block_rows in ri.BLOCK_ROWS
    invariant = ri.InvariantLinear(linear, choice)
    rows = torch.randn(70, 96).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([invariant(rows[i : i + 1]) for i in range(70)])
        for width in (2, 5, 9, 17, 33, 70):
            together = torch.cat([invariant(rows[i : i + width]) for i in range(0, 70, width)])
            assert torch.equal(together, alone), (width, choice)
    assert len(choice.ms) == len(ri.TIMED_WIDTHS) and choice.cost_ratio() > 0


def _reordered_by_place(weight: torch.Tensor):
    """A kernel that sums a row's K terms in another order at the last place of a block
    than elsewhere (as a GEMM's remainder tile might): the kind of kernel the probe is for."""

    def kernel(block: torch.Tensor) -> torch.Tensor:
        out = F.linear(block, weight)
        last = block[-1:].float() * weight.float()  # [out, in] terms of the last row
        out[-1] = last.flip(-1).cumsum(-1)[:, -1].to(out.dtype)
        return out

    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_probe_passes_plain_blocks_and_catches_an_order_that_depends_on_the_place(dtype):
    generator = torch.Generator().manual_seed(0)
    linear = ri.designed_linear(torch.nn.Linear(256, 64).to(dtype), generator)
    with torch.inference_mode():
        plain = lambda x: F.linear(x, linear.weight)  # noqa: E731
        assert ri.probe_blocks(plain, 256, dtype, 8, generator)
        assert not ri.probe_blocks(_reordered_by_place(linear.weight), 256, dtype, 8, generator)


def test_random_rows_miss_what_the_designed_rows_catch():
    """The probe's power: on the same reordered kernel, random normal bf16 rows (the old
    probe's inputs) rarely show a difference after rounding; designed rows always do."""
    generator = torch.Generator().manual_seed(0)
    linear = ri.designed_linear(torch.nn.Linear(512, 64).to(torch.bfloat16), generator)
    kernel = _reordered_by_place(linear.weight)
    random_rows = torch.randn(64, 512, generator=generator).to(torch.bfloat16)
    designed = ri.designed_rows(64, 512, torch.bfloat16, generator)

    def differing(rows):  # outputs of the last place that differ from the row alone
        last = torch.stack([kernel(torch.cat([rows[:3], rows[i : i + 1]]))[-1] for i in range(64)])
        return (last != F.linear(rows, linear.weight)).float().mean().item()

    assert differing(designed) > 0.5 > 0.05 > differing(random_rows)


def test_the_designed_rows_are_finite_in_every_half_precision():
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        rows = ri.designed_rows(4, 64, dtype, generator)
        assert torch.isfinite(rows).all() and rows.abs().max() / rows.abs().min() == 2.0**26


def test_a_block_that_fails_its_probe_is_never_chosen_or_kept(monkeypatch):
    linear = torch.nn.Linear(40, 24)
    monkeypatch.setattr(ri, "probe_blocks", lambda kernel, *args: False)
    choice, probed = ri.measure_linear(linear)
    assert (choice.block_rows, probed) == (1, False)  # one row per call: alone by definition
    assert ri.choose_linear(linear).block_rows == 1
    monkeypatch.undo()
    assert ri.choose_linear(linear).block_rows in ri.BLOCK_ROWS  # not kept: measured again


def test_a_choice_is_measured_once_per_host_and_shape():
    linear = torch.nn.Linear(40, 24)
    first = ri.choose_linear(linear)
    assert ri.choose_linear(torch.nn.Linear(40, 24)) == first  # from the cache: same timings too


def test_the_modes():
    model = near_tied_llama(0)
    with pytest.raises(InvalidArgument, match="auto, on, off"):
        ri.apply_mode(model, "sometimes")
    assert ri.apply_mode(model, "off") is None and ri.invariance_of(model) is None
    invariance = ri.apply_mode(model, "on")
    assert ri.invariance_of(model) is invariance and "attention per row" in invariance.describe()
    assert not any(type(m) is torch.nn.Linear for m in model.modules())


def test_auto_is_on_for_half_precision_on_a_cpu():
    assert ri.apply_mode(near_tied_llama(0).to(torch.bfloat16), "auto") is not None
    assert ri.apply_mode(near_tied_llama(0), "auto") is None  # fp32: it costs 1.2-1.3x a step


# --- rows: a wide pass against narrow ones, through the workers' own path -------------------


def _rows_wide_and_narrow(
    model, prefix: list[int], new: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `new` after `prefix`: one pass over all of them, and one pass each."""
    wide = ModelSession(model, 1024)
    wide.append(prefix)
    wide.prefill()
    wide.append(new)
    wide_rows = wide.logits(len(new) + 1)[1:]
    narrow = ModelSession(model, 1024)
    narrow.append(prefix)
    narrow.prefill()
    narrow.logits(1)
    rows = []
    for token in new:
        narrow.append([token])
        rows.append(narrow.logits(1))
    return wide_rows, torch.cat(rows)


def _differing_rows(model, widths=(2, 5, 9, 17), prefixes=6) -> int:
    generator = torch.Generator().manual_seed(0)
    differing = 0
    for index in range(prefixes):
        prefix = torch.randint(0, 256, (20 + 7 * index,), generator=generator).tolist()
        for width in widths:
            new = torch.randint(0, 256, (width,), generator=generator).tolist()
            wide, narrow = _rows_wide_and_narrow(model, prefix, new)
            differing += int((wide != narrow).any(-1).sum())
    return differing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wide_pass_gives_every_row_the_bits_of_narrow_passes(dtype):
    assert _differing_rows(near_tied(dtype, True).model) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_check_catches_the_kernels_as_they_are(dtype):
    """Negative control: without invariance the same check finds differing rows."""
    assert _differing_rows(near_tied(dtype, False).model) > 0


def test_a_row_is_the_same_alone_and_batched_with_other_sessions(bf16_invariant):
    """Its place in the step and what else runs there change none of its bits; prefill
    chunks of other prompts included."""
    model = bf16_invariant.model
    generator = torch.Generator().manual_seed(1)

    def segment(length: int, new: int, fill: bool = False) -> Segment:
        ids = torch.randint(0, 256, (length + new,), generator=generator).tolist()
        kv = SequenceKV()
        forward_segments(model, [Segment(kv, 0, ids[:length], 0)])
        return Segment(kv, length, ids[length:], 1 if fill else new, fill=fill)

    segments = [
        segment(30, 1),
        segment(12, 5),
        segment(40, 9),
        segment(3, 60, fill=True),
        segment(25, 2),
    ]
    alone = [
        forward_segments(model, [Segment(s.kv, s.start, list(s.token_ids), s.num_logits)])[0]
        for s in segments
    ]
    batched = forward_segments(model, segments[::-1])[::-1]
    for one, other in zip(alone, batched):
        assert torch.equal(one, other)


def test_tree_rows_equal_the_chain_through_their_ancestors(bf16_invariant):
    model = bf16_invariant.model
    prefix = list(range(40, 70))
    kv = SequenceKV()
    forward_segments(model, [Segment(kv, 0, prefix[:-1], 0)])
    # the last prompt token, then a tree: 11 -> 12 -> 13, 11 -> 14, 15 -> 16
    tokens, parents = [prefix[-1], 11, 12, 13, 14, 15, 16], [-1, 0, 1, 2, 1, 0, 5]
    tree = forward_segments(model, [Segment(kv, len(prefix) - 1, tokens, 7, parents=parents)])[0]
    for node, path in ((3, [11, 12, 13]), (4, [11, 14]), (6, [15, 16])):
        chain = ModelSession(model, 1024)
        chain.append(prefix)
        chain.prefill()
        chain.logits(1)
        for token in path:
            chain.append([token])
            last = chain.logits(1)
        assert torch.equal(tree[node], last[0]), node


# --- greedy output: every drafter, k, tree width and concurrency, in bf16 -------------------


def _references(target, prompts) -> list[list[int]]:
    generator = SpeculativeGenerator(target)
    return [generator.generate(ids, GREEDY, k=0).token_ids for ids in prompts]


def _mismatches(target, prompts, drafters, k_values=(1, 2, 3, 5, 8), widths=(1,)) -> list:
    references = _references(target, prompts)
    mismatches = []
    for name, make in drafters.items():
        for k in k_values:
            for width in widths:
                for index, (ids, reference) in enumerate(zip(prompts, references)):
                    result = SpeculativeGenerator(target, make(ids, reference)).generate(
                        ids, GREEDY, FixedK(k, width)
                    )
                    if result.token_ids != reference:
                        mismatches.append((name, k, width, index))
    return mismatches


def _drafters(target):
    draft = near_tied(
        torch.bfloat16, False, seed=0
    )  # the target's weights, not invariant: a draft need not be
    model = ModelDrafter(draft)
    ngram = NgramDrafter()
    return {
        "self": lambda ids, ref: model,
        "ngram": lambda ids, ref: ngram,
        "scripted": lambda ids, ref: ScriptedDrafter(ids + ref, 2, target.vocab_size),
    }


def test_greedy_speculation_equals_target_only_in_bf16(bf16_invariant, prompts):
    assert _mismatches(bf16_invariant, prompts, _drafters(bf16_invariant)) == []


def test_greedy_token_trees_equal_target_only_in_bf16(bf16_invariant, prompts):
    ngram = NgramDrafter()
    drafters = {"ngram": lambda ids, ref: ngram}
    assert _mismatches(bf16_invariant, prompts, drafters, k_values=(3, 6), widths=(2, 4)) == []


def test_the_equality_test_catches_bf16_without_invariance(bf16_plain, prompts):
    """Negative control: the same test, invariance off, finds outputs that differ."""
    drafters = {
        name: make for name, make in _drafters(bf16_plain).items() if name != "scripted"
    }  # it asserts no drift
    assert _mismatches(bf16_plain, prompts, drafters, k_values=(3, 8)) != []


def _batched_outputs(target, prompts, sessions: int) -> list[list[int]]:
    """`sessions` sessions at once through one step scheduler, each verifying the
    right continuation in rounds of 1..5 tokens (its acceptance varies with them)."""
    references = _references(target, prompts[:sessions])
    scheduler = StepScheduler(target.model, max_batch_tokens=64)

    def run(index: int) -> list[int]:
        prompt, reference = prompts[index], references[index]
        session = TargetSession(target, prompt, GREEDY, prefill=False)
        scheduler.submit(session.prefill_steps())
        out: list[int] = []
        while len(out) < MAX_NEW_TOKENS:
            size = 1 + (len(out) + index) % 5
            draft = [
                t if (i + index) % 4 else (t + 1) % 256
                for i, t in enumerate(reference[len(out) :][:size])
            ]
            out += scheduler.submit(session.verify_steps(session.length, draft))[0].token_ids
        return out[:MAX_NEW_TOKENS]

    try:
        return _run_threads([lambda i=i: run(i) for i in range(sessions)]) == references
    finally:
        scheduler.stop()


@pytest.mark.parametrize("sessions", [1, 4, 8])
def test_concurrent_sessions_equal_single_session_target_only_in_bf16(
    bf16_invariant, prompts, sessions
):
    assert _batched_outputs(bf16_invariant, prompts, sessions)


def test_the_concurrency_test_catches_bf16_without_invariance(bf16_plain, prompts):
    assert not _batched_outputs(bf16_plain, prompts, 8)


def test_load_model_makes_a_target_row_invariant_as_asked():
    assert load_model("tiny-random:1", dtype="bfloat16").row_invariance is None  # off unless asked
    loaded = load_model("tiny-random:1", dtype="bfloat16", row_invariant="on")
    assert ri.invariance_of(loaded.model) is loaded.row_invariance and loaded.row_invariance.linears


def test_bf16_speculative_sampling_follows_the_target_distribution(tiny_perturbed, prompt_ids):
    """The chi-square test of tests/speculative/test_sampled_generation.py on a bf16 row-invariant
    target (a biased rule fails it there: test_the_distribution_test_catches_a_biased_rule)."""
    target = load_model("tiny-random:1", dtype="bfloat16", row_invariant="on")
    exact = _exact_target_distribution(target, prompt_ids[0])
    samples, acceptance = _sample_runs(
        target, ModelDrafter(tiny_perturbed), prompt_ids[0], 2, NUM_RUNS
    )
    assert 0.2 < acceptance < 0.9, f"the draft should be partly right, acceptance {acceptance:.2f}"
    assert _chi_square_p_value(samples, exact) > ALPHA
