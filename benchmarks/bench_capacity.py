"""Capacity: what a draft pool buys a target, on real processes, beside the fleet model.

    .venv/bin/python -m benchmarks capacity                      # SmolLM2-135M, int8 self-draft
    .venv/bin/python -m benchmarks capacity --pair tiny-self --layouts target-only,remote:0 \\
        --rates 2,4 --requests 6 --max-new-tokens 8 --out /tmp/capacity.md  # checks the script

The target worker alone on one core (`--cpus target=N`, one torch thread). Layouts:
`target-only` (k = 0), `co-located` (the draft worker on the target's core) and
`remote:D` (the draft worker on the other core behind a delay proxy of D ms each way; 0
is loopback). The orchestrator, the delay proxy and this load generator run on the
other core, beside a remote draft. Per layout and rate: Poisson arrivals (`planner.fleet.
poisson_arrivals`, the same times for every layout), MT-bench first turns in turn,
greedy, fp32, a fixed number of new tokens, fixed k (or `--adaptive`). Every output must equal its
prompt's target-only reference (else exit status 1).

Measured as the fleet model measures (planner/fleet.py), the first --warmup share of
requests left out: output tokens/s per target core (tokens that arrived between the
first measured arrival and the last arrival, over that time), time per output token p50
and p90 per request ((last - first token) / (tokens - 1)), time to first token p90, the
mean queue (the target's waits over the time, Little's law), the tokens served while
busy, and the goodput: the highest rate below saturation (`planner.validate`) with TPOT
p90 within --objective-x times the unloaded target-only TPOT. The model then runs on
costs fitted from this run's own traces (`planner.measured`; the target's passes from
the layouts that leave its core alone, the draft's steps from the remote ones), on the
same arrivals, and each cell is shown beside it with its error. The run's records are
written first; `--from-run` sets the model beside a saved run again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import common, workloads
from benchmarks.common import Method, RequestRecord, percentile, send
from planner import fleet, measured, validate
from planner.costs import Costs, Request
from planner.validate import Point
from report.traces import read_spans

# The target's core and the one for the rest: the first two this process may run on.
TARGET_CORE, OTHER_CORE = (sorted(os.sched_getaffinity(0)) * 2)[:2]


@dataclass(frozen=True)
class Placement:
    """Where the draft runs: none (target-only), on the target's core, or apart behind a link."""

    kind: str  # "target-only", "co-located" or "remote"
    one_way_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Placement:
        kind, _, delay = text.partition(":")
        if kind not in ("target-only", "co-located", "remote") or (delay and kind != "remote"):
            raise argparse.ArgumentTypeError(
                f"a layout is target-only, co-located or remote:MS, got {text!r}"
            )
        return cls(kind, float(delay or 0))

    @property
    def label(self) -> str:
        return f"remote, {self.one_way_ms:g} ms" if self.kind == "remote" else self.kind

    def cpus(self) -> list[tuple[str, frozenset[int]]]:
        draft = TARGET_CORE if self.kind == "co-located" else OTHER_CORE
        pools = {
            "target": TARGET_CORE,
            "draft": draft,
            "orchestrator": OTHER_CORE,
            "proxy": OTHER_CORE,
        }
        return [(pool, frozenset({core})) for pool, core in pools.items()]

    def cell(self, local_ms: float) -> fleet.Cell:
        layout = {"target-only": fleet.Layout.TARGET_ONLY, "co-located": fleet.Layout.COLOCATED}
        if self.kind != "remote":
            return fleet.Cell(layout[self.kind])
        return fleet.Cell(fleet.Layout.REMOTE, 1, 1, (self.one_way_ms + local_ms,))


def arrivals_s(rate: float, args, turn: int) -> list[float]:
    """The rate's Poisson arrivals in seconds: the fleet model's own (planner.fleet)."""
    return [ms / 1e3 for ms in fleet.poisson_arrivals(rate, args.requests, args.seed + turn)]


