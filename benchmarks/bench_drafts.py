"""Draft variants priced by measurement: what each costs a token, how often the target
accepts it, and what it buys end to end.

    .venv/bin/python -m benchmarks.bench_drafts          # Qwen2.5-Coder 0.5B / 1.5B, 5 prompts (20 min)
    .venv/bin/python -m benchmarks.bench_drafts --quick  # checks the script: 1 prompt, 16 tokens, 1 repeat

In one process, greedy, chat template, each prompt's target-only output (our k=0) as
the reference. Per draft variant (the 0.5B in fp32 and in each CPU quantization, the
1.5B target's own int8 copy, and prompt lookup before the int8 0.5B):
- ms per draft token: the median one-token pass over the growing prefix, while the
  draft reads the reference token by token;
- agreement: how often the draft's argmax equals the reference's next token there (the
  per-token acceptance of greedy speculation);
- end to end at fixed k: tokens/s over target-only's in the same repeat (methods
  interleaved, rotated per repeat), acceptance per draft position, every output checked
  equal to the reference; and Leviathan et al.'s bound for that k from the measured
  agreement a, draft cost d and target pass costs c(w):
  (1 - a^(k+1)) / (1 - a) * c(1) / (k d + c(k + 1)).
Writes results_drafts.md and runs_drafts.json to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.bench_core import chat_ids
from benchmarks.bench_suite import Run, paired_ratio, round_order
from benchmarks.prompts import PROMPTS
from model_runtime.loading import LoadedModel, load_model
from model_runtime.model_session import ModelSession
from speculative.drafters import ModelDrafter
from speculative.estimator import leviathan_speedup, round_speedup
from speculative.generator import SpeculativeGenerator
from speculative.policy import FixedK
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
TARGET_ONLY = "target-only"
PASS_WIDTHS = tuple(range(1, 10))  # target pass widths timed: k + 1 for k in 0..8
CEILING_KS = range(1, 9)  # the k the ceiling is the best of


@dataclass(frozen=True)
class Variant:
    name: str
    model: str  # "" = the target's own weights
    quantize: str = "none"
    keep_output_layer: bool = False
    lookup_first: bool = False  # the cascade: prompt lookup, this model where it finds nothing

    def load(self) -> LoadedModel:
        return load_model(
            self.model or TARGET, quantize=self.quantize, keep_output_layer=self.keep_output_layer
        )


VARIANTS = (
    Variant("0.5B fp32", DRAFT),
    Variant("0.5B int8-dynamic", DRAFT, "int8-dynamic"),
    Variant("0.5B int8-dynamic, fp32 output layer", DRAFT, "int8-dynamic", keep_output_layer=True),
    Variant("0.5B int8-dynamic-per-tensor", DRAFT, "int8-dynamic-per-tensor"),
    Variant("self: 1.5B int8-dynamic", "", "int8-dynamic"),
    Variant("cascade: lookup, then 0.5B int8-dynamic", DRAFT, "int8-dynamic", lookup_first=True),
)


@dataclass
class Reading:
    """A variant on one prompt: its teacher-forced agreement and one-token pass times."""

    agreement: float
    token_ms: list[float] = field(default_factory=list)
    agreed: list[bool] = field(
        default_factory=list
    )  # per reference token: the draft's argmax was it


def read_along(loaded: LoadedModel, prompt: list[int], reference: list[int]) -> Reading:
    """The draft reads the reference token by token: its argmax against each next token,
    and each one-token pass's time."""
    session = ModelSession(loaded.model, loaded.context_length)
    session.append(prompt)
    session.prefill()
    agreed, times = [], []
    with torch.inference_mode():
        for token in reference:
            start = time.perf_counter()
            agreed.append(int(session.logits(1)[0].argmax()) == token)
            times.append((time.perf_counter() - start) * 1e3)
            session.append([token])
    session.release()
    # the first came with the prefill
    return Reading(sum(agreed) / len(reference), times[1:], agreed)


def pass_costs(loaded: LoadedModel, prompt: list[int], repeats: int) -> dict[int, float]:
    """The target's pass over w new tokens after the prompt, in ms (median), per width."""
    session = ModelSession(loaded.model, loaded.context_length)
    session.append(prompt)
    session.prefill()
    session.logits(1)  # the prompt fully cached: every pass below runs just its new tokens
    costs = {}
    with torch.inference_mode():
        for width in PASS_WIDTHS:
            times = []
            for _ in range(repeats + 1):
                session.append(prompt[:width])
                start = time.perf_counter()
                session.logits(width)
                times.append((time.perf_counter() - start) * 1e3)
                session.truncate_to(len(prompt))
            costs[width] = statistics.median(times[1:])
    session.release()
    return costs


