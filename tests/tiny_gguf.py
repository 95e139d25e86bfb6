"""A tiny Llama written as a GGUF file (Q8_0 matrices, a byte-level BPE vocabulary and
a chat template), for tests of the GGUF path without the 93 MB SmolLM2 file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from model_runtime import tiny

# Hugging Face parameter names -> GGUF tensor names (llama.cpp's convert script).
GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(path: Path, seed: int = 1) -> Path:
    """Writes tiny.tiny_llama(seed) and tiny.byte_tokenizer() to path; returns path."""
    model, tokenizer = tiny.tiny_llama(seed), tiny.byte_tokenizer()
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t == tiny.END_OF_TEXT else gguf.TokenType.NORMAL for t in vocab]
    )
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_merges([])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tiny.CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        writer_name, data = _gguf_tensor(name, tensor.numpy(), config)
        if data.ndim == 2:  # quantized, so that loading it de-quantizes like a real file
            writer.add_tensor(
                writer_name,
                gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(writer_name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor(name: str, data: np.ndarray, config) -> tuple[str, np.ndarray]:
    module = name.removesuffix(".weight")
    if not module.startswith("model.layers."):
        return f"{GLOBAL_NAMES[module]}.weight", data
    _, _, index, inner = module.split(".", 3)
    # llama.cpp interleaves the rotary halves of q and k; transformers undoes it on load.
    if inner == "self_attn.q_proj":
        data = _interleave_rotary(data, config.num_attention_heads)
    elif inner == "self_attn.k_proj":
        data = _interleave_rotary(data, config.num_key_value_heads)
    return f"blk.{index}.{LAYER_NAMES[inner]}.weight", data


def _interleave_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    head_half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, head_half, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
