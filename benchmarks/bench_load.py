"""Load benchmark: throughput and latency of the services under concurrent sessions.

    .venv/bin/python -m benchmarks.bench_load                      # SmolLM2-135M, n-gram (< 25 min, 2 cores)
    .venv/bin/python -m benchmarks.bench_load --pair qwen          # Qwen2.5-Coder 1.5B target, 0.5B draft model
    .venv/bin/python -m benchmarks.bench_load --target-workers 2   # also two targets behind one orchestrator
    .venv/bin/python -m benchmarks.bench_load --concurrency 1,2 --max-new-tokens 16 --requests-per-client 2 \\
        --open-loop-fractions '' --out /tmp/load                   # checks the script (minutes)

Method. The three services run as local processes (`launcher`, loopback only); the
clients are threads of this process calling `GenerateStream`: greedy, fp32, a fixed
number of new tokens, each request on a new session (closed after the call), prompts of
ten kinds (`LOAD_PROMPTS`, written for this benchmark). Methods: k=0 (target-only),
fixed k, adaptive k (`SpeculationParams.adaptive`, max k as given).

1. Warm-up: one request per method (first calls pay one-off costs).
2. Reference: one k=0 request per prompt, one session at a time. Every later output,
   whatever the method or load, must equal its prompt's reference token for token (the
   target's greedy output); a mismatch is printed and fails the run (exit status 1).
3. Closed loop, per concurrency c: c clients, each sending its next request as soon as
   its last one ended, until it has sent --requests-per-client or --duration-s has
   passed (checked before each request, so each client sends at least one). Methods
   take turns per level, rotated, so drift over the run hits each alike; each level
   runs --repeats such turns back to back, and the paired table gives each method's
   steady tok/s over k=0's per turn, beside k=0's own turn-to-turn change (the noise).
4. Open loop, per fraction of the k=0 closed-loop capacity (the best completed
   requests/s over its levels): Poisson arrivals (exponential gaps, seeded, the same
   schedule for every method at a rate), bounded by --open-loop-requests and
   --open-loop-duration-s of arrivals; a request is sent at its arrival whatever is
   still running.
5. With --target-workers N > 1: a second system with N targets behind one
   orchestrator, closed loop at --scale-out-concurrency sessions, beside one worker.

Per cell (method, load; repeats pooled): aggregate tokens/s (tokens of completed
requests over the cell's wall time, first request sent to last response), steady
tokens/s (closed loop: tokens arrived while every client was still in flight, over
that span; the clients' last requests end at different times, and in that tail the
load is below the level: `steady_window`), requests completed and failed
(by gRPC status code), time to first token (TTFT), per-token latency, the target's
queue wait (`GenerationStats.queue_ns`, summed per call; 0 while the target does not
report it) and end-to-end latency, p50 and p95; ratios against the single-session k=0
cell of the same run. Per-token latency is the inter-token time within a stream: a
chunk of n tokens arriving g seconds after the previous one counts as n tokens of g / n
(speculation commits several tokens at once; the first chunk's tokens are the TTFT).

Writes results_load_<pair>.md (command, hardware, tables, ratios), runs_load_<pair>.json
(every request's raw times) and plots/<pair>/load_throughput_latency.png in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from launcher.cluster import Cluster, layout, parse_args, start_system
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

REPO = Path(__file__).resolve().parent.parent

# Ten kinds of request, some with text to copy (the n-gram drafter's case), some without.
LOAD_PROMPTS = {
    "chat": "I just moved to a new city and don't know anyone. How can I make friends as an adult?",
    "code_new": "Write a Python function that returns the n-th Fibonacci number iteratively, with a short docstring.",
    "code_fix": (
        "This function should return the largest value in a list but it crashes on some inputs. Fix it:\n"
        "```python\ndef largest(values):\n    best = values[0]\n    for value in values:\n"
        "        if value > best:\n            best = value\n    return best\n```"
    ),
    "summary": (
        "Summarise this paragraph in two sentences.\n\nThe library on Elm Street will close for renovation "
        "from March to August. During the closure, books can be borrowed from the mobile library, which will "
        "visit the town square every Tuesday and Friday. The renovation adds a children's reading room, new "
        "study desks with power outlets, and a lift to the first floor. Members keep their cards, and all "
        "due dates during the closure are extended until September."
    ),
    "explain": "Explain how a refrigerator keeps food cold, in plain words for a ten-year-old.",
    "list": "List seven vegetables that grow well in a small balcony garden, one per line.",
    "rewrite": (
        "Rewrite this message so that it sounds polite and professional:\n\n"
        "hey, the report you sent is late again and half the numbers are wrong. fix it by friday."
    ),
    "extract": (
        "From the text below, give the name, the date and the city, as 'name: ..., date: ..., city: ...'.\n\n"
        "Dear Ms. Laura Bennett, we are happy to confirm your booking for the design workshop on 14 June "
        "2025 in Lisbon. Please arrive fifteen minutes early to collect your badge."
    ),
    "sql": "Write an SQL query that returns the ten customers with the highest total order value from tables "
    "customers(id, name) and orders(id, customer_id, amount).",
    "email": "Draft a short email to a colleague asking to move our Thursday meeting to next Monday morning.",
}


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str  # "" = no draft model: the n-gram drafter
    concurrency: tuple[int, ...]  # the default closed-loop levels
    chat: bool = True  # send chat messages (False: raw text, for models without a chat template)

    @property
    def drafter(self) -> str:
        return "model" if self.draft else "ngram"


PAIRS = {
    "smollm2": Pair("smollm2-135m", "", (1, 2, 4, 8, 16, 32)),
    "qwen": Pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", (1, 4, 8)),
    "tiny": Pair(
        "tiny-random:1", "", (1, 2), chat=False
    ),  # tests: a seeded random model, byte tokenizer
}


BASELINE = "k=0"  # target-only decoding: the method every ratio and the open loop's rates refer to


@dataclass(frozen=True)
class Method:
    name: str
    k: int  # draft tokens per round; with adaptive, the most
    adaptive: bool = False


def methods_for(k: int, adaptive_max_k: int) -> list[Method]:
    """k=0 (the baseline, first), fixed k, adaptive k."""
    return [
        Method(BASELINE, 0),
        Method(f"k={k}", k),
        Method(f"adaptive k<={adaptive_max_k}", adaptive_max_k, True),
    ]


# --- one request ------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One GenerateStream call as its client saw it; times in seconds from its cell's start."""

    method: str
    prompt: str  # the prompt's kind
    client: int  # closed loop: the client; open loop: the arrival's index
    start_s: float = 0.0
    end_s: float = 0.0  # last chunk received, or the error
    scheduled_s: float | None = None  # open loop: the planned arrival
    status: str = "OK"  # gRPC status code name
    detail: str = ""  # the error's details, cut short
    chunk_s: list[float] = field(
        default_factory=list
    )  # [num_chunks] arrival of each chunk with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # [num_chunks] tokens in that chunk
    token_ids: list[int] = field(default_factory=list)  # [num_tokens]
    finish_reason: str = ""
    queue_ns: int = 0  # GenerationStats.queue_ns, in nanoseconds
    num_drafted: int = 0  # draft tokens proposed, in tokens
    num_accepted: int = 0  # of which accepted, in tokens
    matches_reference: bool | None = None  # None: failed, or not checked

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.start_s if self.chunk_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s


