"""The benchmarks' shared pieces: every scenario (`python -m benchmarks --help`) is built on
these, and no scenario imports another.

- the model pairs (`PAIRS`) and the host (`hardware`);
- a system of local processes (`services`), a greedy request (`request`) and one timed
  call through it (`generate`), HF `generate` in process (`hf_generate`), as `Run`s;
- paired interleaved repeats (`round_order`), ratios with their interval
  (`ratio_interval`), Leviathan's bound at measured acceptance and costs (`bound`,
  through speculative.estimator: the one place the bound is written);
- the row check and step costs of row invariance (the `rows` and `gpu` scenarios);
- one report writer (`section`, `write_results`): a Markdown section appended to a
  results file, the raw runs appended to the JSON list beside it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks.delay_proxy import delayed
from launcher.cluster import Cluster, layout, parse_args, start_system
from service_common.server import channel
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from speculative.estimator import round_speedup

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
ADAPTIVE_MAX_K = 8


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str = ""  # "" = no draft model: the n-gram drafter
    quantization: str = "none"  # the draft model's (model_runtime/quantization.py)
    chat: bool = True  # chat messages (False: raw text, for a model without a chat template)
    concurrency: tuple[int, ...] = (1, 4, 8)  # the load scenario's closed-loop levels

    @property
    def drafter(self) -> str:
        return "model" if self.draft else "ngram"

    @property
    def drafters(self) -> tuple[str, ...]:
        return ("ngram", "model", "ngram+model") if self.draft else ("ngram",)

    def launcher_options(self) -> dict:
        """The launcher options that start this pair (`services`)."""
        return dict(
            target_model=self.target,
            draft_model=self.draft,
            draft_quantization=self.quantization,
            drafter=self.drafter,
        )


PAIRS = {
    "smollm2": Pair("smollm2-135m", concurrency=(1, 2, 4, 8, 16, 32)),
    # The 0.5B draft in int8 costs a third of its fp32 self (results/archive/results_drafts.md).
    "qwen": Pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "int8-dynamic"),
    # The capacity scenario's model draft: the target's own weights in int8.
    "smollm2-self": Pair("smollm2-135m", "self", "int8-dynamic"),
    "tiny": Pair("tiny-random:1", chat=False, concurrency=(1, 2)),  # tests: a byte tokenizer
    "tiny-self": Pair("tiny-random:1", "self", "none", chat=False),
}


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    version = importlib.metadata.version
    return (
        f"`nproc` {len(os.sched_getaffinity(0))} ({cpu}), torch {version('torch')}, "
        f"transformers {version('transformers')}, Python {platform.python_version()}"
    )


# --- calls ---------------------------------------------------------------------------------


@dataclass
class Run:
    """One call: its output and time, and what its statistics say (0: not known)."""

    token_ids: list[int]
    seconds: float  # the call, as its client timed it
    passes: int = 0  # target forward passes
    drafted: int = 0  # draft tokens proposed, in tokens
    accepted: int = 0  # of which accepted, in tokens
    draft_seconds: float = 0.0  # drafting, as the orchestrator's stats say
    target_seconds: float = 0.0  # the target's compute, as the target reports it
    prefill_seconds: float = 0.0
    session_id: str = ""

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def request(
    prompt: str | Sequence[int],
    max_new_tokens: int,
    k: int = 0,
    drafter: str = "",
    adaptive: bool = False,
    chat: bool = True,
    session_id: str = "",
) -> orchestrator_pb2.GenerateRequest:
    """A greedy request with stats: a user message (chat), raw text, or token ids; k = 0:
    target-only; adaptive: k is the most."""
    built = orchestrator_pb2.GenerateRequest(include_stats=True, session_id=session_id)
    if isinstance(prompt, str) and chat:
        built.chat.messages.add(role="user", content=prompt)
    elif isinstance(prompt, str):
        built.text = prompt
    else:
        built.token_ids.ids.extend(prompt)
    built.sampling.CopyFrom(
        common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    )
    built.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=k, drafter=drafter, adaptive=adaptive)
    )
    return built


def generate(stub, call, timeout_s: float = 3600.0, close: bool = True) -> Run:
    """One Generate call, timed by the client; its session closed after (close) outside
    the measured time, so the target's cache does not fill."""
    start = time.perf_counter()
    response = stub.Generate(call, timeout=timeout_s)
    seconds = time.perf_counter() - start
    if close:
        stub.CloseSession(
            common_pb2.CloseSessionRequest(session_id=response.session_id), timeout=60
        )
    stats = response.stats
    return Run(
        list(response.token_ids),
        seconds,
        target_passes(stats),
        stats.num_drafted,
        stats.num_accepted,
        stats.draft_ns / 1e9,
        stats.target_compute_ns / 1e9,
        stats.prefill_ns / 1e9,
        response.session_id,
    )


