"""Random models with a published model's shape (`random:SHAPE[:SEED]`, model_runtime/tiny.py)
and the GPU check that uses them (benchmarks/gpu_check.py), on the CPU: the real shapes
on the meta device (no memory), seeded weights on the tiny shape, the byte tokenizer
over a 151936-wide vocabulary, greedy exactness, and the check's --smoke run end to end."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check
from foundation.errors import InvalidArgument, NotFound
from model_runtime import tiny
from model_runtime.loading import load_model, load_tokenizer
from model_runtime.model_session import ModelSession
from orchestrator.tokenizer import ServedTokenizer
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from target_service.served_tokenizer import served_tokenizer
from tests.speculative.test_greedy_equivalence import GREEDY

TINY = "random:qwen2-tiny"


@pytest.mark.parametrize(
    "name, sizes, tied, billions",
    [
        ("random:qwen2.5-1.5b", (1536, 8960, 28, 12, 2), True, 1.54),
        ("random:qwen2.5-7b:3", (3584, 18944, 28, 28, 4), False, 7.61),
    ],
)
def test_the_real_shapes_build_on_the_meta_device(name, sizes, tied, billions):
    model = tiny.random_shaped(name, device="meta", dtype=torch.bfloat16)
    config = model.config
    assert (
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
    ) == sizes
    assert config.vocab_size == 151936 and config.model_type == "qwen2"
    head_dim = config.hidden_size // config.num_attention_heads
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.weight.shape == (
        config.num_key_value_heads * head_dim,
        config.hidden_size,
    )
    assert model.lm_head.weight.shape == (151936, config.hidden_size)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    parameters = list(model.parameters())
    assert {p.device.type for p in parameters} == {"meta"} and {p.dtype for p in parameters} == {
        torch.bfloat16
    }
    assert sum(p.numel() for p in parameters) / 1e9 == pytest.approx(billions, abs=0.01)


def test_one_seed_gives_one_set_of_weights():
    first, again, other = load_model(TINY + ":5"), load_model(TINY + ":5"), load_model(TINY + ":6")
    weights = [list(m.model.state_dict().values()) for m in (first, again, other)]
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))
    assert not torch.equal(weights[0][0], weights[2][0])
    # the seed defaults to 0
    assert (
        load_model(TINY)
        .model.state_dict()["lm_head.weight"]
        .equal(load_model(TINY + ":0").model.state_dict()["lm_head.weight"])
    )
    norms = [v for k, v in first.model.state_dict().items() if k.endswith("norm.weight")]
    assert norms and all(bool((n == 1).all()) for n in norms)


def test_made_in_the_dtype_asked_for():
    loaded = load_model(TINY + ":2", dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert loaded.vocab_size == 151936 and loaded.context_length == 2048
    assert torch.get_default_dtype() == torch.float32  # restored
    again = load_model(TINY + ":2", dtype="bfloat16")
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.model.parameters(), again.model.parameters())
    )


@pytest.mark.parametrize(
    "name, error",
    [
        ("random:qwen9-900b", NotFound),
        ("random:qwen2-tiny:x", InvalidArgument),
        ("random:qwen2-tiny:1:2", InvalidArgument),
        ("random:", InvalidArgument),
        ("random", InvalidArgument),
    ],
)
def test_bad_names_are_refused_with_the_core_errors(name, error):
    with pytest.raises(error):
        load_model(name)


def test_an_unknown_shape_names_the_known_ones():
    with pytest.raises(NotFound, match="qwen2.5-7b"):
        load_model("random:llama-70b:1")


def test_tiny_random_is_unchanged():
    loaded = load_model("tiny-random:1")
    assert loaded.model.config.model_type == "llama" and loaded.vocab_size == tiny.TINY_VOCAB_SIZE


def test_ids_beyond_the_byte_tokenizer_decode_to_nothing_here_and_in_the_orchestrator():
    loaded = load_model(TINY)
    ids = [72, 151935, 4096, 300, 105]  # bytes around ids only a 151936-wide model picks
    text = loaded.tokenizer.decode(ids)
    assert text == loaded.tokenizer.decode([72, 105])
    served = ServedTokenizer.from_served(
        served_tokenizer(loaded)
    )  # as the orchestrator rebuilds it
    assert served.decode(ids, skip_special_tokens=True) == text
    assert served.fingerprint == loaded.fingerprint
    assert load_tokenizer(TINY + ":3").get_vocab() == loaded.tokenizer.get_vocab()


def test_batched_and_incremental_greedy_agree_in_fp32():
    loaded = load_model(TINY + ":1")
    incremental = ModelSession(loaded.model, loaded.context_length)
    incremental.append(list(range(40, 60)))
    incremental.prefill()
    for _ in range(24):
        incremental.append([int(incremental.logits(1)[0].argmax())])
    tokens = incremental.token_ids
    assert len(set(tokens[20:])) > 12  # the output depends on the context: no one-token loop
    batched = ModelSession(loaded.model, loaded.context_length)
    batched.append(tokens)
    batched.prefill()
    batched.truncate_to(20)
    batched.append(tokens[20:])
    assert batched.logits(24)[:-1].argmax(-1).tolist() == tokens[21:]
    assert incremental.logits(1)[0].argmax().item() == batched.logits(1)[0].argmax().item()


def test_a_self_draft_with_the_same_seed_is_always_accepted():
    target, draft = load_model(TINY + ":4"), load_model(TINY + ":4")
    prompt = list(range(100, 130))
    reference = SpeculativeGenerator(target).generate(prompt, GREEDY, k=0).token_ids
    result = SpeculativeGenerator(target, ModelDrafter(draft)).generate(prompt, GREEDY, k=4)
    assert result.token_ids == reference
    assert result.stats.acceptance_rate == 1.0


def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    """--smoke: every step with tiny sizes, services included, step 5 over 2 CPU ranks (about 90 s on 2 cores)."""
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "gpu_smoke.md").read_text()
    assert text in capsys.readouterr().out
    for heading in (
        "## 1. Passes: eager (old) against fixed-shape passes",
        "## 2. Draft time per token by quantization",
        "## 3. End to end: self-draft unquantized",
        "## 4. End to end: self-draft quantized int8-dynamic",
        "## 5. End to end: the target over 2 devices (tensor parallel)",
        "## 6. Row invariance",
        "## 7. Speed at a known acceptance: the replay drafter",
    ):
        assert heading in text
    assert "Failed" not in text and "Skipped" not in text
    assert text.count("every output equals target-only") == 3
    assert "Outputs differing from target-only: invariance off: 0, invariance on: 0." in text
    assert "| on | 0 of 64 | 0 | 0 |" in text  # the row check, invariance on
    assert "new (`on`)" in text and "| `random:qwen2-tiny:0` | new (static) |" in text
    # sharded against single-process
    assert "1 of 1 target-only outputs equal token for token" in text
    # a row, not a crash
    assert "| fp8 | | | | | InvalidArgument: quantization 'fp8' is for CUDA" in text
    rows = [line for line in text.splitlines() if line.startswith("| `random:qwen2-tiny:0` | ")]
    # step 1's two rows (old, new) and one per scheme
    assert len(rows) == 2 + len(gpu_check.SCHEMES)


def test_the_gpu_check_needs_cuda_or_smoke(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert gpu_check.main([]) == 2
    assert "--smoke" in capsys.readouterr().err