def inter_token_times(chunk_s: list[float], chunk_tokens: list[int]) -> list[float]:
    """[num_tokens - first chunk's] per-token latencies, in seconds: a chunk of n tokens
    arriving g after the previous chunk gives n samples of g / n."""
    samples = []
    for previous, now, count in zip(chunk_s, chunk_s[1:], chunk_tokens[1:]):
        samples += [(now - previous) / count] * count
    return samples


def build_request(
    pair: Pair, method: Method, text: str, max_new_tokens: int
) -> orchestrator_pb2.GenerateRequest:
    """Greedy, a new session, stats on the last chunk."""
    request = orchestrator_pb2.GenerateRequest(include_stats=True)
    if pair.chat:
        request.chat.messages.add(role="user", content=text)
    else:
        request.text = text
    request.sampling.CopyFrom(
        common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    )
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(
            num_speculative_tokens=method.k, drafter=pair.drafter, adaptive=method.adaptive
        )
    )
    return request


def send(stub, request, record: RequestRecord, zero: float, timeout_s: float) -> RequestRecord:
    """Streams one request into record (times from `zero`, a perf_counter value), then
    closes its session, outside the measured time, so the target's cache does not fill."""
    record.start_s = time.perf_counter() - zero
    session_id = ""
    try:
        for chunk in stub.GenerateStream(request, timeout=timeout_s):
            session_id = session_id or chunk.session_id
            if chunk.token_ids:
                record.chunk_s.append(time.perf_counter() - zero)
                record.chunk_tokens.append(len(chunk.token_ids))
                record.token_ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                record.finish_reason = common_pb2.FinishReason.Name(chunk.finish_reason)
            if chunk.HasField("stats"):
                record.queue_ns = chunk.stats.queue_ns
                record.num_drafted = chunk.stats.num_drafted
                record.num_accepted = chunk.stats.num_accepted
    except grpc.RpcError as error:
        record.status, record.detail = error.code().name, (error.details() or "")[:200]
    record.end_s = time.perf_counter() - zero
    if session_id:
        with contextlib.suppress(grpc.RpcError):
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=30)
    return record