def target_passes(stats) -> int:
    """A round's pass gives its accepted tokens and one more; every other token (k = 0,
    a stretch the target decodes alone) is a pass of its own."""
    from_rounds = stats.num_accepted + stats.num_rounds
    return stats.num_rounds + max(0, stats.num_generated_tokens - from_rounds)


@contextlib.contextmanager
def services(flags: dict[str, list[str]] | None = None, delay_ms: float = 0.0, **options):
    """An Orchestrator stub of a system of local processes (launcher.cluster, loopback,
    gRPC only): any launcher option by its name, more flags per pool ("target",
    "draft"), and a delay proxy of delay_ms one way in front of each target (> 0). Every
    process stops on leaving, error or not."""
    args = parse_args(["--http-port", "-1", "--port", "0"])
    args.startup_timeout = 1800.0  # a large target loads slowly on 2 cores
    args.log_dir = tempfile.mkdtemp(prefix="bench-logs-")
    for name, value in options.items():
        if not hasattr(args, name):
            raise TypeError(f"unknown launcher option {name!r}")
        setattr(args, name, value)
    cluster = Cluster(Path(args.log_dir))
    roles = delayed(layout(args), delay_ms)
    for role in roles:
        role.args += (flags or {}).get(role.pool, [])
    try:
        with channel(start_system(args, cluster, roles), cluster.tls) as opened:
            yield orchestrator_pb2_grpc.OrchestratorStub(opened)
    finally:
        cluster.stop()


