"""python -m report TRACE.jsonl [TRACE2.jsonl ...] [--plots DIR] [--target-step-ms MS]
python -m report --metrics-url http://draft:9464/metrics [--target-step-ms MS]"""

from __future__ import annotations

import argparse
import sys

from report.analysis import analyse, render
from report.live import render_live, scrape
from report.model import K_MAX
from report.plots import write_plots
from report.traces import read_spans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m report",
        description=(
            "Acceptance, time split, measured speedup and break-even delay of speculative decoding, "
            "from the services' JSON-lines span files (or live /metrics)."
        ),
    )
    parser.add_argument(
        "traces", nargs="*", help="span files written with --trace-exporter jsonl (any number)"
    )
    parser.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="a Prometheus /metrics URL to read instead of traces (repeatable)",
    )
    parser.add_argument(
        "--plots", metavar="DIR", help="write speedup_vs_k.png and speedup_vs_delay.png here"
    )
    parser.add_argument(
        "--target-step-ms",
        type=float,
        default=None,
        help="target-only decoding time per token; default: measured from target-only "
        "(Decode) spans in the traces, else estimated from the verification times",
    )
    parser.add_argument("--k-max", type=int, default=K_MAX, help="largest k the model considers")
    args = parser.parse_args(argv)
    target_step_ns = args.target_step_ms * 1e6 if args.target_step_ms else None
    if args.metrics_url:
        print(render_live(scrape(args.metrics_url), target_step_ns))
        return 0
    if not args.traces:
        parser.error("give span files, or --metrics-url")
    report = analyse(read_spans(args.traces), target_step_ns)
    print(render(report, args.k_max))
    if args.plots and report.model is not None:
        for path in write_plots(report, args.plots, args.k_max):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
