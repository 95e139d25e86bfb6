"""Tiny random-initialised models for tests and local wiring: no weights to download.

A byte-level tokenizer (256 byte symbols + an end-of-text token) built in code, and a
Llama-architecture model from a config, seeded, in fp32. Two tiny models with different
seeds share the tokenizer, so one can draft for the other.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