def chat_ids(tokenizer, messages: str | list[dict]) -> list[int]:
    """The chat template's token ids of a user message (or a conversation), ready to answer."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def hf_generate(loaded, max_new_tokens: int, **kwargs):
    """HF `generate` in process, greedy: a runner of token ids (the end token included)."""
    import torch

    def timed(ids: list[int]) -> Run:
        input_ids = torch.tensor([ids])
        start = time.perf_counter()
        output = loaded.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
        return Run(output[0, len(ids) :].tolist(), time.perf_counter() - start)

    return timed


# --- requests under load (the load and capacity scenarios) -------------------------------


@dataclass(frozen=True)
class Method:
    name: str
    k: int  # draft tokens per round; with adaptive, the most
    adaptive: bool = False


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
    chunk_s: list[float] = field(default_factory=list)  # [num_chunks] arrival of each chunk
    chunk_tokens: list[int] = field(default_factory=list)  # [num_chunks] tokens in that chunk
    token_ids: list[int] = field(default_factory=list)  # [num_tokens]
    finish_reason: str = ""
    queue_ns: int = 0  # GenerationStats.queue_ns, in nanoseconds
    prompt_tokens: int = 0  # the prompt's tokens, as the last chunk says
    num_drafted: int = 0  # draft tokens proposed, in tokens
    num_accepted: int = 0  # of which accepted, in tokens
    matches_reference: bool | None = None  # None: failed, or not checked

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.start_s if self.chunk_s else None


def send(stub, pair: Pair, method: Method, record: RequestRecord, zero: float, args, text: str):
    """Streams one request of `text` (record's prompt) into record (times from `zero`, a
    perf_counter value), then closes its session, outside the measured time."""
    call = request(
        text,
        args.max_new_tokens,
        method.k,
        pair.drafter,
        method.adaptive,
        pair.chat,
    )
    record.start_s, session_id = time.perf_counter() - zero, ""
    try:
        for chunk in stub.GenerateStream(call, timeout=args.timeout_s):
            session_id = session_id or chunk.session_id
            if chunk.token_ids:
                record.chunk_s.append(time.perf_counter() - zero)
                record.chunk_tokens.append(len(chunk.token_ids))
                record.token_ids.extend(chunk.token_ids)
            record.prompt_tokens = chunk.num_prompt_tokens or record.prompt_tokens
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


# --- paired repeats, ratios, the bound -----------------------------------------------------


def round_order(names: list, repeat: int) -> list:
    """The methods' order in round `repeat`: rotated by repeat // 2, reversed in odd
    rounds. Rotation alone moves each method through every position but keeps who runs
    right after whom; the reversed rounds give each method each predecessor as often
    (over 6 rounds of 3 methods, every order once)."""
    shift = (repeat // 2) % len(names)
    order = names[shift:] + names[:shift]
    return order[::-1] if repeat % 2 else order


def ratio_interval(ratios: list[float], confidence: float = 0.95):
    """(ratio, low, high): the geometric mean of paired ratios and the two-sided Student t
    interval of the mean log ratio at `confidence`; (ratio, None, None) below two."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None, None
    from scipy import stats  # benchmarks only (the dev extra)

    spread = statistics.stdev(logs) / math.sqrt(len(logs))
    half = stats.t.ppf(0.5 + confidence / 2, len(logs) - 1) * spread
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def interval_text(ratios: list[float]) -> str:
    """'1.23x [1.10-1.37]' (the 95% interval of paired ratios), or '1.23x' for one."""
    if not ratios:
        return "-"
    ratio, low, high = ratio_interval(ratios)
    return f"{ratio:.2f}x" + ("" if low is None else f" [{low:.2f}-{high:.2f}]")


def bound(runs: Sequence[Run], reference: Sequence[Run]) -> float | None:
    """Leviathan's bound at the runs' measured acceptance and costs: their tokens a target
    pass, their drafting a drafted token and target compute a pass, against the
    reference's (target-only's) target compute a pass (speculative.estimator.round_speedup;
    no overhead counted: what such rounds give at best). None where not measured."""
    passes, drafted = sum(r.passes for r in runs), sum(r.drafted for r in runs)
    target = sum(r.target_seconds for r in runs)
    reference_passes = sum(r.passes for r in reference)
    one_pass = sum(r.target_seconds for r in reference) / max(reference_passes, 1)
    if not (passes and drafted and target and one_pass):
        return None
    return round_speedup(
        sum(len(r.token_ids) for r in runs) / passes,
        drafted / passes,
        sum(r.draft_seconds for r in runs) / drafted,
        one_pass,
        target / passes,
    )


# --- row invariance ------------------------------------------------------------------------

ROW_NEW = 8  # new tokens of the row check's wide pass
ROW_CACHED = 256  # cached tokens under the step costs' passes
ROW_SESSIONS, ROW_WIDTHS = (1, 8), (1, 5, 9)  # the step costs' shapes


def row_check(model, vocab: int, prefixes: int, seed: int = 0) -> tuple[int, int, int, float]:
    """(rows differing, argmax flips, rows, largest difference) of one pass over ROW_NEW
    new tokens against ROW_NEW passes over 1 (ModelSession, the workers' path)."""
    import torch

    from model_runtime.model_session import ModelSession

    generator = torch.Generator().manual_seed(seed)
    differing = flips = rows = 0
    largest = 0.0
    for _ in range(prefixes):
        prefix = torch.randint(0, vocab, (64,), generator=generator).tolist()
        new = torch.randint(0, vocab, (ROW_NEW,), generator=generator).tolist()
        wide, narrow = ModelSession(model, 1024), ModelSession(model, 1024)
        for session in (wide, narrow):
            session.append(prefix)
            session.prefill()
        wide.append(new)
        wide_rows = wide.logits(ROW_NEW + 1)[1:]
        narrow.logits(1)
        narrow_rows = []
        for token in new:
            narrow.append([token])
            narrow_rows.append(narrow.logits(1))
        narrow_rows = torch.cat(narrow_rows)
        differing += int((wide_rows != narrow_rows).any(-1).sum())
        flips += int((wide_rows.argmax(-1) != narrow_rows.argmax(-1)).sum())
        rows += ROW_NEW
        largest = max(largest, float((wide_rows.float() - narrow_rows.float()).abs().max()))
    return differing, flips, rows, largest