def measure(records: list[RequestRecord], arrivals: list[float], rate: float, warmup: int):
    """A cell's numbers, counted as planner.fleet.Simulation counts them."""
    kept = [r for r in records[warmup:] if r.ok and len(r.token_ids) > 1]
    start, end = arrivals[min(warmup, len(arrivals) - 1)], arrivals[-1]
    window = max(end - start, 1e-9)
    chunks = [(t, n) for r in records for t, n in zip(r.chunk_s, r.chunk_tokens)]
    tpot = [(r.chunk_s[-1] - r.chunk_s[0]) * 1e3 / (len(r.token_ids) - 1) for r in kept]
    return Point(
        rate,
        sum(n for t, n in chunks if start <= t <= end) / window,
        percentile(tpot, 50) or 0.0,
        percentile(tpot, 90) or 0.0,
        percentile([r.ttft_s * 1e3 for r in kept], 90) or 0.0,
        sum(r.queue_ns for r in records[warmup:]) * 1e-9 / window,  # Little's law
        sum(n for _, n in chunks) / max(max((t for t, _ in chunks), default=0) - arrivals[0], 1e-9),
    )


def open_loop(stub, pair, method, texts, arrivals, args) -> list[RequestRecord]:
    """One request per arrival, sent at its time whatever is in flight."""
    zero = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, len(arrivals))) as pool:
        futures = []
        for index, at in enumerate(arrivals):
            time.sleep(max(0.0, zero + at - time.perf_counter()))
            record = RequestRecord(method.name, str(index % len(texts)), index, scheduled_s=at)
            text = texts[index % len(texts)]
            futures.append(pool.submit(send, stub, pair, method, record, zero, args, text))
        return [future.result() for future in futures]


def trace_file(trace_dir: Path, placement: Placement, pool: str) -> Path:
    return trace_dir / f"{placement.label.replace(', ', '-').replace(' ', '')}-{pool}.jsonl"


def run_layout(placement, pair, texts, reference, args, trace_dir) -> dict[float, list]:
    """{rate: records} of one layout; where `reference` (prompt -> token ids) is empty, fills
    it from a k = 0 request per prompt, one at a time, whose records are rate 0's."""
    speculating = placement.kind != "target-only"
    method = Method(placement.label, args.k if speculating else 0, args.adaptive and speculating)
    exporter = ["--trace-exporter", "jsonl", "--trace-file"]
    flags = {p: [*exporter, str(trace_file(trace_dir, placement, p))] for p in ("target", "draft")}
    options = pair.launcher_options() | {"threads": 1, "cpus": placement.cpus()}
    records = {}
    with common.services(flags, placement.one_way_ms, **options) as stub:
        for text in texts[:2]:  # warm-up: first calls pay one-off costs
            send(stub, pair, method, RequestRecord("", "", 0), time.perf_counter(), args, text)
        if not reference:
            base, new = Method("reference", 0), lambda i: RequestRecord("reference", str(i), 0)
            records[0.0] = [
                send(stub, pair, base, new(i), 0.0, args, t) for i, t in enumerate(texts)
            ]
            reference.update({r.prompt: r.token_ids for r in records[0.0]})
        for turn, rate in enumerate(args.rates):
            arrivals = arrivals_s(rate, args, turn)
            records[rate] = open_loop(stub, pair, method, texts, arrivals, args)
            for r in records[rate]:
                r.matches_reference = r.ok and r.token_ids == reference[r.prompt]
            got = measure(records[rate], arrivals, rate, int(args.warmup * args.requests))
            print(f"{placement.label}, {rate:g}/s: {got}", flush=True)
    return records


