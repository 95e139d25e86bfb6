"""What row invariance costs and what it buys, per precision, through the workers' own path.

    python -m benchmarks.bench_row_invariance [--model smollm2-135m] [--repeats 7] [--prefixes 20]

1. The row check: over random prefixes, one pass over 8 new tokens against eight
   passes over 1 (ModelSession, the workers' path): rows that differ in any bit and
   argmaxes that flip, invariance off and on.
2. The cost: a step of w new tokens for each of s sessions (one batched pass,
   forward_segments as the step scheduler runs it) over 256 cached tokens, at w = 1, 5,
   9 and s = 1, 8; off and on timed alternately in the same process (paired), median
   of the repeats; on over off per repeat, median and range.
Off is the worker's path as it was: oneDNN-packed linears in fp32, plain ones in bf16.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from model_runtime.batched_forward import Segment, SequenceKV, forward_segments
from model_runtime.loading import load_model
from model_runtime.model_session import ModelSession

REPO = Path(__file__).resolve().parent.parent
WIDTHS = (1, 5, 9)
SESSIONS = (1, 8)
CACHED = 256
NEW = 8


def row_check(model, vocab: int, prefixes: int, seed: int = 0) -> tuple[int, int, int, float]:
    """(rows differing, argmax flips, rows, largest difference) of wide against narrow passes."""
    generator = torch.Generator().manual_seed(seed)
    differing = flips = rows = 0
    largest = 0.0
    for _ in range(prefixes):
        prefix = torch.randint(0, vocab, (64,), generator=generator).tolist()
        new = torch.randint(0, vocab, (NEW,), generator=generator).tolist()
        wide, narrow = ModelSession(model, 1024), ModelSession(model, 1024)
        for session in (wide, narrow):
            session.append(prefix)
            session.prefill()
        wide.append(new)
        wide_rows = wide.logits(NEW + 1)[1:]
        narrow.logits(1)
        narrow_rows = []
        for token in new:
            narrow.append([token])
            narrow_rows.append(narrow.logits(1))
        narrow_rows = torch.cat(narrow_rows)
        differing += int((wide_rows != narrow_rows).any(-1).sum())
        flips += int((wide_rows.argmax(-1) != narrow_rows.argmax(-1)).sum())
        rows += NEW
        largest = max(largest, float((wide_rows.float() - narrow_rows.float()).abs().max()))
    return differing, flips, rows, largest


def _sessions(model, vocab: int, count: int) -> list[SequenceKV]:
    caches = []
    for index in range(count):
        kv = SequenceKV()
        forward_segments(
            model, [Segment(kv, 0, [(7 * index + j) % vocab for j in range(CACHED)], 0)]
        )
        caches.append(kv)
    return caches


def step_ms(
    model, caches: list[SequenceKV], width: int, vocab: int, synchronize=lambda: None
) -> float:
    segments = [
        Segment(kv, CACHED, [(11 * i + j) % (vocab - 1) + 1 for j in range(width)], width)
        for i, kv in enumerate(caches)
    ]
    synchronize()
    start = time.perf_counter()
    forward_segments(model, segments)
    synchronize()
    return (time.perf_counter() - start) * 1e3


def costs(models: dict, vocab: int, repeats: int, synchronize=lambda: None) -> dict:
    """{(sessions, width): {name: [ms per repeat]}}, the models timed alternately."""
    result = {}
    for sessions in SESSIONS:
        caches = {name: _sessions(model, vocab, sessions) for name, model in models.items()}
        for width in WIDTHS:
            samples = {name: [] for name in models}
            for repeat in range(repeats + 1):
                for name, model in models.items():
                    ms = step_ms(model, caches[name], width, vocab, synchronize)
                    if repeat:  # the first is untimed
                        samples[name].append(ms)
            result[sessions, width] = samples
    return result


def report(args, dtype: str, checks: dict, timed: dict, describe: str) -> list[str]:
    lines = [
        f"## {args.model}, {dtype}",
        "",
        f"Invariant linears chosen here: {describe}.",
        "",
        f"Row check ({args.prefixes} random 64-token prefixes, {NEW} new tokens: one pass against {NEW}):",
        "",
        "| invariance | rows differing | argmax flips | largest difference |",
        "|---|---|---|---|",
    ]
    for name, (differing, flips, rows, largest) in checks.items():
        lines.append(f"| {name} | {differing} of {rows} | {flips} | {largest:.3g} |")
    lines += [
        "",
        f"Step time over {CACHED} cached tokens (ms, median of {args.repeats}; on over off paired per repeat):",
        "",
        "| sessions | new tokens each | off | on | on / off (range) |",
        "|---|---|---|---|---|",
    ]
    for (sessions, width), samples in timed.items():
        ratios = sorted(a / b for a, b in zip(samples["on"], samples["off"]))
        lines.append(
            f"| {sessions} | {width} | {statistics.median(samples['off']):.1f} | "
            f"{statistics.median(samples['on']):.1f} | {statistics.median(ratios):.2f}x "
            f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
        )
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_row_invariance", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefixes", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results_row_invariance.md"),
        help="'' = print only",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    lines = [
        "# Row invariance: what it buys and what it costs",
        "",
        f"Command: `python -m benchmarks.bench_row_invariance {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        f"Host: {cpu}, {args.threads} torch threads, torch {torch.__version__}.",
        "",
    ]
    for dtype in args.dtypes.split(","):
        off = load_model(args.model, dtype=dtype, row_invariant="off")
        on = load_model(args.model, dtype=dtype, row_invariant="on")
        checks = {
            name: row_check(loaded.model, off.vocab_size, args.prefixes)
            for name, loaded in (("off", off), ("on", on))
        }
        timed = costs({"off": off.model, "on": on.model}, off.vocab_size, args.repeats)
        lines += report(args, dtype, checks, timed, on.row_invariance.describe())
        print("\n".join(lines), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("\n".join(lines))
        del off, on
    return 0


if __name__ == "__main__":
    sys.exit(main())