def step_costs(models: dict, vocab: int, repeats: int, synchronize=lambda: None) -> dict:
    """{(sessions, width): {name: [ms per repeat]}}: one batched step (forward_segments, as
    the step scheduler runs it) of `width` new tokens for each of `sessions` sessions over
    ROW_CACHED cached tokens, the models timed alternately, the first repeat untimed."""
    from model_runtime.batched_forward import Segment, SequenceKV, forward_segments

    def step_ms(model, caches: list, width: int) -> float:
        segments = [
            Segment(kv, ROW_CACHED, [(11 * i + j) % (vocab - 1) + 1 for j in range(width)], width)
            for i, kv in enumerate(caches)
        ]
        synchronize()
        start = time.perf_counter()
        forward_segments(model, segments)
        synchronize()
        return (time.perf_counter() - start) * 1e3

    result = {}
    for sessions in ROW_SESSIONS:
        caches = {name: [SequenceKV() for _ in range(sessions)] for name in models}
        for name, model in models.items():
            for index, kv in enumerate(caches[name]):
                tokens = [(7 * index + j) % vocab for j in range(ROW_CACHED)]
                forward_segments(model, [Segment(kv, 0, tokens, 0)])
        for width in ROW_WIDTHS:
            samples = {name: [] for name in models}
            for repeat in range(repeats + 1):
                for name, model in models.items():
                    ms = step_ms(model, caches[name], width)
                    if repeat:
                        samples[name].append(ms)
            result[sessions, width] = samples
    return result


def invariance_lines(prefixes: int, repeats: int, checks: dict, timed: dict) -> list[str]:
    """The row check's and the step costs' tables, invariance off and on."""
    lines = [
        f"Row check ({prefixes} random 64-token prefixes, {ROW_NEW} new tokens: one pass "
        f"against {ROW_NEW}):",
        "",
        "| invariance | rows differing | argmax flips | largest difference |",
        "|---|---|---|---|",
    ]
    for name, (differing, flips, rows, largest) in checks.items():
        lines.append(f"| {name} | {differing} of {rows} | {flips} | {largest:.3g} |")
    lines += [
        "",
        f"Step time over {ROW_CACHED} cached tokens (ms, median of {repeats}; on over off "
        "paired per repeat):",
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
    return lines


# --- the report writer ---------------------------------------------------------------------


def section(title: str, scenario: str, argv: list[str] | None, *notes: str) -> list[str]:
    """A results section's head: its title, the command that reproduces it, the host."""
    command = shlex.join(sys.argv[1:] if argv is None else argv)
    return [
        "",
        f"## {title}",
        "",
        f"Command: `python -m benchmarks {scenario} {command}`",
        "",
        " ".join([f"Host: {hardware()}.", *notes]),
        "",
    ]


def write_results(out: str | Path, lines: list[str], raw=None) -> None:
    """Appends the Markdown `lines` (where any) to `out` and `raw` (the runs, JSON-able)
    to the list in the JSON file beside it; prints the lines."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if lines:
        with out.open("a") as file:
            file.write("\n".join(lines) + "\n")
    if raw is not None:
        path = out.with_suffix(".json")
        previous = json.loads(path.read_text()) if path.exists() else []
        if not isinstance(previous, list):  # one run's JSON, written before this writer
            previous = [previous]
        path.write_text(json.dumps([*previous, raw]))
    print("\n".join(lines), flush=True)