# --- statistics -------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default);
    None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base; None when either is missing or base is 0."""
    return value / base if value is not None and base else None


def poisson_schedule(
    rate_per_s: float, max_requests: int, max_duration_s: float, seed: int
) -> list[float]:
    """Arrival times, in seconds from the start, of a Poisson process of rate_per_s
    (exponential gaps of mean 1 / rate), seeded; at most max_requests, none after
    max_duration_s."""
    if rate_per_s <= 0:
        raise ValueError(f"rate must be > 0, got {rate_per_s}")
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    while len(arrivals) < max_requests:
        at += rng.expovariate(rate_per_s)
        if at > max_duration_s:
            break
        arrivals.append(at)
    return arrivals


@dataclass
class Cell:
    """Every request of one method at one load."""

    phase: str  # "reference", "closed", "open" or "closed, N target workers"
    method: str
    load: float  # closed loop: concurrency; open loop: offered requests/s
    seconds: float  # wall time, first request sent to last response
    records: list[RequestRecord]
    target_workers: int = 1
    repeat: int = 0  # closed loop: which of the --repeats of this method at this load
    # Closed loop: (tokens, seconds) while every client was in flight (steady_window).
    steady: tuple[int, float] | None = None


def steady_window(records: list[RequestRecord]) -> tuple[int, float]:
    """Closed loop: the tokens that arrived, and the seconds, from the first request
    sent until the first client sent no more (its last request ended): the span in
    which the load was the cell's whole concurrency. After it, clients drop out one
    by one, and a method whose sessions finish at different times (speculation)
    would be measured partly at a lower concurrency than its level."""
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
    first = cells[0]
    steady = None
    if all(c.steady is not None for c in cells):
        steady = (sum(c.steady[0] for c in cells), sum(c.steady[1] for c in cells))
    return Cell(
        first.phase,
        first.method,
        first.load,
        sum(c.seconds for c in cells),
        [r for c in cells for r in c.records],
        first.target_workers,
        steady=steady,
    )


@dataclass
class Summary:
    """A cell's numbers; latencies in milliseconds (e2e in seconds); None without samples."""

    completed: int
    failed: dict[str, int]  # {gRPC status code name: requests}
    mismatches: int  # completed outputs unlike the reference
    tokens_per_s: float
    steady_tokens_per_s: (
        float | None
    )  # closed loop: while every client was in flight (steady_window)
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
    e2e = [r.e2e_s for r in done]
    drafted = sum(r.num_drafted for r in done)
    seconds = cell.seconds or math.inf
    return Summary(
        completed=len(done),
        failed=dict(Counter(r.status for r in cell.records if not r.ok)),
        mismatches=sum(r.matches_reference is False for r in done),
        tokens_per_s=sum(len(r.token_ids) for r in done) / seconds,
        steady_tokens_per_s=cell.steady[0] / cell.steady[1]
        if cell.steady and cell.steady[1] > 0
        else None,
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


@dataclass
class Ratios:
    """A cell against the single-session k=0 cell: > 1 is more throughput, or longer latency."""

    tokens_per_s: float | None
    steady_tokens_per_s: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    per_token_p50: float | None
    per_token_p95: float | None


def ratios(summary: Summary, base: Summary) -> Ratios:
    return Ratios(
        ratio(summary.tokens_per_s, base.tokens_per_s),
        ratio(summary.steady_tokens_per_s, base.steady_tokens_per_s),
        ratio(summary.ttft_p50_ms, base.ttft_p50_ms),
        ratio(summary.ttft_p95_ms, base.ttft_p95_ms),
        ratio(summary.per_token_p50_ms, base.per_token_p50_ms),
        ratio(summary.per_token_p95_ms, base.per_token_p95_ms),
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
                f"{cell.phase} {cell.method} load {cell.load:g}, prompt {record.prompt}: first difference "
                f"at token {at}, expected {expected[at : at + 5]}, got {record.token_ids[at : at + 5]} "
                f"({len(record.token_ids)} tokens, reference {len(expected)})"
            )
    return lines


# --- runs -------------------------------------------------------------------------------


@contextlib.contextmanager
def running_system(pair: Pair, args, target_workers: int = 1):
    """An Orchestrator stub of target(s), draft and orchestrator started as local
    processes on loopback; every process is stopped on leaving, error or not."""
    system_args = parse_args(["--http-port", "-1"])  # no HTTP front: gRPC clients only
    system_args.target_model = pair.target
    system_args.draft_model = pair.draft
    system_args.drafter = pair.drafter
    system_args.target_workers = target_workers
    system_args.port = 0
    system_args.threads = args.threads
    system_args.startup_timeout = 1800.0  # a large target loads slowly on 2 cores
    system_args.draft_tree_width = args.tree_width  # token trees where asked (1: chains)
    system_args.log_dir = tempfile.mkdtemp(prefix="bench-load-logs-")
    cluster = Cluster(Path(system_args.log_dir))
    roles = layout(system_args)
    try:
        channel = grpc.insecure_channel(start_system(system_args, cluster, roles))
        try:
            yield orchestrator_pb2_grpc.OrchestratorStub(channel)
        finally:
            channel.close()
    finally:
        cluster.stop()


def closed_loop(
    stub,
    pair: Pair,
    method: Method,
    concurrency: int,
    args,
    phase: str = "closed",
    target_workers: int = 1,
    repeat: int = 0,
) -> Cell:
    """`concurrency` clients, each sending its next request when its last one ends."""
    prompts = list(LOAD_PROMPTS.items())
    zero = time.perf_counter()

    def client(index: int) -> list[RequestRecord]:
        records = []
        for sent in range(args.requests_per_client):
            if time.perf_counter() - zero >= args.duration_s:
                break
            kind, text = prompts[
                (index + sent * concurrency) % len(prompts)
            ]  # all clients together cycle the kinds
            request = build_request(pair, method, text, args.max_new_tokens)
            records.append(
                send(stub, request, RequestRecord(method.name, kind, index), zero, args.timeout_s)
            )
        return records

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        per_client = list(pool.map(client, range(concurrency)))
    records = [record for records in per_client for record in records]
    return Cell(
        phase,
        method.name,
        concurrency,
        time.perf_counter() - zero,
        records,
        target_workers,
        repeat,
        steady_window(records),
    )


def open_loop(
    stub, pair: Pair, method: Method, rate_per_s: float, schedule: list[float], args
) -> Cell:
    """One request per arrival of `schedule`, sent at its time whatever is in flight."""
    prompts = list(LOAD_PROMPTS.items())
    zero = time.perf_counter()
    with ThreadPoolExecutor(
        max_workers=max(1, len(schedule))
    ) as pool:  # a thread per arrival: never late
        futures = []
        for index, at in enumerate(schedule):
            time.sleep(max(0.0, zero + at - time.perf_counter()))
            kind, text = prompts[index % len(prompts)]
            record = RequestRecord(method.name, kind, index, scheduled_s=at)
            futures.append(
                pool.submit(
                    send,
                    stub,
                    build_request(pair, method, text, args.max_new_tokens),
                    record,
                    zero,
                    args.timeout_s,
                )
            )
        records = [future.result() for future in futures]
    return Cell("open", method.name, rate_per_s, time.perf_counter() - zero, records)


def reference_pass(stub, pair: Pair, method: Method, args) -> Cell:
    """k=0, one session at a time, every prompt once: the outputs every other run must equal."""
    zero = time.perf_counter()
    records = [
        send(
            stub,
            build_request(pair, method, text, args.max_new_tokens),
            RequestRecord(method.name, kind, 0),
            zero,
            args.timeout_s,
        )
        for kind, text in LOAD_PROMPTS.items()
    ]
    failed = [f"{r.prompt}: {r.status} {r.detail}" for r in records if not r.ok]
    if failed:
        raise SystemExit(
            "the k=0 reference pass failed, nothing to check outputs against: " + "; ".join(failed)
        )
    return Cell("reference", method.name, 1, time.perf_counter() - zero, records)


def warm_up(stub, pair: Pair, methods: list[Method], args) -> None:
    """One request per method (first calls pay one-off costs: allocation, packing)."""
    text = next(iter(LOAD_PROMPTS.values()))
    for method in methods:
        send(
            stub,
            build_request(pair, method, text, args.max_new_tokens),
            RequestRecord(method.name, "", 0),
            time.perf_counter(),
            args.timeout_s,
        )


def rotated(methods: list[Method], turn: int) -> list[Method]:
    """The methods' order at the turn-th load level: each gets each position in turn."""
    shift = turn % len(methods)
    return methods[shift:] + methods[:shift]


class Run:
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
        load = f"c={cell.load:g}" if cell.phase != "open" else f"{cell.load:.3f} req/s"
        print(
            f"[{time.monotonic() - self.started:5.0f} s] {cell.phase}, {cell.method}, {load}: {s.completed} ok, "
            f"failed {_failed(s.failed)}, {s.tokens_per_s:.1f} tok/s, TTFT p95 {_ms(s.ttft_p95_ms)}, per-token p95 "
            f"{_ms(s.per_token_p95_ms)}, {s.completed - s.mismatches}/{s.completed} exact",
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


def k0_capacity(run: Run) -> float:
    """Completed requests/s of k=0 at its best closed-loop level."""
    return max((summarize(c).requests_per_s for c in run.loads("closed", BASELINE)), default=0.0)


def measure(run: Run, pair: Pair, methods: list[Method], args) -> None:
    """Every phase into run, which keeps what was measured should a later phase fail."""
    levels = sorted(
        set(args.concurrency) | ({args.scale_out_concurrency} if args.target_workers > 1 else set())
    )
    with running_system(pair, args) as stub:
        warm_up(stub, pair, methods, args)
        run.add(reference_pass(stub, pair, methods[0], args))
        for turn, concurrency in enumerate(levels):
            # repeats back to back: each pair sees the same machine
            for repeat in range(args.repeats):
                for method in rotated(methods, turn + repeat):
                    run.add(closed_loop(stub, pair, method, concurrency, args, repeat=repeat))
        measure_open_loop(run, stub, pair, methods, args)
    if args.target_workers > 1:
        phase = f"closed, {args.target_workers} target workers"
        with running_system(pair, args, target_workers=args.target_workers) as stub:
            warm_up(stub, pair, methods, args)
            for method in methods:
                run.add(
                    closed_loop(
                        stub,
                        pair,
                        method,
                        args.scale_out_concurrency,
                        args,
                        phase,
                        args.target_workers,
                    )
                )
    run.complete = True


def measure_open_loop(run: Run, stub, pair: Pair, methods: list[Method], args) -> None:
    capacity = k0_capacity(run)
    if capacity <= 0:
        if args.open_loop_fractions:
            print(
                "no k=0 request completed in the closed loop: no capacity to scale the open loop by",
                flush=True,
            )
        return
    for turn, fraction in enumerate(args.open_loop_fractions):
        rate = fraction * capacity
        schedule = poisson_schedule(
            rate, args.open_loop_requests, args.open_loop_duration_s, args.seed + turn
        )
        for method in rotated(methods, turn):
            run.add(open_loop(stub, pair, method, rate, schedule, args))


# --- output -----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _num(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _failed(failed: dict[str, int]) -> str:
    return ", ".join(f"{code} {count}" for code, count in sorted(failed.items())) or "0"


COLUMNS = (
    "ok | failed | tok/s | steady tok/s | TTFT p50 / p95 ms | per-token p50 / p95 ms | queue p50 / p95 ms | "
    "e2e p50 / p95 s | acceptance | exact"
)


def row(first: str, s: Summary) -> str:
    return (
        f"| {first} | {s.completed} | {_failed(s.failed)} | {s.tokens_per_s:.1f} | "
        f"{_num(s.steady_tokens_per_s, '.1f')} | "
        f"{_num(s.ttft_p50_ms)} / {_num(s.ttft_p95_ms)} | "
        f"{_num(s.per_token_p50_ms)} / {_num(s.per_token_p95_ms)} | "
        f"{_num(s.queue_p50_ms, '.1f')} / {_num(s.queue_p95_ms, '.1f')} | {_num(s.e2e_p50_s, '.2f')} / "
        f"{_num(s.e2e_p95_s, '.2f')} | {'-' if s.acceptance is None else f'{s.acceptance:.0%}'} | "
        f"{s.completed - s.mismatches}/{s.completed} |"
    )


def table(first_column: str, rows: list[tuple[str, Summary]]) -> list[str]:
    return [
        f"| {first_column} | {COLUMNS} |",
        "|---" * (COLUMNS.count("|") + 2) + "|",
        *(row(first, s) for first, s in rows),
        "",
    ]


def baseline(run: Run) -> Cell:
    """The single-session k=0 cell: the closed loop's at concurrency 1, else the reference pass."""
    return run.find("closed", BASELINE, 1) or run.find("reference", BASELINE, 1)


def markdown(
    run: Run, pair: Pair, methods: list[Method], args, command: str, plot: Path
) -> list[str]:
    lines = header(run, pair, methods, args, command) + closed_loop_section(run, methods, args)
    lines += (
        ratios_section(run, methods)
        + open_loop_section(run, args)
        + scale_out_section(run, methods, args)
    )
    if all(r.queue_ns == 0 for c in run.cells for r in c.records):
        lines += [
            "Queue wait read 0 on every request: the target does not report `queue_ns` yet.",
            "",
        ]
    return lines + [
        f"Plot: `plots/{args.pair}/{plot.name}`. Total time {time.monotonic() - run.started:.0f} s.",
        "",
    ]


def header(run: Run, pair: Pair, methods: list[Method], args, command: str) -> list[str]:
    checked = sum(r.matches_reference is not None for c in run.cells for r in c.records)
    incomplete = "**Incomplete: the run stopped early (see its output); these are the phases measured before.**"
    drafter = f" with draft {pair.draft}" if pair.draft else " with the n-gram drafter"
    return [
        f"# Load benchmark: {pair.target}{drafter}",
        "",
        *([] if run.complete else [incomplete, ""]),
        f"Command: `{command}`",
        "",
        f"Hardware: {hardware()}; torch threads: {args.threads} per worker process (the target and draft "
        "workers, the orchestrator and this client's threads share the cores).",
        "",
        f"Greedy, fp32, {args.max_new_tokens} new tokens (fewer where the model ends its answer), GenerateStream, "
        f"each request a new session; {len(LOAD_PROMPTS)} prompt kinds ({', '.join(LOAD_PROMPTS)}). Methods: "
        + ", ".join(m.name for m in methods)
        + f"; drafter {pair.drafter}. Per-token latency: the time between "
        "chunks of a stream, spread over the chunk's tokens; queue: the target's `GenerationStats.queue_ns`.",
        "",
        f"Exactness: {checked - len(run.mismatches)} of {checked} completed outputs equal the k=0 reference of "
        "their prompt" + (":" if run.mismatches else "."),
        *(f"- MISMATCH {line}" for line in run.mismatches),
        "",
    ]


def closed_loop_section(run: Run, methods: list[Method], args) -> list[str]:
    lines = [
        f"## Closed loop (each client sends its next request when its last ends; up to "
        f"{args.requests_per_client} requests per client or {args.duration_s:g} s)",
        "",
    ]
    for method in methods:
        rows = [(f"{c.load:g}", summarize(c)) for c in run.loads("closed", method.name)]
        lines += [f"### {method.name}", "", *table("concurrency", rows)]
    return lines + paired_section(run, methods)


def paired_section(run: Run, methods: list[Method]) -> list[str]:
    """Each method's steady tok/s over k=0's, repeat by repeat (the cells of a repeat
    ran back to back), and k=0 against itself across repeats: the noise a paired
    ratio carries on this machine."""
    levels = sorted({c.load for c in run.cells if c.phase == "closed"})
    others = [m for m in methods if m.name != BASELINE]
    lines = [
        "### Paired: steady tok/s over k=0's, per repeat",
        "",
        "| concurrency | " + " | ".join(m.name for m in others) + " | k=0, repeat over repeat |",
        "|---" * (len(others) + 2) + "|",
    ]
    for load in levels:
        repeats = sorted({c.repeat for c in run.cells if c.phase == "closed" and c.load == load})
        steady = {
            (c.method, c.repeat): summarize(c).steady_tokens_per_s
            for c in run.cells
            if c.phase == "closed" and c.load == load
        }
        cells = []
        for method in others:
            values = [
                ratio(steady.get((method.name, r)), steady.get((BASELINE, r))) for r in repeats
            ]
            values = [v for v in values if v is not None]
            cells.append(_spread(values))
        base = [steady.get((BASELINE, r)) for r in repeats]
        base = [v for v in base if v]
        noise = _spread([v / base[0] for v in base[1:]]) if len(base) > 1 else "-"
        lines.append(f"| {load:g} | " + " | ".join(cells) + f" | {noise} |")
    return lines + [""]


def _spread(values: list[float]) -> str:
    """Ratios as 'median (lowest-highest)', or the one ratio."""
    if not values:
        return "-"
    if len(values) == 1:
        return _x(values[0])
    return f"{_x(percentile(values, 50))} ({_x(min(values))}-{_x(max(values))})"


def ratios_section(run: Run, methods: list[Method]) -> list[str]:
    """Every closed-loop cell against the single-session k=0 one."""
    base_cell = baseline(run)
    base = summarize(base_cell)
    label = (
        f"{BASELINE} at concurrency 1"
        if base_cell.phase == "closed"
        else f"the {BASELINE} reference pass"
    )
    lines = [
        f"### Ratios against {label} ({base.tokens_per_s:.1f} tok/s, TTFT p95 {_ms(base.ttft_p95_ms)}, "
        f"per-token p95 {_ms(base.per_token_p95_ms)})",
        "",
        "| method | concurrency | tok/s | steady tok/s | TTFT p50 | TTFT p95 | per-token p50 | per-token p95 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {m.name: i for i, m in enumerate(methods)}
    keys = {(c.phase, c.method) for c in run.cells if c.phase.startswith("closed")}
    closed = sorted(
        (cell for phase, method in keys for cell in run.loads(phase, method)),
        key=lambda c: (c.target_workers, order[c.method], c.load),
    )
    for cell in closed:
        r = ratios(summarize(cell), base)
        where = f"{cell.load:g}" + (
            f" ({cell.target_workers} targets)" if cell.target_workers > 1 else ""
        )
        lines.append(
            f"| {cell.method} | {where} | {_x(r.tokens_per_s)} | {_x(r.steady_tokens_per_s)} | "
            f"{_x(r.ttft_p50)} | {_x(r.ttft_p95)} | "
            f"{_x(r.per_token_p50)} | {_x(r.per_token_p95)} |"
        )
    return lines + [""]


def open_loop_section(run: Run, args) -> list[str]:
    cells = [c for c in run.cells if c.phase == "open"]
    if not cells:
        return []
    capacity = k0_capacity(run)
    rows = [
        (f"{c.method}, {c.load:.3f} ({c.load / capacity:.0%}), {len(c.records)} sent", summarize(c))
        for c in cells
    ]
    return [
        f"## Open loop (Poisson arrivals, seed {args.seed} + level, the same schedule for each method; at most "
        f"{args.open_loop_requests} requests, arrivals within {args.open_loop_duration_s:g} s)",
        "",
        f"Offered rates as fractions of the k=0 closed-loop capacity, {capacity:.3f} completed requests/s.",
        "",
        *table("method, offered req/s (of capacity)", rows),
    ]


def scale_out_section(run: Run, methods: list[Method], args) -> list[str]:
    """Each method at --scale-out-concurrency sessions on one target and on N."""
    concurrency, phase = args.scale_out_concurrency, f"closed, {args.target_workers} target workers"
    rows, gains = [], []
    for method in methods:
        one = run.find("closed", method.name, concurrency)
        more = run.find(phase, method.name, concurrency)
        if one is None or more is None:  # not run, or the run stopped early
            continue
        rows += [
            (f"{method.name}, 1 target", summarize(one)),
            (f"{method.name}, {args.target_workers} targets", summarize(more)),
        ]
        gains.append(
            f"{method.name} {_x(ratio(summarize(more).tokens_per_s, summarize(one).tokens_per_s))}"
        )
    if not rows:
        return []
    return [
        f"## {args.target_workers} target workers behind one orchestrator, {concurrency} sessions",
        "",
        *table("method, workers", rows),
        f"Throughput with {args.target_workers} targets over 1: " + ", ".join(gains) + ".",
        "",
    ]


def plot_throughput_latency(path: Path, run: Run) -> None:
    """Tokens/s against p95 per-token latency, a line per method over the concurrency levels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    series = {
        (c.phase, c.method): run.loads(c.phase, c.method)
        for c in run.cells
        if c.phase.startswith("closed")
    }
    colors = {}  # one colour per method, whatever the number of targets
    for (phase, method), cells in series.items():
        points = [
            (s.tokens_per_s, s.per_token_p95_ms, c.load)
            for c in cells
            for s in [summarize(c)]
            if s.per_token_p95_ms is not None
        ]
        if not points:
            continue
        one_target = phase == "closed"
        color = colors.setdefault(method, f"C{len(colors)}")
        label = method if one_target else f"{method}, {cells[0].target_workers} targets"
        axes.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            "o-" if one_target else "*",
            color=color,
            markersize=6 if one_target else 12,
            label=label,
        )
        for x, y, load in points:
            axes.annotate(
                f"c={load:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
    axes.set_xlabel("aggregate throughput, tokens/s")
    axes.set_ylabel("p95 per-token latency, ms")
    axes.set_title("closed loop: throughput against per-token latency")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def hardware() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    return (
        f"`nproc` {len(os.sched_getaffinity(0))} ({cpu}), torch {importlib.metadata.version('torch')}, "
        f"Python {sys.version.split()[0]}"
    )


def runs_as_json(run: Run, args, command: str) -> dict:
    """Every request's raw numbers; token ids only for the reference and for mismatches."""

    def record(r: RequestRecord) -> dict:
        values = asdict(r)
        values["num_tokens"] = len(r.token_ids)
        values["chunk_s"] = [round(t, 6) for t in r.chunk_s]  # microseconds are plenty
        if r.matches_reference is not False:
            del values["token_ids"]
        return values

    return {
        "command": command,
        "hardware": hardware(),
        "settings": vars(args),
        "reference": run.reference,
        "mismatches": run.mismatches,
        "cells": [
            {
                "phase": c.phase,
                "method": c.method,
                "load": c.load,
                "seconds": round(c.seconds, 4),
                "target_workers": c.target_workers,
                "repeat": c.repeat,
                "steady": c.steady,
                "summary": asdict(summarize(c)),
                "requests": [record(r) for r in c.records],
            }
            for c in run.cells
        ],
    }


def write_results(run: Run, pair: Pair, methods: list[Method], args, command: str) -> None:
    out = Path(args.out)
    name = args.pair + (f"_tree{args.tree_width}" if args.tree_width > 1 else "")
    plot = out / "plots" / name / "load_throughput_latency.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot_throughput_latency(plot, run)
    lines = markdown(run, pair, methods, args, command, plot)
    result_file, runs_file = out / f"results_load_{name}.md", out / f"runs_load_{name}.json"
    result_file.write_text("\n".join(lines))
    runs_file.write_text(json.dumps(runs_as_json(run, args, command), indent=1))
    print("\n".join(lines))
    print(f"wrote {result_file}, {runs_file} and {plot}")


def _levels(text: str, kind=int) -> list:
    return [kind(value) for value in text.split(",") if value.strip()]


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_load", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--pair", choices=sorted(PAIRS), default="smollm2", help="tiny: a random model, for tests"
    )
    parser.add_argument(
        "--concurrency",
        type=_levels,
        default=None,
        help="closed-loop levels, comma-separated (default: smollm2 1,2,4,8,16,32; qwen 1,4,8)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--requests-per-client", type=int, default=8, help="closed loop: at most, per client"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="closed loop: cells per method and level, back to back (paired ratios, their noise)",
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=20.0,
        help="closed loop: no client starts a request after this many seconds of its level",
    )
    parser.add_argument(
        "--k", type=int, default=4, help="draft tokens per round of the fixed-k method"
    )
    parser.add_argument(
        "--adaptive-max-k", type=int, default=4, help="the adaptive method's most draft tokens"
    )
    parser.add_argument(
        "--open-loop-fractions",
        type=lambda t: _levels(t, float),
        default=[0.5, 0.8, 1.0],
        help="offered rates as fractions of the k=0 closed-loop capacity; '' = no open loop",
    )
    parser.add_argument(
        "--open-loop-requests", type=int, default=12, help="open loop: at most, per method and rate"
    )
    parser.add_argument(
        "--open-loop-duration-s", type=float, default=30.0, help="open loop: arrivals within this"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="of the Poisson arrivals (the i-th rate uses seed + i)"
    )
    parser.add_argument(
        "--target-workers",
        type=int,
        default=1,
        help="> 1: also run a system with this many targets at --scale-out-concurrency",
    )
    parser.add_argument("--scale-out-concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker process")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    parser.add_argument(
        "--tree-width",
        type=int,
        default=1,
        help="the draft worker's --tree-width (token trees; 1: chains); results get a _tree<N> suffix",
    )
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks"), help="directory for the results and plot"
    )
    args = parser.parse_args(argv)
    args.concurrency = args.concurrency or list(PAIRS[args.pair].concurrency)
    if min(args.concurrency) < 1 or args.requests_per_client < 1 or args.repeats < 1:
        parser.error("concurrency levels, --requests-per-client and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    command = "python -m benchmarks.bench_load " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    pair = PAIRS[args.pair]
    methods = methods_for(args.k, args.adaptive_max_k)
    run = Run()
    try:
        measure(run, pair, methods, args)
    finally:  # on error too: what was measured, marked incomplete
        if run.cells:
            write_results(run, pair, methods, args, command)
    if run.mismatches:
        print(
            f"FAILED: {len(run.mismatches)} outputs differ from the target-only reference",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