def fitted_costs(trace_dir: Path, placements, references: list[RequestRecord], args) -> Costs:
    """The fleet model's inputs from this run's traces (planner.measured): the target's
    passes where its core was its own, the draft's steps where the draft had its own, the
    local link from loopback's rounds."""
    targets = [trace_file(trace_dir, p, "target") for p in placements if p.kind != "co-located"]
    drafts = [trace_file(trace_dir, p, "draft") for p in placements if p.kind == "remote"]
    loopback = read_spans([trace_file(trace_dir, Placement("remote"), "draft")])
    request = Request(
        round(statistics.fmean(r.prompt_tokens for r in references)),
        round(statistics.fmean(len(r.token_ids) for r in references)),
        f"{len(references)} {args.workload} first turns: their mean prompt and output",
    )
    return measured.costs_from_traces(
        [*targets, *drafts],
        one_way_ms=0.0,
        local_one_way_ms=measured.link_from_spans(loopback, 0.0).local_one_way_ms,
        k_max=max(args.k, 1),
        request=request,
        max_sessions=32,
    )


def setting_of(args) -> fleet.Speculation:
    """The speculation the layouts with a draft run, as the fleet model names it."""
    return fleet.Speculation(None, args.k) if args.adaptive else fleet.Speculation(args.k)


def compare(runs: dict, costs: Costs, args) -> dict[str, tuple[dict, dict]]:
    """{layout's label: (measured, modelled)}, each {rate: Point}."""
    out = {}
    for placement, records in runs.items():
        warmup = int(args.warmup * args.requests)
        got = {
            rate: measure(records[rate], arrivals_s(rate, args, turn), rate, warmup)
            for turn, rate in enumerate(args.rates)
        }
        cell = placement.cell(costs.link.local_one_way_ms)
        setting = fleet.TARGET_ONLY if placement.kind == "target-only" else setting_of(args)
        model = validate.modelled(
            costs, cell, setting, args.rates, args.requests, args.warmup, args.seed
        )
        out[placement.label] = (got, model)
    return out


