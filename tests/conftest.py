"""Shared fixtures: tiny seeded fp32 models (no weights to download) and prompts."""

from __future__ import annotations

import os

# Tests never download: an unknown name fails at once instead of after hub retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy  # noqa: E402
import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from model_runtime.loading import LoadedModel, load_tiny_model  # noqa: E402

# Tiny models run ~3x faster on one thread: their matrices are too small to split, and
# the tests' cost is per-call overhead.
torch.set_num_threads(1)

# Twenty prompts of different kinds: prose, code, repetition (n-gram hits), short.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, in a land far away,",
    "abcabcabcabcabc",
    "1, 2, 3, 4, 5, 6,",
    "SELECT name FROM users WHERE id = 42;",
    "Hello",
    "to be or not to be, to be or not",
    "import torch\nimport numpy as np\n",
    "The capital of France is",
    "x = [i * i for i in range(10)]",
    "Summarize: the meeting moved to Tuesday. The meeting",
    "aaaaaaaaaaaaaaaaaaaa",
    '{"key": "value", "key": ',
    "for (int i = 0; i < n; ++i) {",
    "Q: What is 2+2?\nA:",
    "red green blue red green blue red",
    "<html><body><p>hi</p></body></html>",
    "z",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
]


@pytest.fixture(scope="session")
def tiny_target() -> LoadedModel:
    return load_tiny_model("tiny-random:1")


@pytest.fixture(scope="session")
def tiny_unrelated() -> LoadedModel:
    """A model with other random weights: its drafts are mostly rejected."""
    return load_tiny_model("tiny-random:2")


@pytest.fixture(scope="session")
def tiny_perturbed(tiny_target) -> LoadedModel:
    """The target with noise on its weights: a draft that is right some of the time."""
    model = copy.deepcopy(tiny_target.model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
    return LoadedModel(
        name="tiny-perturbed",
        model=model,
        tokenizer=tiny_target.tokenizer,
        fingerprint=tiny_target.fingerprint,
        context_length=tiny_target.context_length,
        vocab_size=tiny_target.vocab_size,
    )


@pytest.fixture(scope="session")
def tiny_bigram(tiny_target) -> LoadedModel:
    """The target with its attention and MLP outputs zeroed: its next token depends on
    the last one only, so its greedy text soon repeats and prompt lookup copies it."""
    model = copy.deepcopy(tiny_target.model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return dataclasses.replace(tiny_target, name="tiny-bigram", model=model)


@pytest.fixture(scope="session")
def prompt_ids(tiny_target) -> list[list[int]]:
    return [tiny_target.tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture
def redis_server():
    """A real redis-server of its own for one test (started, stopped, removed)."""
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.cleanup()
