"""In-process speculative decoding against target-only decoding and Hugging Face's
prompt lookup, on SmolLM2-135M-Instruct, measured in the same run.

    .venv/bin/python -m benchmarks.bench_core [--max-new-tokens 64] [--repeats 3] [--threads 2]

Prints a Markdown table of tokens/s and ratios against target-only decoding (the
median over interleaved repeats), with acceptance statistics, for fp32 (exact) and
bf16 (with how many outputs still equal bf16 target-only greedy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.prompts import PROMPTS
from model_runtime.loading import load_model
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK
from speculative.prompt_lookup import NgramDrafter
from speculative.sampling import SamplingParams

PROMPT_LOOKUP_K = 4  # Hugging Face prompt_lookup_num_tokens, and our fixed k


def chat_ids(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def _hf(loaded, ids, max_new_tokens, **kwargs):
    input_ids = torch.tensor([ids])
    start = time.perf_counter()
    output = loaded.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        **kwargs,
    )
    elapsed = time.perf_counter() - start
    return output[0, len(ids) :].tolist(), elapsed, None


def _ours(loaded, drafter, policy, ids, max_new_tokens):
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(loaded.eos_token_id,))
    start = time.perf_counter()
    result = SpeculativeGenerator(loaded, drafter).generate(ids, params, k=policy())
    return result.token_ids, time.perf_counter() - start, result.stats


def _methods(loaded, max_new_tokens):
    ngram = NgramDrafter()
    return {
        "target-only (HF generate)": lambda ids: _hf(loaded, ids, max_new_tokens),
        "target-only (ours)": lambda ids: _ours(loaded, None, lambda: 0, ids, max_new_tokens),
        f"HF prompt lookup k={PROMPT_LOOKUP_K}": lambda ids: _hf(
            loaded, ids, max_new_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_K
        ),
        f"ours n-gram k={PROMPT_LOOKUP_K}": lambda ids: _ours(
            loaded, ngram, lambda: PROMPT_LOOKUP_K, ids, max_new_tokens
        ),
        "ours n-gram adaptive k<=8": lambda ids: _ours(
            loaded, ngram, lambda: AdaptiveK(8), ids, max_new_tokens
        ),
    }


def measure(loaded, max_new_tokens, repeats):
    """{prompt: {method: (tokens/s median, tokens, stats)}}, methods interleaved."""
    methods = _methods(loaded, max_new_tokens)
    results = {}
    for name, text in PROMPTS.items():
        ids = chat_ids(loaded.tokenizer, text)
        methods["target-only (ours)"](ids)  # warm-up
        runs = {method: [] for method in methods}
        for _ in range(repeats):
            for method, run in methods.items():
                runs[method].append(run(ids))
        results[name] = {
            method: (
                statistics.median(len(tokens) / seconds for tokens, seconds, _ in method_runs),
                method_runs[0][0],
                method_runs[0][2],
            )
            for method, method_runs in runs.items()
        }
    return results


def print_table(title, results, baseline="target-only (HF generate)"):
    methods = list(next(iter(results.values())))
    print(f"\n### {title}\n")
    print("| prompt | " + " | ".join(methods) + " | acceptance (ours k=4) | equal to target-only |")
    print("|---" * (len(methods) + 3) + "|")
    for prompt, row in results.items():
        base = row[baseline][0]
        cells = [f"{row[m][0]:.1f} tok/s ({row[m][0] / base:.2f}x)" for m in methods]
        stats = row[f"ours n-gram k={PROMPT_LOOKUP_K}"][2]
        reference = row["target-only (ours)"][1]
        equal = sum(row[m][1] == reference for m in methods)
        print(
            f"| {prompt} | "
            + " | ".join(cells)
            + f" | {stats.acceptance_rate:.0%}, {stats.tokens_per_round:.2f} tok/pass | {equal}/{len(methods)} |"
        )
    for method in methods:
        ratios = [row[method][0] / row[baseline][0] for row in results.values()]
        print(
            f"- {method}: geometric-mean speedup {statistics.geometric_mean(ratios):.2f}x, "
            f"min {min(ratios):.2f}x, max {max(ratios):.2f}x"
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantised), {args.max_new_tokens} new tokens, "
        f"greedy, {torch.get_num_threads()} threads, median of {args.repeats} interleaved repeats"
    )
    for dtype in args.dtypes.split(","):
        loaded = load_model("smollm2-135m", dtype=dtype)
        print_table(dtype, measure(loaded, args.max_new_tokens, args.repeats))


if __name__ == "__main__":
    main()