def markdown(results: dict, bound_ms: float, costs: Costs, args, argv, exact: str) -> list[str]:
    new = costs.request.new_tokens
    lines = common.section(
        f"Capacity: {args.pair}, {setting_of(args).label}, {args.max_new_tokens} new tokens",
        "capacity",
        argv,
        f"Target on core {TARGET_CORE} (1 torch thread); orchestrator, proxy and load generator "
        f"on core {OTHER_CORE}; {args.requests} Poisson arrivals a rate (seed {args.seed} + the "
        f"rate's index), the first {args.warmup:.0%} left out. Exactness: {exact} outputs equal "
        f"target-only's. Objective: TPOT p90 <= {bound_ms:.0f} ms ({args.objective_x:g}x the "
        "unloaded target-only TPOT).",
    )
    goodputs = {
        label: [validate.goodput(points, new, bound_ms) for points in pair]
        for label, pair in results.items()
    }
    lines += [
        "| layout | goodput req/s, measured / model | over co-located | over target-only |",
        "|---|---|---|---|",
    ]
    for label, (got, model) in goodputs.items():
        over = [
            f"{got / goodputs[b][0]:.2f}x" if goodputs.get(b, [0])[0] else "-"
            for b in ("co-located", "target-only")
        ]
        lines.append(f"| {label} | {got:g} / {model:g} | {over[0]} | {over[1]} |")
    lines += [
        "",
        f"Model against measurement: {validate.verdict(list(results.values()), new)}.",
        "",
    ]
    for label, (got, model) in results.items():
        lines += [
            f"#### {label} (measured / model)",
            "",
            *validate.table(got, model, new),
            "",
        ]
    return lines + [
        f"Plot: `{Path(args.out).with_suffix('.png').name}`. Fitted costs (`planner.measured`, "
        f"from this run's traces): `{Path(args.out).with_suffix('.costs.json').name}`.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.from_run:  # the model again, on a run's records and traces
        runs, trace_dir = saved_run(args.from_run, args.layouts, args.traces)
    else:
        runs, trace_dir = measure_layouts(args)
    raw = {
        p.label: {str(r): [asdict(x) for x in cell] for r, cell in rs.items()}
        for p, rs in runs.items()
    }
    if not args.from_run:  # what was measured, first: the model may fail
        saved = {"settings": str(vars(args)), "traces": str(trace_dir), "cells": raw}
        common.write_results(args.out, [], saved)
    references = runs[args.layouts[0]].pop(0.0)
    costs = fitted_costs(trace_dir, args.layouts, references, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    costs.save(Path(args.out).with_suffix(".costs.json"))
    bound_ms = args.objective_x * measure(references, [0.0], 0.0, 0).tpot_p50_ms
    done = [r for rs in runs.values() for cell in rs.values() for r in cell if r.ok]
    equal = sum(r.matches_reference is True for r in done)
    results = compare(runs, costs, args)
    validate.plot(results, Path(args.out).with_suffix(".png"))
    lines = markdown(results, bound_ms, costs, args, argv, f"{equal} of {len(done)}")
    common.write_results(args.out, lines)
    return 0 if equal == len(done) else 1


def measure_layouts(args) -> tuple[dict[Placement, dict[float, list]], Path]:
    """{layout: {rate: records}} measured (rate 0: the references), and the traces' folder."""
    pair = common.PAIRS[args.pair]
    texts = [c.turns[0] for c in workloads.load(args.workload, per_category=args.per_category)]
    trace_dir = Path(tempfile.mkdtemp(prefix="capacity-"))
    print(f"traces in {trace_dir}", flush=True)
    reference: dict[str, list[int]] = {}
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {OTHER_CORE})  # the load generator, beside a remote draft
    try:
        runs = {p: run_layout(p, pair, texts, reference, args, trace_dir) for p in args.layouts}
    finally:
        os.sched_setaffinity(0, cores)
    return runs, trace_dir


def saved_run(path: str, placements: list[Placement], traces: str) -> tuple[dict, Path]:
    """measure_layouts' result, from a run's JSON (its last run) and traces' folder (the
    one it names, unless given)."""
    saved = json.loads(Path(path).read_text())[-1]
    cells = saved["cells"]
    runs = {
        p: {
            float(rate): [RequestRecord(**r) for r in records]
            for rate, records in cells[p.label].items()
        }
        for p in placements
    }
    return runs, Path(traces or saved["traces"])


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks capacity", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--pair", choices=sorted(common.PAIRS), default="smollm2-self")
    add("--workload", default="mt-bench", help="its first turns (benchmarks/workloads.py)")
    add("--per-category", type=int, default=2, help="prompts a category (MT-bench has 8)")
    layouts = "target-only,co-located,remote:0,remote:1,remote:5,remote:20"
    add("--layouts", default=layouts, type=lambda t: [Placement.parse(x) for x in t.split(",")])
    add("--rates", default=[0.5, 1, 2, 3, 5], type=lambda t: [float(x) for x in t.split(",")])
    add("--requests", type=int, default=30, help="arrivals a rate")
    add("--warmup", type=float, default=0.2, help="the share of arrivals left out of the measures")
    add("--max-new-tokens", type=int, default=32)
    add("--k", type=int, default=4, help="draft tokens a round (with --adaptive, the most)")
    add("--adaptive", action="store_true", help="the adaptive policy (speculative/policy.py)")
    add(
        "--objective-x",
        type=float,
        default=2.0,
        help="TPOT p90 bound over unloaded target-only TPOT",
    )
    add("--seed", type=int, default=0)
    add("--timeout-s", type=float, default=900.0)
    add("--out", default=str(common.RESULTS / "capacity.md"))
    add("--from-run", default="", help="no measuring: a run's JSON (its records), then ...")
    add("--traces", default="", help="... its traces' folder (default: the one the JSON names)")
    args = parser.parse_args(argv)
    if not args.from_run and len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two cores: the target's and the rest's")
    if args.layouts[0].kind != "target-only":
        parser.error("the first layout is target-only: it runs the reference outputs")
    return args


if __name__ == "__main__":
    sys.exit(main())
