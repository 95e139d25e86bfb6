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
systems; each repeat's ratio over k=0's removes it, and the 95% Student t interval of
those paired repeats says where trees are slower (or faster) beyond the noise.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass
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
    reference_pass,
    rotated,
    running_system,
    summarize,
    warm_up,
)
from benchmarks.bench_suite import ratio_interval


@dataclass(frozen=True)
class Row:
    """One closed-loop cell of one width's system: what the report reads (and the JSON keeps)."""

    width: int
    method: str
    load: float
    repeat: int
    steady_tokens_per_s: float | None
    completed: int
    exact: int
    failed: int


def measure(args, widths: list[int]) -> tuple[list[Row], int]:
    """The rows of every (repeat, width) system, and how many outputs differed from the reference."""
    pair, methods = PAIRS[args.pair], methods_for(args.k, args.adaptive_max_k)
    rows, mismatches = [], 0
    for repeat in range(args.repeats):
        for width in rotated(widths, repeat):
            run, system_args = Run(), copy.copy(args)
            system_args.tree_width = width
            print(f"repeat {repeat}, tree width {width}", flush=True)
            with running_system(pair, system_args) as stub:
                warm_up(stub, pair, methods, args)
                run.add(reference_pass(stub, pair, methods[0], args))
                for turn, concurrency in enumerate(args.concurrency):
                    for method in rotated(methods, turn + repeat):
                        cell = run.add(
                            closed_loop(stub, pair, method, concurrency, args, repeat=repeat)
                        )
                        s = summarize(cell)
                        rows.append(
                            Row(
                                width,
                                method.name,
                                concurrency,
                                repeat,
                                s.steady_tokens_per_s,
                                s.completed,
                                s.completed - s.mismatches,
                                sum(s.failed.values()),
                            )
                        )
            mismatches += len(run.mismatches)
    return rows, mismatches


def paired(
    rows: list[Row], width: int, chains: int = 1
) -> dict[tuple[str, float], dict[int, float]]:
    """(method, concurrency) -> {repeat: steady tok/s at `width` over the chains' in the same repeat}."""
    steady = {(r.width, r.method, r.load, r.repeat): r.steady_tokens_per_s for r in rows}
    ratios: dict[tuple[str, float], dict[int, float]] = {}
    for r in rows:
        base = steady.get((chains, r.method, r.load, r.repeat))
        if r.width == width and r.steady_tokens_per_s and base:
            ratios.setdefault((r.method, r.load), {})[r.repeat] = r.steady_tokens_per_s / base
    return ratios


def against_drift(
    ratios: dict[tuple[str, float], dict[int, float]],
) -> dict[tuple[str, float], tuple | None]:
    """Per method and level, each repeat's ratio over k=0's in the same repeat (what the
    machine moved between the two systems), read as paired repeats
    (bench_suite.ratio_interval: geometric mean, 95% interval; None below two)."""
    out = {}
    for (method, load), by_repeat in ratios.items():
        drift = ratios.get((BASELINE, load), {})
        corrected = [value / drift[r] for r, value in by_repeat.items() if r in drift]
        out[(method, load)] = None if method == BASELINE else ratio_interval(corrected)
    return out


def verdict(interval: tuple | None) -> str:
    if interval is None:
        return "-"
    ratio, low, high = interval
    where = "slower" if high < 1.0 else "faster" if low > 1.0 else "within the noise"
    return f"{ratio:.2f}x [{low:.2f}, {high:.2f}], {where}"


def markdown(rows: list[Row], command: str) -> list[str]:
    widths = sorted({r.width for r in rows})
    methods = list(
        dict.fromkeys(r.method for r in sorted(rows, key=lambda r: r.method != BASELINE))
    )
    loads, repeats = sorted({r.load for r in rows}), sorted({r.repeat for r in rows})
    counts = ", ".join(
        f"width {w}: {sum(r.exact for r in rows if r.width == w)} of "
        f"{sum(r.completed for r in rows if r.width == w)} equal to the k=0 reference, "
        f"{sum(r.failed for r in rows if r.width == w)} failed"
        for w in widths
    )
    lines = [
        "# Token trees against chains under load",
        "",
        f"    {command}",
        "",
        f"{len(repeats)} repeats; a system per (repeat, width), widths in rotated turns; closed loop "
        f"(`bench_load`). Closed-loop requests: {counts}.",
        "",
    ]
    others = [m for m in methods if m != BASELINE]
    for width in widths[1:]:
        ratios = paired(rows, width, widths[0])
        corrected = against_drift(ratios)
        lines += [
            f"## Width {width} over width {widths[0]}: steady tok/s, same method, same repeat",
            "",
            "Raw: median (lowest-highest) over repeats; k=0 never proposes, so its ratio is the machine's drift "
            "between the two systems. Over k=0's: each repeat's ratio over k=0's in that repeat, geometric "
            "mean [95% interval of paired repeats].",
            "",
            "| concurrency | k=0, raw (drift) | "
            + " | ".join(f"{m}, raw | {m}, over k=0's" for m in others)
            + " |",
            "|---|---" + "|---|---" * len(others) + "|",
        ]
        for load in loads:
            cells = [_spread(list(ratios.get((BASELINE, load), {}).values()))]
            for method in others:
                cells += [
                    _spread(list(ratios.get((method, load), {}).values())),
                    verdict(corrected.get((method, load))),
                ]
            lines.append(f"| {load:g} | " + " | ".join(cells) + " |")
        lines.append("")
    steady = {(r.width, r.method, r.load, r.repeat): r.steady_tokens_per_s for r in rows}
    for width in widths:
        lines += [
            f"## Width {width}: steady tok/s by repeat",
            "",
            "| method | concurrency | " + " | ".join(f"repeat {r}" for r in repeats) + " |",
            "|---|---" + "|---" * len(repeats) + "|",
        ]
        for method in methods:
            for load in loads:
                values = [steady.get((width, method, load, r)) for r in repeats]
                lines.append(
                    f"| {method} | {load:g} | "
                    + " | ".join(f"{v:.1f}" if v else "-" for v in values)
                    + " |"
                )
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument(
        "--widths", type=_levels, default=[1, 4], help="tree widths, the chains' 1 first"
    )
    own.add_argument(
        "--render", default="", help="a runs_load_trees JSON: write its report again, run nothing"
    )
    own_args, rest = own.parse_known_args(argv)
    args = parse(
        rest + (["--open-loop-fractions", ""] if "--open-loop-fractions" not in rest else [])
    )
    out, mismatches = Path(args.out), 0
    out.mkdir(parents=True, exist_ok=True)
    if own_args.render:
        saved = json.loads(Path(own_args.render).read_text())
        command, rows = saved["command"], [Row(**row) for row in saved["rows"]]
    else:
        if len(own_args.widths) < 2 or own_args.widths[0] != 1:
            raise SystemExit("--widths: the chains' 1 first, then at least one tree width")
        command = "python -m benchmarks.bench_load_trees " + shlex.join(argv)
        rows, mismatches = measure(args, own_args.widths)
        (out / f"runs_load_trees_{args.pair}.json").write_text(
            json.dumps(
                {"command": command, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1
            )
        )
    lines = markdown(rows, command)
    (out / f"results_load_trees_{args.pair}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if mismatches:
        print(
            f"FAILED: {mismatches} outputs differ from the target-only reference", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
