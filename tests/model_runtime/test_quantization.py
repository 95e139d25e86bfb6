"""Quantized drafts (model_runtime/quantization.py): a draft's numerics change acceptance,
never the output. Greedy equality with target-only for every CPU scheme and k, the
sampled chi-square test with a quantized draft, and clear refusals."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from foundation.errors import InvalidArgument
from model_runtime import quantization
from model_runtime.loading import load_model
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from tests.speculative.test_greedy_equivalence import GREEDY, _check_all
from tests.speculative.test_sampled_generation import (
    NUM_RUNS,
    _chi_square_p_value,
    _exact_target_distribution,
    _sample_runs,
)

ALPHA = 1e-3
CPU_SCHEMES = [
    name for name, scheme in quantization.SCHEMES.items() if scheme.cpu not in (None, "none")
]


@pytest.fixture(
    scope="module",
    params=[(s, keep) for s in CPU_SCHEMES for keep in (False, True)],
    ids=lambda p: f"{p[0]}{'-keep-output' if p[1] else ''}",
)
def self_draft(request):
    """The target's own weights (tiny-random:1), quantized: the `self` drafter."""
    scheme, keep_output = request.param
    return load_model("tiny-random:1", quantize=scheme, keep_output_layer=keep_output)


@pytest.fixture(scope="module")
def references(tiny_target, prompt_ids) -> list[list[int]]:
    generator = SpeculativeGenerator(tiny_target)
    return [generator.generate(ids, GREEDY, k=0).token_ids for ids in prompt_ids]


def _linears(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if type(module) is nn.Linear]


def test_every_linear_is_quantized_unless_the_output_layer_is_kept(self_draft):
    kept = _linears(self_draft.model)
    keep_output = self_draft.model.get_output_embeddings() is not None and kept == ["lm_head"]
    assert kept == [] or keep_output, kept
    assert any("quantized" in type(m).__module__ for m in self_draft.model.modules())


def test_a_quantized_self_draft_equals_target_only_greedy(
    tiny_target, self_draft, prompt_ids, references
):
    drafter = ModelDrafter(self_draft)
    _check_all(tiny_target, prompt_ids, references, lambda ids, ref: drafter)
    stats = SpeculativeGenerator(tiny_target, drafter).generate(prompt_ids[0], GREEDY, k=4).stats
    assert 0.2 < stats.acceptance_rate < 1.0  # right in part: both paths of the rule run


def test_lookup_then_quantized_model_equals_target_only_greedy(
    tiny_target, self_draft, prompt_ids, references
):
    drafter = LookupThenModelDrafter(ModelDrafter(self_draft), NgramDrafter())
    _check_all(tiny_target, prompt_ids[:8], references[:8], lambda ids, ref: drafter)


def test_quantization_changes_the_draft_not_only_its_speed(tiny_target, prompt_ids):
    """Else the tests above would not test a draft that can be wrong: an int8 copy of a
    wide-weighted tiny model disagrees with the fp32 one somewhere."""
    draft = load_model("tiny-random:1", quantize="int8-dynamic-per-tensor")
    ids = torch.tensor([prompt_ids[0] + prompt_ids[1]])
    with torch.inference_mode():
        assert not torch.equal(draft.model(ids).logits, tiny_target.model(ids).logits)


def test_sampling_with_a_quantized_draft_follows_the_target_distribution(tiny_target, prompt_ids):
    draft = load_model("tiny-random:1", quantize="int8-dynamic")
    samples, acceptance = _sample_runs(tiny_target, ModelDrafter(draft), prompt_ids[0], 2, NUM_RUNS)
    assert 0.2 < acceptance < 1.0, (
        f"a quantized copy should be partly right, acceptance {acceptance:.3f}"
    )
    assert (
        _chi_square_p_value(samples, _exact_target_distribution(tiny_target, prompt_ids[0])) > ALPHA
    )


@pytest.mark.parametrize("scheme", ["int8-weight-only", "int4-weight-only", "fp8"])
def test_schemes_without_a_fast_cpu_kernel_are_refused_on_cpu(scheme):
    with pytest.raises(InvalidArgument, match="is for CUDA"):
        load_model("tiny-random:1", quantize=scheme)


def test_an_unknown_scheme_is_refused_naming_the_known_ones():
    with pytest.raises(InvalidArgument, match="int8-dynamic"):
        load_model("tiny-random:1", quantize="int3")


def test_cpu_int8_starts_from_float32():
    with pytest.raises(InvalidArgument, match="float32"):
        load_model("tiny-random:1", dtype="bfloat16", quantize="int8-dynamic")


def test_the_per_tensor_scheme_is_cpu_only():
    with pytest.raises(InvalidArgument, match="CPU only"):
        quantization.check_scheme("int8-dynamic-per-tensor", "cuda")


@pytest.mark.parametrize(
    "scheme",
    [name for name, entry in quantization.SCHEMES.items() if entry.cuda not in (None, "none")],
)
def test_every_cuda_scheme_builds_its_torchao_config(scheme):
    """Where torchao is installed (`.[gpu]`): each CUDA scheme's config is one torchao
    accepts; int4 asks for the tiled layout, which torch's own kernel runs."""
    pytest.importorskip("torchao")
    config = quantization.torchao_config(quantization.SCHEMES[scheme])
    if scheme == "int4-weight-only":
        assert config.int4_packing_format == "tile_packed_to_4d"


def test_cuda_schemes_without_torchao_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # an import of it fails
    with pytest.raises(InvalidArgument, match="pip install"):
        quantization.torchao_config(quantization.SCHEMES["int8-weight-only"])
