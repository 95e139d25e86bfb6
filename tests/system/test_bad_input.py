"""Bad input gets an error that names the problem, and nothing is left half-done."""

from __future__ import annotations

import pytest

from foundation.errors import IncompatibleModels, InvalidArgument, NotFound
from model_runtime.fingerprint import tokenizer_fingerprint
from model_runtime.loading import LoadedModel, load_model
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import NgramDrafter
from speculative.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4)


def test_empty_prompt(tiny_target):
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        SpeculativeGenerator(tiny_target, NgramDrafter()).generate([], GREEDY)


@pytest.mark.parametrize("k", [-1, 17, 1000])
def test_k_out_of_range(tiny_target, k):
    with pytest.raises(InvalidArgument, match=r"num_speculative_tokens \(k\) must be in \[0, 16\]"):
        SpeculativeGenerator(tiny_target, NgramDrafter()).generate([1, 2], GREEDY, k=k)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperature": -0.5}, "temperature must be finite and >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -3}, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_invalid_sampling_values(tiny_target, change, message):
    with pytest.raises(InvalidArgument, match=message):
        SpeculativeGenerator(tiny_target).generate([1, 2], SamplingParams(**change))


def test_prompt_longer_than_the_context(tiny_target):
    prompt = [5] * tiny_target.context_length
    with pytest.raises(
        InvalidArgument, match=f"prompt of {len(prompt)} tokens .* context length of 1024"
    ):
        SpeculativeGenerator(tiny_target).generate(prompt, GREEDY)


def test_generation_stops_at_the_context_length(tiny_target):
    prompt = [5] * (tiny_target.context_length - 3)
    result = SpeculativeGenerator(tiny_target, ModelDrafter(tiny_target)).generate(
        prompt, SamplingParams(max_new_tokens=50), k=8
    )
    assert len(result.token_ids) == 3 and result.finish_reason.value == "length"


def test_unknown_model_name():
    with pytest.raises(NotFound, match="unknown model 'no-such-model'"):
        load_model("no-such-model")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(NotFound, match="does not exist"):
        load_model(str(tmp_path / "absent.gguf"))


def test_bad_dtype():
    with pytest.raises(InvalidArgument, match="dtype must be one of"):
        load_model("tiny-random", dtype="float8")


def test_mismatched_tokenizers_are_refused(tiny_target):
    other_vocabulary = tiny_target.tokenizer.__class__(
        tokenizer_object=tiny_target.tokenizer.backend_tokenizer, eos_token="<|endoftext|>"
    )
    other_vocabulary.add_tokens(["<extra>"])
    draft = LoadedModel(
        name="other",
        model=tiny_target.model,
        tokenizer=other_vocabulary,
        fingerprint=tokenizer_fingerprint(other_vocabulary),
        context_length=1024,
        vocab_size=258,
    )
    assert draft.fingerprint != tiny_target.fingerprint
    with pytest.raises(
        IncompatibleModels, match="draft 'model:other' .* cannot serve target 'tiny-random:1'"
    ):
        SpeculativeGenerator(tiny_target, ModelDrafter(draft))


def test_tiny_models_share_a_vocabulary(tiny_target, tiny_unrelated):
    assert tiny_target.fingerprint == tiny_unrelated.fingerprint
