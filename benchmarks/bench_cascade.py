"""The cascade (prompt lookup before the draft model) against each of its two drafters
alone, adaptive, in process: is it at least the better of its parts on every prompt kind?

    .venv/bin/python -m benchmarks.bench_cascade                 # Qwen pair, 7 prompts a kind
    .venv/bin/python -m benchmarks.bench_cascade --kinds chat --prompt-set "" --max-new-tokens 16

Methods, interleaved per prompt (`bench_suite.measure`): lookup alone, the model alone,
the cascade with its gate (speculative/lookup_gate.py) and without it; adaptive k <= 8,
greedy, chat template, every other optimisation on. Each method keeps its own generator,
so each call is seeded with what the method's call before it measured, as a draft worker
seeds it. Writes `results_cascade.md` in --out after every prompt.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_core import chat_ids
from benchmarks.bench_suite import ADAPTIVE_MAX_K, PAIRS, Run, chosen, hardware, measure
from benchmarks.prompts import PROMPT_SETS, kind_of, prompt_texts
from model_runtime.loading import load_model
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams
from speculative.speculation_loop import Features

REPO = Path(__file__).resolve().parent.parent
PARTS = ("lookup", "model")


# name: the drafter ("ngram", "model" or the cascade "ngram+model") and its features
METHODS = {
    "lookup": ("ngram", Features()),
    "model": ("model", Features()),
    "cascade": ("ngram+model", Features()),
    "cascade no gate": ("ngram+model", Features(lookup_gate=False)),
}


def methods(target, model: ModelDrafter, max_new_tokens: int, names: list[str]) -> dict:
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(target.eos_token_id,))
    drafters = {
        "ngram": NgramDrafter,
        "model": lambda: model,
        "ngram+model": lambda: LookupThenModelDrafter(model, NgramDrafter()),
    }

    def runner(drafter, features: Features):
        generator = SpeculativeGenerator(target, drafter, features=features)

        def run(ids):
            start = time.perf_counter()
            result = generator.generate(ids, params, k=AdaptiveK(ADAPTIVE_MAX_K))
            return Run(result.token_ids, time.perf_counter() - start, result.stats)

        return run

    return {name: runner(drafters[METHODS[name][0]](), METHODS[name][1]) for name in names}


def _rate(runs: list[Run]) -> float:
    return statistics.median(run.tokens_per_s for run in runs)


def _over_better(runs: dict[str, list[Run]], method: str) -> float:
    """The method's tok/s over the better part's, paired per repeat (geometric mean)."""
    return statistics.geometric_mean(
        [
            m.tokens_per_s / max(runs[part][i].tokens_per_s for part in PARTS)
            for i, m in enumerate(runs[method])
        ]
    )


def report(command: str, results: dict, args) -> str:
    names = list(next(iter(results.values())))
    cascades = [n for n in names if n not in PARTS]
    lines = [
        "# The cascade against its parts, Qwen2.5-Coder 1.5B target, 0.5B int8 draft",
        "",
        f"Command: `{command}`",
        "",
        f"Hardware: {hardware()}; {args.threads} torch threads. In process, adaptive k <= "
        f"{ADAPTIVE_MAX_K}, greedy, {args.max_new_tokens} new tokens, chat template, "
        f"{args.repeats} interleaved repeat(s). Cells: tok/s (median); against the better "
        "part: the cascade's tok/s over the faster of lookup and the model on the same "
        "prompt and repeat.",
        "",
        "| prompt | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{c} / better" for c in cascades)
        + " |",
        "|---" * (1 + len(names) + len(cascades)) + "|",
    ]
    for prompt, runs in results.items():
        cells = [f"{_rate(runs[n]):.2f}" for n in names]
        cells += [f"{_over_better(runs, c):.3f}" for c in cascades]
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per kind (geometric means over its prompts); the bar: the cascade at least 0.97x "
        "the better of its parts' kind means.",
        "",
        "| kind | prompts | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{c} / better part" for c in cascades)
        + " |",
        "|---" * (2 + len(names) + len(cascades)) + "|",
    ]
    for kind in dict.fromkeys(kind_of(p) for p in results):
        prompts = [p for p in results if kind_of(p) == kind]
        means = {
            n: statistics.geometric_mean([_rate(results[p][n]) for p in prompts]) for n in names
        }
        better = max(means[part] for part in PARTS)
        lines.append(
            f"| {kind} | {len(prompts)} | "
            + " | ".join(f"{means[n]:.2f}" for n in names)
            + " | "
            + " | ".join(f"{means[c] / better:.3f}" for c in cascades)
            + " |"
        )
    equal = sum(
        run.token_ids == runs["model"][0].token_ids
        for runs in results.values()
        for method_runs in runs.values()
        for run in method_runs
    )
    total = sum(len(r) for runs in results.values() for r in runs.values())
    lines += ["", f"Every output equal to the model drafter's (greedy, exact): {equal} of {total}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_cascade", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--kinds", default="chat,code_new,code_edit,summary,explain")
    parser.add_argument("--prompt-set", choices=PROMPT_SETS, default="all")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="", help="a comma-separated subset (default: all)")
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    args = parser.parse_args(argv)
    names = chosen(METHODS, args.methods, PARTS, "method")
    torch.set_num_threads(args.threads)
    pair = PAIRS["qwen"]
    target = load_model(pair.target)
    model = ModelDrafter(load_model(pair.draft, quantize=pair.quantization))
    texts = prompt_texts(args.kinds.split(","), args.prompt_set)
    # Kinds interleaved (kind/0 of each, then kind/1 ...): drift over the run hits every kind.
    order = sorted(texts, key=lambda name: name.split("/")[-1])
    inputs = {name: chat_ids(target.tokenizer, texts[name]) for name in order}
    command = "python -m benchmarks.bench_cascade " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    every = methods(target, model, args.max_new_tokens, names)
    measure(every, {"warm-up": inputs[order[0]][:16]}, 1)
    path = Path(args.out) / "results_cascade.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, ids in inputs.items():  # written as it goes
        results |= measure(every, {name: ids}, args.repeats)
        path.write_text(report(command, results, args))
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
