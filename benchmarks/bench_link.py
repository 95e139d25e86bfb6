"""Do stretches and draft_stop pay where they are meant to: across a link between draft
and target? Each switched against the draft worker's defaults, through the services.

    .venv/bin/python -m benchmarks.bench_link --pair smollm2          # n-gram drafter
    .venv/bin/python -m benchmarks.bench_link --pair qwen --repeats 1 # ngram+model, 0.5B int8
    .venv/bin/python -m benchmarks.bench_link --pair tiny --delays 1 --prompts chat \\
        --max-new-tokens 8 --repeats 1 --out /tmp/link                 # checks the script

Method (`bench_pipeline.PinnedSystem`): the target worker pinned to CPU 1 behind a
delaying TCP proxy (one-way delay 1, 5 and 20 ms), every draft worker and orchestrator
on CPU 0, one torch thread each, as on two machines. Per delay one system: draft
workers with the defaults ("all on"), with `--disable stretches`, and (a pair with a draft
model) with `--disable draft_stop`, each behind its own orchestrator. Adaptive k <= 8, greedy,
chat template, a new session per call; methods interleaved per prompt and rotated per
repeat. Cells: tokens/s over all on's in the same repeat (geometric mean over repeats).
Writes results_link_<pair>.md to --out as it goes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_pipeline import ALL_PROMPTS, PAIRS, PinnedSystem, generate
from benchmarks.bench_suite import ADAPTIVE_MAX_K, chosen, hardware

REPO = Path(__file__).resolve().parent.parent
BASE = "all on"
QWEN_DRAFT = ["--quantization", "int8-dynamic"]  # the pair's draft, as make run starts it


def variants(pair_name: str, only: str = "") -> dict[str, list[str]]:
    """Draft workers by name: their flags (only: a comma-separated subset beside all on)."""
    extra = QWEN_DRAFT if pair_name == "qwen" else []
    out = {BASE: [*extra], "stretches off": [*extra, "--disable", "stretches"]}
    if PAIRS[pair_name].draft:  # draft_stop acts on a model drafter only
        out["draft_stop off"] = [*extra, "--disable", "draft_stop"]
    return {name: out[name] for name in chosen(out, only, (BASE,), "variant")}


def measure(pair_name: str, drafter: str, delay_ms: float, args, rates: dict) -> None:
    """Fills rates[(delay, prompt, variant)] with tokens/s, one per repeat."""
    pair, table = PAIRS[pair_name], variants(pair_name, args.variants)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-link-"))
    with PinnedSystem(pair, delay_ms, log_dir, variants=table) as stubs:
        for name in table:  # warm-up
            generate(stubs[name], pair, "Hello!", 8, ADAPTIVE_MAX_K, drafter)
        names = list(table)
        for prompt in args.prompts.split(","):
            outputs = []
            for repeat in range(args.repeats):
                turn = repeat % len(names)
                for name in names[turn:] + names[:turn]:
                    start = time.perf_counter()
                    tokens, stats = generate(
                        stubs[name],
                        pair,
                        ALL_PROMPTS[prompt],
                        args.max_new_tokens,
                        ADAPTIVE_MAX_K,
                        drafter,
                    )
                    seconds = max(1e-9, time.perf_counter() - start - stats.prefill_ns * 1e-9)
                    rates.setdefault((delay_ms, prompt, name), []).append(len(tokens) / seconds)
                    outputs.append(tokens)
                    print(
                        f"+{delay_ms:g} ms {prompt} {name} #{repeat}: {len(tokens) / seconds:.2f} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
            rates["mismatches"] = rates.get("mismatches", 0) + sum(o != outputs[0] for o in outputs)
            rates["runs"] = rates.get("runs", 0) + len(outputs)


def report(pair_name: str, drafter: str, rates: dict, args, command: str) -> str:
    names = list(variants(pair_name, args.variants))
    lines = [
        f"# Stretches and draft_stop across a link, {pair_name} ({drafter})",
        "",
        f"Command: `{command}`",
        "",
        f"Hardware: {hardware()}. Target pinned to one core behind a delay proxy, draft and "
        f"orchestrators on the other, one torch thread each. Adaptive k <= {ADAPTIVE_MAX_K}, "
        f"greedy, {args.max_new_tokens} new tokens, {args.repeats} interleaved repeat(s). "
        f"Cells: tokens/s of {BASE} (median), and each switch over {BASE} in the same repeat "
        "(geometric mean; in brackets the lowest and highest repeat).",
        "",
    ]
    delays = sorted({key[0] for key in rates if isinstance(key, tuple)})
    for delay in delays:
        prompts = list(dict.fromkeys(k[1] for k in rates if isinstance(k, tuple) and k[0] == delay))
        lines += [
            f"## +{delay:g} ms one way",
            "",
            "| prompt | " + " | ".join(names) + " |",
            "|---" * (1 + len(names)) + "|",
        ]
        overall = {name: [] for name in names[1:]}
        for prompt in prompts:
            base = rates.get((delay, prompt, BASE), [])
            cells = [f"{statistics.median(base):.2f} tok/s" if base else "-"]
            for name in names[1:]:
                ratios = [m / b for m, b in zip(rates.get((delay, prompt, name), []), base)]
                overall[name] += ratios
                cells.append(
                    f"{statistics.geometric_mean(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                    if ratios
                    else "-"
                )
            lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
        lines.append(
            "| geometric mean | | "
            + " | ".join(
                f"{statistics.geometric_mean(r):.3f}" if r else "-" for r in overall.values()
            )
            + " |"
        )
        lines.append("")
    lines.append(
        f"Outputs that differ from the prompt's first output: {rates.get('mismatches', 0)} of "
        f"{rates.get('runs', 0)}."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_link", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--drafter", default="", help="default: the pair's last (ngram+model)")
    parser.add_argument("--delays", default="1,5,20", help="one-way delays in ms")
    parser.add_argument("--prompts", default="chat,code_new,code_edit,summary,explain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default="", help='e.g. "draft_stop off" (default: all)')
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 CPUs: the draft side on one, the target on the other")
    drafter = args.drafter or PAIRS[args.pair].drafters[-1]
    command = "python -m benchmarks.bench_link " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    path = Path(args.out) / f"results_link_{args.pair}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    rates: dict = {}
    for delay in [float(d) for d in args.delays.split(",")]:
        measure(args.pair, drafter, delay, args, rates)
        path.write_text(report(args.pair, drafter, rates, args, command))
    print(path.read_text())
    return 0 if rates.get("mismatches", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