def leviathan_bound(agreement: float, k: int, draft_ms: float, costs: dict[int, float]) -> float:
    """Expected speedup of k-token rounds at i.i.d. acceptance `agreement` (Leviathan et
    al. 2023, eq. 1 with the target's measured cost per pass width)."""
    return leviathan_speedup(agreement, k, draft_ms, costs[1], costs[k + 1])


def expected_tokens(agreed: list[bool], k: int) -> float:
    """E[tokens] of a greedy round of k draft tokens started at a random point of the
    text: the draft's run of agreements from there (at most k), plus the target's token."""
    runs, run = [], 0
    for ok in reversed(agreed):
        run = run + 1 if ok else 0
        runs.append(min(run, k))
    return 1.0 + statistics.fmean(runs)


def ceiling(agreed: list[bool], draft_ms: float, costs: dict[int, float]) -> tuple[float, int]:
    """The best speedup rounds of any one k can reach on this text with these costs,
    and that k: E[tokens](k) c(1) / (k d + c(k + 1)) (Leviathan et al. 2023, eq. 1,
    with the measured run lengths instead of an i.i.d. rate, and the measured pass
    cost per width). No overhead, no policy: what no scheduling of k can beat."""
    return max(
        (
            (round_speedup(expected_tokens(agreed, k), k, draft_ms, costs[1], costs[k + 1]), k)
            for k in CEILING_KS
        ),
        key=lambda cell: (cell[0], -cell[1]),
    )


def method(target: LoadedModel, drafter, k: int, max_new_tokens: int):
    generator = SpeculativeGenerator(target, drafter)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(target.eos_token_id,))

    def run(ids: list[int]) -> Run:
        start = time.perf_counter()
        result = generator.generate(ids, params, k=FixedK(k) if drafter else 0)
        return Run(result.token_ids, time.perf_counter() - start, result.stats)

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_drafts", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument(
        "--variants", default="", help="comma-separated indices into VARIANTS (default all)"
    )
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 prompt, 16 tokens, 1 repeat")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats = "code_edit", 16, 1
    variants = (
        [VARIANTS[int(i)] for i in args.variants.split(",")] if args.variants else list(VARIANTS)
    )
    prompts = args.prompts.split(",")
    command = "python -m benchmarks.bench_drafts " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )

    target = load_model(TARGET)
    inputs = {name: chat_ids(target.tokenizer, PROMPTS[name]) for name in prompts}
    baseline = method(target, None, 0, args.max_new_tokens)
    references = {name: baseline(ids).token_ids for name, ids in inputs.items()}
    costs = pass_costs(target, next(iter(inputs.values())), repeats=5)
    print(
        "target pass ms by width: " + ", ".join(f"{w}: {c:.0f}" for w, c in costs.items()),
        flush=True,
    )

    drafts, readings = {}, {}
    for variant in variants:
        loaded = (
            drafts.get((variant.model, variant.quantize, variant.keep_output_layer))
            or variant.load()
        )
        drafts[(variant.model, variant.quantize, variant.keep_output_layer)] = loaded
        readings[variant.name] = {
            name: read_along(loaded, ids, references[name]) for name, ids in inputs.items()
        }
        print(
            f"{variant.name}: "
            + ", ".join(
                f"{n} {r.agreement:.2f} @ {statistics.median(r.token_ms):.0f} ms"
                for n, r in readings[variant.name].items()
            ),
            flush=True,
        )

    methods = {TARGET_ONLY: baseline}
    for variant in variants:
        model = ModelDrafter(drafts[(variant.model, variant.quantize, variant.keep_output_layer)])
        drafter = LookupThenModelDrafter(model, NgramDrafter()) if variant.lookup_first else model
        methods[variant.name] = method(target, drafter, args.k, args.max_new_tokens)
    runs = {name: {m: [] for m in methods} for name in inputs}
    for name, ids in inputs.items():
        methods[variants[0].name](ids)  # warm-up
        for repeat in range(args.repeats):
            for m in round_order(list(methods), repeat):
                runs[name][m].append(methods[m](ids))
        print(
            f"  {name}: "
            + ", ".join(
                f"{m} {statistics.median(r.tokens_per_s for r in rs):.2f} tok/s"
                for m, rs in runs[name].items()
            ),
            flush=True,
        )

    text = report(command, args, variants, costs, readings, runs, references)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results_drafts.md").write_text(text)
    (out / "runs_drafts.json").write_text(
        json.dumps(
            {
                "pass_ms": costs,
                "readings": {
                    v: {
                        p: {
                            "agreement": r.agreement,
                            "token_ms": [round(t, 2) for t in r.token_ms],
                            "agreed": [int(a) for a in r.agreed],
                        }
                        for p, r in per.items()
                    }
                    for v, per in readings.items()
                },
                "runs": {
                    p: {
                        m: [[len(r.token_ids), round(r.seconds, 4)] for r in rs]
                        for m, rs in per.items()
                    }
                    for p, per in runs.items()
                },
            },
            indent=1,
        )
    )
    print(text)
    return 0


