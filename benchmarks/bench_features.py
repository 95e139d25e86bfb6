"""Each optimisation around the round loop switched off, against all on, in process:
what it buys, per prompt kind, with paired repeats.

    .venv/bin/python -m benchmarks.bench_features --pair qwen      # 0.5B int8 -> 1.5B (pip install '.[qwen]')
    .venv/bin/python -m benchmarks.bench_features --pair smollm2   # n-gram drafter

Adaptive k (at most 8), greedy, chat template, 64 new tokens; target-only as the
baseline of every ratio, all methods interleaved per prompt (`bench_suite.measure`).
In process nothing verifies while the draft drafts and the target runs no lookup, so
the switches that matter here are `stretches` and `draft_stop`; drafting ahead and
lookup run by the target are measured through the services (`bench_suite`,
`bench_pipeline`). Writes `results_features_<pair>.md` in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_core import chat_ids
from benchmarks.bench_suite import (
    ADAPTIVE_MAX_K,
    PAIRS,
    Run,
    exactness_line,
    hardware,
    measure,
    paired_ratio,
)
from benchmarks.prompts import PROMPTS
from model_runtime.loading import load_model
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams
from speculative.speculation_loop import Features

REPO = Path(__file__).resolve().parent.parent
SWITCHED_OFF = ("stretches", "draft_stop")  # the switches that act in process
ALL_ON = Features(**{switch.name: True for switch in dataclasses.fields(Features)})


def method(target, drafter, features: Features | None, max_new_tokens: int):
    """A call's runner: adaptive with these features, or target-only (features None)."""
    generator = SpeculativeGenerator(
        target, drafter if features is not None else None, features=features or ALL_ON
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(target.eos_token_id,))

    def run(ids):
        start = time.perf_counter()
        result = generator.generate(
            ids, params, k=AdaptiveK(ADAPTIVE_MAX_K) if features is not None else 0
        )
        return Run(result.token_ids, time.perf_counter() - start, result.stats)

    return run


def methods(target, drafter, max_new_tokens: int) -> dict:
    every = {
        "target-only": method(target, drafter, None, max_new_tokens),
        "all on": method(target, drafter, ALL_ON, max_new_tokens),
    }
    for name in SWITCHED_OFF:
        every[f"{name} off"] = method(
            target, drafter, dataclasses.replace(ALL_ON, **{name: False}), max_new_tokens
        )
    return every


def report(command: str, pair_name: str, drafter_name: str, results: dict, args) -> str:
    names = list(next(iter(results.values())))
    lines = [
        f"# The optimisations around the round loop, {pair_name} ({drafter_name})",
        "",
        f"Command: `{command}`",
        "",
        f"Hardware: {hardware()}; {args.threads} torch threads. In process, "
        f"adaptive k <= {ADAPTIVE_MAX_K}, greedy, {args.max_new_tokens} new tokens, chat template, "
        f"{args.repeats} interleaved repeats. Cells: speedup over target-only (geometric mean of paired "
        "repeats, 95% interval); last row: each method against all on.",
        "",
        "| prompt | " + " | ".join(n for n in names if n != "target-only") + " |",
        "|---" * len(names) + "|",
    ]
    against_all_on = {n: [] for n in names if n != "target-only"}
    for prompt, runs in results.items():
        cells = []
        for name in against_all_on:
            ratio, low, high = paired_ratio(runs[name], runs["target-only"])
            cells.append(f"{ratio:.2f}x [{low:.2f}, {high:.2f}]")
            against_all_on[name] += [
                m.tokens_per_s / b.tokens_per_s for m, b in zip(runs[name], runs["all on"])
            ]
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    lines.append(
        "| geomean against all on | "
        + " | ".join(f"{statistics.geometric_mean(r):.3f}" for r in against_all_on.values())
        + " |"
    )
    lines += ["", exactness_line(results), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_features", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument(
        "--drafter",
        choices=("model", "ngram", "ngram+model"),
        default=None,
        help="default: the pair's (model with a draft model, else ngram)",
    )
    parser.add_argument(
        "--prompts", default=None, help="comma-separated prompt kinds (default: the pair's)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = PAIRS[args.pair]
    drafter_name = args.drafter or pair.drafter
    target = load_model(pair.target)
    model = ModelDrafter(load_model(pair.draft, quantize=pair.quantization)) if pair.draft else None
    drafter = {
        "model": model,
        "ngram": NgramDrafter(),
        "ngram+model": model and LookupThenModelDrafter(model, NgramDrafter()),
    }[drafter_name]
    prompts = args.prompts.split(",") if args.prompts else list(pair.prompts)
    inputs = {name: chat_ids(target.tokenizer, PROMPTS[name]) for name in prompts}
    results = measure(methods(target, drafter, args.max_new_tokens), inputs, args.repeats)
    command = "python -m benchmarks.bench_features " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    text = report(command, args.pair, drafter_name, results, args)
    path = Path(args.out) / f"results_features_{args.pair}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
