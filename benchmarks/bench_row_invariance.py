"""What row invariance costs and what it buys, per precision, through the workers' own path.

    python -m benchmarks rows [--model smollm2-135m] [--repeats 7] [--prefixes 20]

1. The row check (`common.row_check`): over random prefixes, one pass over 8 new tokens
   against eight passes over 1 (ModelSession, the workers' path): rows that differ in
   any bit and argmaxes that flip, invariance off and on.
2. The cost (`common.step_costs`): a step of w new tokens for each of s sessions (one
   batched pass, forward_segments as the step scheduler runs it) over 256 cached tokens,
   at w = 1, 5, 9 and s = 1, 8; off and on timed alternately in the same process
   (paired), median of the repeats; on over off per repeat, median and range.
Off is the worker's path as it was: oneDNN-packed linears in fp32, plain ones in bf16.
Appends a section per precision to --out.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import common
from model_runtime.loading import load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks rows", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefixes", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(common.RESULTS / "row_invariance.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        off = load_model(args.model, dtype=dtype, row_invariant="off")
        on = load_model(args.model, dtype=dtype, row_invariant="on")
        checks = {
            name: common.row_check(loaded.model, off.vocab_size, args.prefixes)
            for name, loaded in (("off", off), ("on", on))
        }
        timed = common.step_costs({"off": off.model, "on": on.model}, off.vocab_size, args.repeats)
        lines = common.section(
            f"Row invariance: {args.model}, {dtype}",
            "rows",
            argv,
            f"{args.threads} torch threads. Invariant linears chosen here: "
            f"{on.row_invariance.describe()}.",
        )
        lines += common.invariance_lines(args.prefixes, args.repeats, checks, timed)
        common.write_results(args.out, lines)
        del off, on
    return 0


if __name__ == "__main__":
    sys.exit(main())
