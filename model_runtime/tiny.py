"""Random-initialised models for tests, local wiring and GPU checks: no weights to download.

A byte-level tokenizer (256 byte symbols + an end-of-text token) built in code, and:

- `tiny-random[:SEED]`: a tiny Llama from a config, seeded, in fp32. Two tiny models
  with different seeds share the tokenizer, so one can draft for the other.
- `random:SHAPE[:SEED]`: a Qwen2-architecture model with the real sizes of a published
  model (`SHAPES`: Qwen2.5 0.5B, 1.5B and 7B, and `qwen2-tiny` for CPU tests and smoke
  runs), random weights seeded, made directly on the requested device in the requested
  dtype (a 7B never exists in fp32 on the CPU first). Timing a pass needs the shape,
  not trained weights: `benchmarks/gpu_check.py` measures with these where nothing can
  be downloaded. Two loads with one seed on one kind of device give identical weights
  (the draft and target workers are separate processes: a `self` draft must agree with
  its target for 100% acceptance); CPU and CUDA draw different numbers from one seed.

Tokenizer for the 151936-wide random models: the byte tokenizer, unchanged. Its 257
ids decode to bytes and the end-of-text token; every id beyond them decodes to nothing
(the tokenizers library skips ids outside its vocabulary, in transformers' tokenizer
and in the one the orchestrator rebuilds from a target's tokenizer.json alike), so any
token a random model picks detokenizes without error and adds no text. Prompts are
bytes; the output's token ids, not its text, carry the result.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from foundation.errors import InvalidArgument, NotFound

END_OF_TEXT = "<|endoftext|>"
TINY_VOCAB_SIZE = 257  # 256 bytes + END_OF_TEXT
TINY_CONTEXT_LENGTH = 1024  # tokens
# A minimal chat template (plain bytes, no special tokens), so that chat requests (the
# orchestrator's ChatMessages, the HTTP API's /v1/chat/completions) run on tiny models.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(seed: int, hidden_size: int = 64, num_layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT_LENGTH,
        # Wide initial weights give well-separated logits: with the default 0.02 a
        # random model's top two logits tie to within float rounding, and greedy
        # equality would then test rounding instead of the algorithm.
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=TINY_VOCAB_SIZE - 1,  # END_OF_TEXT
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):  # seed this model, leave the global RNG alone
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).float().eval()


# --- random:SHAPE[:SEED] ---------------------------------------------------------------

RANDOM_PREFIX = "random"
QWEN_VOCAB_SIZE = (
    151936  # Qwen2.5's tokenizer width (the 7B pads its own to 152064; one width pairs them all)
)


@dataclass(frozen=True)
class Shape:
    """The sizes that set a Qwen2 model's cost (the published config.json's values)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool
    vocab_size: int = QWEN_VOCAB_SIZE
    context_length: int = 32768  # tokens (the Instruct models' max_position_embeddings)


SHAPES = {
    "qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, tie_word_embeddings=True),
    "qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, tie_word_embeddings=True),
    "qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, tie_word_embeddings=False),
    # Tests and `gpu_check --smoke` on a CPU: Qwen2's layers, the full vocabulary.
    "qwen2-tiny": Shape(64, 128, 2, 4, 2, tie_word_embeddings=False, context_length=2048),
}


def is_random_shaped(name: str) -> bool:
    return name.split(":", 1)[0] == RANDOM_PREFIX


def parse_random_name(name: str) -> tuple[Shape, int]:
    """`random:SHAPE[:SEED]` -> (shape, seed); NotFound for an unknown shape,
    InvalidArgument for a malformed name or seed."""
    parts = name.split(":")
    if parts[0] != RANDOM_PREFIX or len(parts) not in (2, 3) or not parts[1]:
        raise InvalidArgument(
            f"a random-shaped model is named {RANDOM_PREFIX}:SHAPE[:SEED], got {name!r}"
        )
    shape = SHAPES.get(parts[1])
    if shape is None:
        raise NotFound(
            f"unknown random model shape {parts[1]!r} in {name!r}: one of {', '.join(SHAPES)}"
        )
    seed_text = parts[2] if len(parts) == 3 else "0"
    if not seed_text.isdigit():
        raise InvalidArgument(f"random model seed must be a non-negative integer, got {name!r}")
    return shape, int(seed_text)


def init_std(shape: Shape) -> float:
    """Every matrix's standard deviation: 2 / sqrt(hidden_size). Scaled to the width, a
    layer's pre-activations have a standard deviation of about 2 at every size: outputs
    depend on the context (at 1 / sqrt(hidden) or below a random model repeats one or
    two tokens) and attention is not saturated (a fixed 0.5, as tiny_llama's, would make
    a 7B's attention scores hundreds wide, each softmax an argmax one rounding can flip).
    Ties: with 151936 logits, the top two differ by about 4% of the top one at the
    median, far above fp32's rounding (batched and incremental greedy agree in fp32,
    tests/model_runtime/test_random_shaped.py); bf16 rounds logits to 0.4-0.8%, so some positions of a
    bf16 output are ties at any init scale (the scale cancels from that ratio)."""
    return 2.0 / math.sqrt(shape.hidden_size)


def random_shaped_config(shape: Shape) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.context_length,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        initializer_range=init_std(shape),
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=TINY_VOCAB_SIZE - 1,  # END_OF_TEXT of the byte tokenizer
        pad_token_id=None,
    )


def random_shaped(
    name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Qwen2ForCausalLM:
    """The model `random:SHAPE[:SEED]` names, built on `device` in `dtype` and filled
    from the seed; on the meta device, the shapes only (no memory, no values)."""
    shape, seed = parse_random_name(name)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with (
        _default_dtype(dtype),
        device,
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
    ):
        # Built where it will run; transformers' own initialisation (skipped on meta)
        # draws from the forked generator and is overwritten below.
        model = Qwen2ForCausalLM(random_shaped_config(shape))
    if device.type != "meta":
        fill_seeded(model, seed, init_std(shape))
    return model.eval()


def fill_seeded(model: torch.nn.Module, seed: int, std: float) -> None:
    """Norm weights 1, biases 0, every other parameter N(0, std) from a generator on the
    model's device seeded with `seed`, in the order of named_parameters (tied weights
    once): the same values in every process that builds the same model there."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            elif name.endswith(".bias"):
                parameter.zero_()
            else:
                parameter.normal_(0.0, std, generator=generator)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# --- near-tied: a model whose top two logits sit within a bf16 rounding step -----------

NEAR_TIED_GAP = 0.03  # the typical logit gap within a pair of twin tokens: half a bf16 step at 16


def near_tied_llama(seed: int, hidden_size: int = 128, num_layers: int = 2) -> LlamaForCausalLM:
    """tiny_llama whose output layer comes in twin rows: token 2i + 1's row is token 2i's
    plus a small difference, so that at every position the top two logits are within
    about one bf16 step of each other, and a pass that changes a row's last bits can
    flip its greedy token. What makes tests of exactness sharp."""
    model = tiny_llama(seed, hidden_size, num_layers)
    head = model.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(seed + 1)
    twins = head.shape[0] // 2 * 2
    with torch.no_grad():  # the final norm's output has a norm of about sqrt(hidden_size)
        difference = (
            torch.randn(twins // 2, hidden_size, generator=generator) * NEAR_TIED_GAP / hidden_size
        )
        head[1:twins:2] = head[0:twins:2] + difference
    return model
