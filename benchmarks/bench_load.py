"""Load: throughput and latency of the services under concurrent sessions.

    .venv/bin/python -m benchmarks load                      # SmolLM2-135M, n-gram (< 25 min, 2 cores)
    .venv/bin/python -m benchmarks load --pair qwen          # Qwen2.5-Coder 1.5B target, 0.5B draft model
    .venv/bin/python -m benchmarks load --target-workers 2   # also two targets behind one orchestrator
    .venv/bin/python -m benchmarks load --tree-width 4       # token trees under load
    .venv/bin/python -m benchmarks load --concurrency 1,2 --max-new-tokens 16 --requests-per-client 2 \\
        --out /tmp/load.md                                     # checks the script (minutes)

The services run as local processes (`common.services`, loopback); the clients are
threads of this process calling `GenerateStream`: greedy, fp32, a fixed number of new
tokens, each request on a new session (closed after the call), `LOAD_PROMPTS`' ten kinds.
Methods: k=0 (target-only), fixed k, adaptive k.

1. Warm-up: one request per method.
2. Reference: one k=0 request per prompt, one session at a time. Every later output,
   whatever the method or load, must equal its prompt's reference token for token; a
   mismatch is printed and fails the run (exit status 1).
3. Closed loop, per concurrency c: c clients, each sending its next request as soon as
   its last one ended, until it has sent --requests-per-client or --duration-s has
   passed. Methods take turns per level in `round_order`; each level runs --repeats such
   turns back to back, and the paired table gives each method's steady tok/s over k=0's
   per turn, beside k=0's own turn-to-turn change (the noise). Open-loop arrivals are the
   capacity scenario's (`python -m benchmarks capacity`).
4. With --target-workers N > 1: a second system with N targets behind one
   orchestrator, closed loop at --scale-out-concurrency sessions, beside one worker.

Per cell (method, load; repeats pooled): aggregate tokens/s (first request sent to last
response), steady tokens/s (closed loop: while every client was still in flight,
`steady_window`), requests completed and failed (by gRPC status code), time to first
token (TTFT), per-token latency (a chunk of n tokens arriving g after the previous one
counts n tokens of g / n), the target's queue wait (`GenerationStats.queue_ns`) and
end-to-end latency, p50 and p95; each method over k=0, paired per repeat. Appends
a section to --out and every request's raw times to the JSON list beside it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from benchmarks import common
from benchmarks.common import Method, RequestRecord, percentile, send
from benchmarks.prompts import LOAD_PROMPTS

BASELINE = "k=0"  # target-only decoding: the method every ratio refers to


def load_methods(k: int, adaptive_max_k: int) -> list[Method]:
    """k=0 (the baseline, first), fixed k, adaptive k."""
    return [
        Method(BASELINE, 0),
        Method(f"k={k}", k),
        Method(f"adaptive k<={adaptive_max_k}", adaptive_max_k, True),
    ]


def inter_token_times(chunk_s: list[float], chunk_tokens: list[int]) -> list[float]:
    """[num_tokens - first chunk's] per-token latencies, in seconds: a chunk of n tokens
    arriving g after the previous chunk gives n samples of g / n."""
    samples = []
    for previous, now, count in zip(chunk_s, chunk_s[1:], chunk_tokens[1:]):
        samples += [(now - previous) / count] * count
    return samples


# --- statistics -------------------------------------------------------------------------


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base; None when either is missing or base is 0."""
    return value / base if value is not None and base else None


@dataclass
class Cell:
    """Every request of one method at one load."""

    phase: str  # "reference", "closed" or "closed, N target workers"
    method: str
    load: float  # concurrency
    seconds: float  # wall time, first request sent to last response
    records: list[RequestRecord]
    target_workers: int = 1
    repeat: int = 0  # closed loop: which of the --repeats of this method at this load
    # Closed loop: (tokens, seconds) while every client was in flight (steady_window).
    steady: tuple[int, float] | None = None


def steady_window(records: list[RequestRecord]) -> tuple[int, float]:
    """Closed loop: the tokens that arrived, and the seconds, from the first request
    sent until the first client sent no more: the span in which the load was the cell's
    whole concurrency (after it, clients drop out one by one)."""
    last_end: dict[int, float] = {}
    for record in records:
        last_end[record.client] = max(last_end.get(record.client, 0.0), record.end_s)
    if not last_end:
        return 0, 0.0
    start, end = min(r.start_s for r in records), min(last_end.values())
    tokens = sum(
        count for r in records if r.ok for t, count in zip(r.chunk_s, r.chunk_tokens) if t <= end
    )
    return tokens, end - start


def pooled(cells: list[Cell]) -> Cell:
    """The repeats of one method at one load as one cell: their requests together,
    their times (and steady windows) summed."""
    first, steady = cells[0], None
    if all(c.steady is not None for c in cells):
        steady = (sum(c.steady[0] for c in cells), sum(c.steady[1] for c in cells))
    records = [r for c in cells for r in c.records]
    seconds = sum(c.seconds for c in cells)
    return Cell(
        first.phase, first.method, first.load, seconds, records, first.target_workers, 0, steady
    )


@dataclass
class Summary:
    """A cell's numbers; latencies in milliseconds (e2e in seconds); None without samples."""

    completed: int
    failed: dict[str, int]  # {gRPC status code name: requests}
    mismatches: int  # completed outputs unlike the reference
    tokens_per_s: float
    steady_tokens_per_s: float | None  # closed loop: while every client was in flight
    requests_per_s: float  # completed
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    per_token_p50_ms: float | None
    per_token_p95_ms: float | None
    queue_p50_ms: float | None
    queue_p95_ms: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    acceptance: float | None  # accepted / drafted tokens, all requests together


def summarize(cell: Cell) -> Summary:
    done = [r for r in cell.records if r.ok]
    ttft = [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]
    per_token = [g * 1e3 for r in done for g in inter_token_times(r.chunk_s, r.chunk_tokens)]
    queue = [r.queue_ns * 1e-6 for r in done]
    e2e = [r.end_s - r.start_s for r in done]
    drafted = sum(r.num_drafted for r in done)
    seconds = cell.seconds or math.inf
    steady = cell.steady[0] / cell.steady[1] if cell.steady and cell.steady[1] > 0 else None
    return Summary(
        completed=len(done),
        failed=dict(Counter(r.status for r in cell.records if not r.ok)),
        mismatches=sum(r.matches_reference is False for r in done),
        tokens_per_s=sum(len(r.token_ids) for r in done) / seconds,
        steady_tokens_per_s=steady,
        requests_per_s=len(done) / seconds,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p95_ms=percentile(ttft, 95),
        per_token_p50_ms=percentile(per_token, 50),
        per_token_p95_ms=percentile(per_token, 95),
        queue_p50_ms=percentile(queue, 50),
        queue_p95_ms=percentile(queue, 95),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p95_s=percentile(e2e, 95),
        acceptance=sum(r.num_accepted for r in done) / drafted if drafted else None,
    )


def check_exactness(cell: Cell, reference: dict[str, list[int]]) -> list[str]:
    """Marks each completed request against its prompt's reference output; returns a line
    per mismatch."""
    lines = []
    for record in cell.records:
        if not record.ok:
            continue
        expected = reference[record.prompt]
        record.matches_reference = record.token_ids == expected
        if not record.matches_reference:
            at = next(
                (i for i, (a, b) in enumerate(zip(expected, record.token_ids)) if a != b),
                min(len(expected), len(record.token_ids)),
            )
            lines.append(
                f"{cell.phase} {cell.method} load {cell.load:g}, prompt {record.prompt}: first "
                f"difference at token {at}, expected {expected[at : at + 5]}, got "
                f"{record.token_ids[at : at + 5]} ({len(record.token_ids)} tokens, reference "
                f"{len(expected)})"
            )
    return lines


# --- runs -------------------------------------------------------------------------------


def closed_loop(
    stub,
    pair: common.Pair,
    method: Method,
    concurrency: int,
    args,
    phase="closed",
    workers=1,
    repeat=0,
) -> Cell:
    """`concurrency` clients, each sending its next request when its last one ended."""
    kinds = list(LOAD_PROMPTS)
    zero = time.perf_counter()

    def client(index: int) -> list[RequestRecord]:
        records = []
        for sent in range(args.requests_per_client):
            if time.perf_counter() - zero >= args.duration_s:
                break
            kind = kinds[(index + sent * concurrency) % len(kinds)]  # together: every kind
            record = RequestRecord(method.name, kind, index)
            records.append(send(stub, pair, method, record, zero, args, LOAD_PROMPTS[kind]))
        return records

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        records = [r for mine in pool.map(client, range(concurrency)) for r in mine]
    seconds = time.perf_counter() - zero
    return Cell(
        phase, method.name, concurrency, seconds, records, workers, repeat, steady_window(records)
    )


def reference_pass(stub, pair: common.Pair, method: Method, args) -> Cell:
    """k=0, one session at a time, every prompt once: the outputs every other run must equal."""
    zero = time.perf_counter()
    records = [
        send(
            stub, pair, method, RequestRecord(method.name, kind, 0), zero, args, LOAD_PROMPTS[kind]
        )
        for kind in LOAD_PROMPTS
    ]
    if failed := [f"{r.prompt}: {r.status} {r.detail}" for r in records if not r.ok]:
        raise SystemExit("the k=0 reference pass failed: " + "; ".join(failed))
    return Cell("reference", method.name, 1, time.perf_counter() - zero, records)


class LoadRun:
    """The cells of one benchmark run, checked against the reference as they come."""

    def __init__(self):
        self.started = time.monotonic()
        self.cells: list[Cell] = []
        self.reference: dict[str, list[int]] = {}
        self.mismatches: list[str] = []
        self.complete = False  # every phase ran

    def add(self, cell: Cell) -> Cell:
        if cell.phase == "reference":
            self.reference = {record.prompt: record.token_ids for record in cell.records}
        mismatches = check_exactness(cell, self.reference)
        self.mismatches += mismatches
        self.cells.append(cell)
        s = summarize(cell)
        load = f"c={cell.load:g}"
        print(
            f"[{time.monotonic() - self.started:5.0f} s] {cell.phase}, {cell.method}, {load}: "
            f"{s.completed} ok, failed {_failed(s.failed)}, {s.tokens_per_s:.1f} tok/s, TTFT p95 "
            f"{_num(s.ttft_p95_ms)} ms, {s.completed - s.mismatches}/{s.completed} exact",
            flush=True,
        )
        for line in mismatches:
            print(f"  MISMATCH {line}", flush=True)
        return cell

    def find(self, phase: str, method: str, load: float) -> Cell | None:
        """The cell of a method at a load, its repeats pooled; None if not run."""
        cells = [c for c in self.cells if (c.phase, c.method, c.load) == (phase, method, load)]
        return pooled(cells) if cells else None

    def loads(self, phase: str, method: str) -> list[Cell]:
        """The pooled cells of a method in a phase, by load."""
        loads = sorted({c.load for c in self.cells if (c.phase, c.method) == (phase, method)})
        return [self.find(phase, method, load) for load in loads]


def load_system(pair: common.Pair, args, target_workers: int = 1):
    return common.services(
        **pair.launcher_options(),
        target_workers=target_workers,
        threads=args.threads,
        draft_tree_width=args.tree_width,  # token trees where asked (1: chains)
    )


def warm_up(stub, pair: common.Pair, methods: list[Method], args) -> None:
    """One request per method (first calls pay one-off costs: allocation, packing)."""
    kind = next(iter(LOAD_PROMPTS))
    for method in methods:
        record = RequestRecord(method.name, kind, 0)
        send(stub, pair, method, record, time.perf_counter(), args, LOAD_PROMPTS[kind])


def run_phases(run: LoadRun, pair: common.Pair, methods: list[Method], args) -> None:
    """Every phase into run, which keeps what was measured should a later phase fail."""
    scale_out = {args.scale_out_concurrency} if args.target_workers > 1 else set()
    with load_system(pair, args) as stub:
        warm_up(stub, pair, methods, args)
        run.add(reference_pass(stub, pair, methods[0], args))
        for turn, concurrency in enumerate(sorted(set(args.concurrency) | scale_out)):
            for repeat in range(args.repeats):  # back to back: each pair sees the same machine
                for method in common.round_order(methods, turn + repeat):
                    run.add(closed_loop(stub, pair, method, concurrency, args, repeat=repeat))
    if args.target_workers > 1:
        phase = f"closed, {args.target_workers} target workers"
        with load_system(pair, args, args.target_workers) as stub:
            warm_up(stub, pair, methods, args)
            for method in methods:
                concurrency, workers = args.scale_out_concurrency, args.target_workers
                run.add(closed_loop(stub, pair, method, concurrency, args, phase, workers))
    run.complete = True


# --- output -----------------------------------------------------------------------------


def _num(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _failed(failed: dict[str, int]) -> str:
    return ", ".join(f"{code} {count}" for code, count in sorted(failed.items())) or "0"


COLUMNS = (
    "ok | failed | tok/s | steady tok/s | TTFT p50 / p95 ms | per-token p50 / p95 ms | "
    "queue p50 / p95 ms | e2e p50 / p95 s | acceptance | exact"
)


def table(first_column: str, rows: list[tuple[str, Summary]]) -> list[str]:
    lines = [f"| {first_column} | {COLUMNS} |", "|---" * (COLUMNS.count("|") + 2) + "|"]
    for first, s in rows:
        lines.append(
            f"| {first} | {s.completed} | {_failed(s.failed)} | {s.tokens_per_s:.1f} | "
            f"{_num(s.steady_tokens_per_s, '.1f')} | {_num(s.ttft_p50_ms)} / "
            f"{_num(s.ttft_p95_ms)} | {_num(s.per_token_p50_ms)} / {_num(s.per_token_p95_ms)} | "
            f"{_num(s.queue_p50_ms, '.1f')} / {_num(s.queue_p95_ms, '.1f')} | "
            f"{_num(s.e2e_p50_s, '.2f')} / {_num(s.e2e_p95_s, '.2f')} | "
            f"{'-' if s.acceptance is None else f'{s.acceptance:.0%}'} | "
            f"{s.completed - s.mismatches}/{s.completed} |"
        )
    return lines + [""]


def markdown(run: LoadRun, pair: common.Pair, methods: list[Method], args, argv) -> list[str]:
    checked = sum(r.matches_reference is not None for c in run.cells for r in c.records)
    drafter = f"draft {pair.draft}" if pair.draft else "the n-gram drafter"
    lines = common.section(
        f"Load: {pair.target} with {drafter}" + ("" if run.complete else " (incomplete)"),
        "load",
        argv,
        f"Torch threads: {args.threads} per worker process (the workers, the orchestrator and "
        f"this client's threads share the cores). Greedy, fp32, {args.max_new_tokens} new "
        f"tokens, GenerateStream, each request a new session; {len(LOAD_PROMPTS)} prompt kinds. "
        f"Methods: {', '.join(m.name for m in methods)}; drafter {pair.drafter}, tree width "
        f"{args.tree_width}. Total time {time.monotonic() - run.started:.0f} s.",
    )
    lines += [
        *([] if run.complete else ["**Incomplete: the run stopped early.**", ""]),
        f"Exactness: {checked - len(run.mismatches)} of {checked} completed outputs equal the "
        "k=0 reference of their prompt" + (":" if run.mismatches else "."),
        *(f"- MISMATCH {line}" for line in run.mismatches),
        "",
        f"### Closed loop (up to {args.requests_per_client} requests per client or "
        f"{args.duration_s:g} s)",
        "",
    ]
    for method in methods:
        rows = [(f"{c.load:g}", summarize(c)) for c in run.loads("closed", method.name)]
        lines += [f"#### {method.name}", "", *table("concurrency", rows)]
    lines += paired_section(run, methods)
    lines += scale_out_section(run, methods, args)
    return lines


def paired_section(run: LoadRun, methods: list[Method]) -> list[str]:
    """Each method's steady tok/s over k=0's, repeat by repeat (the cells of a repeat
    ran back to back), and k=0 against itself across repeats: the noise of a paired ratio."""
    others = [m.name for m in methods if m.name != BASELINE]
    lines = [
        "#### Paired: steady tok/s over k=0's, per repeat",
        "",
        "| concurrency | " + " | ".join(others) + " | k=0, repeat over repeat |",
        "|---" * (len(others) + 2) + "|",
    ]
    for load in sorted({c.load for c in run.cells if c.phase == "closed"}):
        steady = {
            (c.method, c.repeat): summarize(c).steady_tokens_per_s
            for c in run.cells
            if c.phase == "closed" and c.load == load
        }
        repeats = sorted({r for _, r in steady})
        cells = []
        for name in others:
            values = [ratio(steady.get((name, r)), steady.get((BASELINE, r))) for r in repeats]
            cells.append(_spread([v for v in values if v is not None]))
        base = [v for v in (steady.get((BASELINE, r)) for r in repeats) if v]
        cells.append(_spread([v / base[0] for v in base[1:]]) if len(base) > 1 else "-")
        lines.append(f"| {load:g} | " + " | ".join(cells) + " |")
    return lines + [""]


def _spread(values: list[float]) -> str:
    """Ratios as 'median (lowest-highest)', or the one ratio."""
    if len(values) < 2:
        return _x(values[0]) if values else "-"
    return f"{_x(percentile(values, 50))} ({_x(min(values))}-{_x(max(values))})"


def scale_out_section(run: LoadRun, methods: list[Method], args) -> list[str]:
    """Each method at --scale-out-concurrency sessions on one target and on N."""
    concurrency, phase = args.scale_out_concurrency, f"closed, {args.target_workers} target workers"
    rows, gains = [], []
    for method in methods:
        one = run.find("closed", method.name, concurrency)
        more = run.find(phase, method.name, concurrency)
        if one is None or more is None:  # not run, or the run stopped early
            continue
        one, more = summarize(one), summarize(more)
        rows += [(f"{method.name}, 1 target", one), (f"{method.name}, {args.target_workers}", more)]
        gains.append(f"{method.name} {_x(ratio(more.tokens_per_s, one.tokens_per_s))}")
    if not rows:
        return []
    return [
        f"### {args.target_workers} target workers behind one orchestrator, {concurrency} sessions",
        "",
        *table("method, targets", rows),
        f"Throughput with {args.target_workers} targets over 1: " + ", ".join(gains) + ".",
        "",
    ]


def raw(run: LoadRun, args) -> dict:
    """Every request's raw numbers; token ids only for the reference and for mismatches."""

    def as_json(r: RequestRecord) -> dict:
        values = asdict(r) | {"num_tokens": len(r.token_ids)}
        values["chunk_s"] = [round(t, 6) for t in r.chunk_s]  # microseconds are plenty
        if r.matches_reference is not False:
            del values["token_ids"]
        return values

    return {
        "settings": vars(args),
        "reference": run.reference,
        "mismatches": run.mismatches,
        "cells": [
            {k: v for k, v in vars(c).items() if k != "records"}
            | {"summary": asdict(summarize(c)), "requests": [as_json(r) for r in c.records]}
            for c in run.cells
        ],
    }


def _levels(text: str, kind=int) -> list:
    return [kind(value) for value in text.split(",") if value.strip()]


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks load", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add(
        "--pair",
        choices=sorted(common.PAIRS),
        default="smollm2",
        help="tiny: a random model, for tests",
    )
    add(
        "--concurrency", type=_levels, default=None, help="closed-loop levels (default: the pair's)"
    )
    add("--max-new-tokens", type=int, default=64)
    add("--requests-per-client", type=int, default=8, help="closed loop: at most, per client")
    add("--repeats", type=int, default=2, help="closed loop: cells per method and level")
    add("--duration-s", type=float, default=20.0, help="closed loop: no request starts after")
    add("--k", type=int, default=4, help="draft tokens per round of the fixed-k method")
    add("--adaptive-max-k", type=int, default=4, help="the adaptive method's most draft tokens")
    add("--target-workers", type=int, default=1, help="> 1: also this many targets, scaled out")
    add("--scale-out-concurrency", type=int, default=16)
    add("--threads", type=int, default=2, help="torch threads per worker process")
    add("--timeout-s", type=float, default=600.0, help="deadline of each request")
    add("--tree-width", type=int, default=1, help="the draft worker's --tree-width (1: chains)")
    add("--out", default="", help="default: results/load_<pair>[_tree<N>].md")
    args = parser.parse_args(argv)
    args.concurrency = args.concurrency or list(common.PAIRS[args.pair].concurrency)
    if min(args.concurrency) < 1 or args.requests_per_client < 1 or args.repeats < 1:
        parser.error("concurrency levels, --requests-per-client and --repeats must be >= 1")
    tree = f"_tree{args.tree_width}" if args.tree_width > 1 else ""
    args.out = args.out or str(common.RESULTS / f"load_{args.pair}{tree}.md")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    pair = common.PAIRS[args.pair]
    methods = load_methods(args.k, args.adaptive_max_k)
    run = LoadRun()
    try:
        run_phases(run, pair, methods, args)
    finally:  # on error too: what was measured, marked incomplete
        if run.cells:
            common.write_results(args.out, markdown(run, pair, methods, args, argv), raw(run, args))
    if run.mismatches:
        print(f"FAILED: {len(run.mismatches)} outputs differ from target-only", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
