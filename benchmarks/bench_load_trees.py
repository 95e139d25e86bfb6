"""Token trees against chains under load, paired in one run.

    .venv/bin/python -m benchmarks.bench_load_trees --concurrency 1,8,32 --repeats 3   # SmolLM2 + n-gram (~25 min)
    .venv/bin/python -m benchmarks.bench_load_trees --pair tiny --concurrency 1,2 --max-new-tokens 8 \\
        --requests-per-client 2 --repeats 1 --out /tmp/trees                          # checks the script

The draft worker's tree width is a start-up setting, so each width needs its own system.
Per repeat, one system per width (`--widths`, the first the chains' 1), in turns rotated
repeat by repeat, each running `bench_load`'s closed loop at every level for k=0, fixed k
and adaptive k, methods rotated per level. Every output must equal its prompt's k=0
reference, as in `bench_load`.

The figure: each method's steady tokens/s with trees over the same method's with chains
in the same repeat (the two systems ran back to back). k=0 never proposes, so its own
trees-over-chains ratio measures nothing but the machine's drift between the two
systems: the noise the other ratios carry. A width slows the worker only where its ratio
is below k=0's by more than that spread.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from pathlib import Path

from benchmarks.bench_load import (
    BASELINE,
    PAIRS,
    Run,
    _levels,
    _spread,
    closed_loop,
    methods_for,
    parse,
    percentile,
    reference_pass,
    rotated,
    running_system,
    summarize,
    warm_up,
)


def measure(args, widths: list[int]) -> dict[int, Run]:
    """A Run per width, its cells tagged with their repeat; one system per (repeat, width)."""
    pair, methods = PAIRS[args.pair], methods_for(args.k, args.adaptive_max_k)
    runs = {width: Run() for width in widths}
    for repeat in range(args.repeats):
        for width in rotated(widths, repeat):
            run, system_args = runs[width], copy.copy(args)
            system_args.tree_width = width
            print(f"repeat {repeat}, tree width {width}", flush=True)
            with running_system(pair, system_args) as stub:
                warm_up(stub, pair, methods, args)
                run.add(reference_pass(stub, pair, methods[0], args))
                for turn, concurrency in enumerate(args.concurrency):
                    for method in rotated(methods, turn + repeat):
                        run.add(closed_loop(stub, pair, method, concurrency, args, repeat=repeat))
    return runs


def paired(runs: dict[int, Run], width: int, chains: int = 1) -> dict[tuple[str, float], list[float]]:
    """(method, concurrency) -> steady tok/s at `width` over the chains' in the same repeat, repeat by repeat."""
    steady = {w: {(c.method, c.load, c.repeat): summarize(c).steady_tokens_per_s for c in runs[w].cells
                  if c.phase == "closed"} for w in (width, chains)}
    ratios: dict[tuple[str, float], list[float]] = {}
    for (method, load, repeat), value in steady[width].items():
        base = steady[chains].get((method, load, repeat))
        if value and base:
            ratios.setdefault((method, load), []).append(value / base)
    return ratios


def verdicts(ratios: dict[tuple[str, float], list[float]]) -> dict[tuple[str, float], str]:
    """Per method and level: 'slower' where the median ratio is below the lowest of k=0's
    own ratios at that level (its spread is the noise), else 'not slower'."""
    out = {}
    for (method, load), values in ratios.items():
        if method == BASELINE:
            continue
        noise = ratios.get((BASELINE, load), [1.0])
        out[(method, load)] = "slower" if percentile(values, 50) < min(noise) else "not slower"
    return out


def markdown(runs: dict[int, Run], widths: list[int], args, command: str) -> list[str]:
    methods = methods_for(args.k, args.adaptive_max_k)
    closed = {w: [summarize(c) for c in r.cells if c.phase == "closed"] for w, r in runs.items()}
    exact = {w: sum(s.completed - s.mismatches for s in cells) for w, cells in closed.items()}
    completed = {w: sum(s.completed for s in cells) for w, cells in closed.items()}
    failed = {w: sum(sum(s.failed.values()) for s in cells) for w, cells in closed.items()}
    lines = [f"# Token trees against chains under load, {args.pair}", "", f"    {command}", "",
             f"{args.repeats} repeats; a system per (repeat, width), widths in rotated turns; closed loop, "
             f"{args.duration_s:g} s or {args.requests_per_client} requests a client, "
             f"{args.max_new_tokens} new tokens.",
             "Closed-loop outputs equal to the k=0 reference: "
             + ", ".join(f"width {w}: {exact[w]} of {completed[w]}" for w in widths)
             + "; failed requests: " + ", ".join(f"width {w}: {failed[w]}" for w in widths) + ".", ""]
    for width in widths[1:]:
        ratios = paired(runs, width, widths[0])
        judged = verdicts(ratios)
        lines += [f"## Width {width} over width {widths[0]}: steady tok/s, same method, same repeat", "",
                  "median (lowest-highest) over repeats; k=0's column is the noise (it never proposes)", "",
                  "| concurrency | " + " | ".join(m.name for m in methods) + " |",
                  "|---" * (len(methods) + 1) + "|"]
        for load in args.concurrency:
            cells = []
            for method in methods:
                cell = _spread(ratios.get((method.name, load), []))
                if (method.name, load) in judged:
                    cell += f", {judged[(method.name, load)]}"
                cells.append(cell)
            lines.append(f"| {load:g} | " + " | ".join(cells) + " |")
        lines.append("")
    for width in widths:
        lines += [f"## Width {width}: steady tok/s by repeat", "", "| method | concurrency | " +
                  " | ".join(f"repeat {r}" for r in range(args.repeats)) + " |",
                  "|---|---" + "|---" * args.repeats + "|"]
        for method in methods:
            for load in args.concurrency:
                values = {c.repeat: summarize(c).steady_tokens_per_s for c in runs[width].cells
                          if (c.phase, c.method, c.load) == ("closed", method.name, load)}
                lines.append(f"| {method.name} | {load:g} | " +
                             " | ".join(f"{values[r]:.1f}" if values.get(r) else "-" for r in range(args.repeats))
                             + " |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--widths", type=_levels, default=[1, 4], help="tree widths, the chains' 1 first")
    own_args, rest = own.parse_known_args(argv)
    args = parse(rest + (["--open-loop-fractions", ""] if "--open-loop-fractions" not in rest else []))
    widths = own_args.widths
    if len(widths) < 2 or widths[0] != 1:
        raise SystemExit("--widths: the chains' 1 first, then at least one tree width")
    command = "python -m benchmarks.bench_load_trees " + shlex.join(argv)
    runs = measure(args, widths)
    lines = markdown(runs, widths, args, command)
    out = Path(args.out)
    (out / f"results_load_trees_{args.pair}.md").write_text("\n".join(lines))
    (out / f"runs_load_trees_{args.pair}.json").write_text(json.dumps(
        {str(w): [{"method": c.method, "load": c.load, "repeat": c.repeat,
                   "steady_tokens_per_s": summarize(c).steady_tokens_per_s}
                  for c in r.cells if c.phase == "closed"] for w, r in runs.items()}, indent=1))
    print("\n".join(lines))
    mismatches = sum(len(r.mismatches) for r in runs.values())
    if mismatches:
        print(f"FAILED: {mismatches} outputs differ from the target-only reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