def report(command, args, variants, costs, readings, runs, references) -> str:
    lines = [
        "# Draft variants",
        "",
        f"Command: `{command}`",
        "",
        f"Hardware: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}. "
        f"Target {TARGET} fp32 (oneDNN-packed linears); greedy, chat template, {args.max_new_tokens} new tokens, "
        f"fixed k={args.k}, {args.repeats} repeats interleaved with target-only; in one process.",
        "",
        "Target pass over w new tokens after the prompt, ms: "
        + ", ".join(f"w={w}: {c:.0f}" for w, c in costs.items()),
        "",
        "| variant | ms / draft token | d / c(1) | agreement (min-max over prompts) | speedup, geometric mean "
        "(min-max) | acceptance by position | Leviathan bound | ours / bound | outputs equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in variants:
        per = readings[variant.name]
        draft_ms = statistics.median(t for r in per.values() for t in r.token_ms)
        agreements = [r.agreement for r in per.values()]
        speedups = [_ratio(runs[p][variant.name], runs[p][TARGET_ONLY]) for p in runs]
        bounds = [leviathan_bound(per[p].agreement, args.k, draft_ms, costs) for p in runs]
        ours_over = [s / b for s, b in zip(speedups, bounds)]
        positions = _by_position([r.stats for p in runs for r in runs[p][variant.name]], args.k)
        equal = sum(r.token_ids == references[p] for p in runs for r in runs[p][variant.name])
        total = sum(len(runs[p][variant.name]) for p in runs)
        lines.append(
            f"| {variant.name} | {draft_ms:.0f} | {draft_ms / costs[1]:.2f} | {statistics.fmean(agreements):.2f} "
            f"({min(agreements):.2f}-{max(agreements):.2f}) | {statistics.geometric_mean(speedups):.2f}x "
            f"({min(speedups):.2f}-{max(speedups):.2f}) | {positions} | "
            f"{statistics.geometric_mean(bounds):.2f}x | {statistics.geometric_mean(ours_over):.2f} | {equal}/{total} |"
        )
    lines += [
        "",
        "Ceiling per prompt: the best speedup rounds of one k can reach with the variant's "
        "measured run lengths of agreement and costs (`ceiling`; k in brackets):",
        "",
        "| variant | " + " | ".join(runs) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]
    for variant in variants:
        per = readings[variant.name]
        draft_ms = statistics.median(t for r in per.values() for t in r.token_ms)
        cells = [ceiling(per[p].agreed, draft_ms, costs) for p in runs]
        lines.append(
            f"| {variant.name} | " + " | ".join(f"{c:.2f}x (k={k})" for c, k in cells) + " |"
        )
    lines += [
        "",
        "Per prompt (speedup over target-only, paired 95% interval where 2+ repeats; agreement):",
        "",
    ]
    for prompt in runs:
        cells = []
        for variant in variants:
            paired = paired_ratio(runs[prompt][variant.name], runs[prompt][TARGET_ONLY])
            interval = f" [{paired[1]:.2f}, {paired[2]:.2f}]" if paired else ""
            cells.append(
                f"{variant.name} {_ratio(runs[prompt][variant.name], runs[prompt][TARGET_ONLY]):.2f}x"
                f"{interval} (a={readings[variant.name][prompt].agreement:.2f})"
            )
        lines.append(f"- {prompt}: " + "; ".join(cells))
    lines.append("")
    return "\n".join(lines)


def _ratio(method_runs: list[Run], baseline_runs: list[Run]) -> float:
    return statistics.median(r.tokens_per_s for r in method_runs) / statistics.median(
        r.tokens_per_s for r in baseline_runs
    )


def _by_position(stats: list, k: int) -> str:
    drafted = [
        sum(s.drafted_per_position[i] for s in stats if len(s.drafted_per_position) > i)
        for i in range(k)
    ]
    accepted = [
        sum(s.accepted_per_position[i] for s in stats if len(s.accepted_per_position) > i)
        for i in range(k)
    ]
    return " ".join(f"{a / d:.2f}" if d else "-" for a, d in zip(accepted, drafted))


if __name__ == "__main__":
    gc.collect()
    sys.exit(main())
