"""A workload's conversations through the services, against target-only and Hugging Face
in process: Spec-Bench's report per category (speedup, tokens/s, accepted tokens per
target pass, outputs equal to target-only).

    .venv/bin/python -m benchmarks.bench_workload --pair smollm2 --workload mt-bench
    .venv/bin/python -m benchmarks.bench_workload --pair qwen --workload mt-bench --per-category 3

Each conversation (benchmarks/workloads.py) runs as one session: turn 2 continues the
session after turn 1's answer (its KV caches reused). Methods, interleaved per
conversation (paired; repeat 0 runs target-only first, later repeats rotate the order):
- through the services (`launcher`, loopback): target-only (k = 0, `Decode`), the pair's
  drafters at fixed k and adaptive;
- in process, on the target model the services load: HF `generate`, HF prompt lookup
  and, for a pair with a draft model, HF assisted generation with the same draft (its
  quantization too). A second turn's input is the conversation with target-only's first
  answer, rendered as the orchestrator renders it, so every method sees the same tokens.

A method's speedup is the geometric mean, over the conversation-turns of a category, of
its tokens/s over target-only's in the same repeat (median of repeats). Every output is
compared with target-only's, token for token. Writes a Markdown section and the raw
runs (JSON) to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.bench_suite import PAIRS, Pair, _hf, hardware, round_order
from benchmarks.workloads import Conversation, load
from launcher.cluster import Cluster, layout, parse_args, start_system
from model_runtime.loading import load_model
from service_common.server import channel
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
ADAPTIVE_MAX_K = 8
REFERENCE = "target-only"


@dataclass
class Turn:
    token_ids: list[int]
    seconds: float
    passes: int  # target forward passes (1 a token for target-only and HF generate; 0: unknown)


def services_method(stub, drafter: str, k: int, adaptive: bool, max_new_tokens: int):
    """Runs a conversation's turns as one session through the orchestrator."""

    def run(conversation: Conversation, answers: list[str]) -> list[Turn]:
        turns, session = [], ""
        for text in conversation.turns:
            request = orchestrator_pb2.GenerateRequest(include_stats=True, session_id=session)
            request.chat.messages.add(role="user", content=text)
            request.sampling.max_new_tokens = max_new_tokens
            request.speculation.CopyFrom(
                common_pb2.SpeculationParams(
                    num_speculative_tokens=k, drafter=drafter, adaptive=adaptive
                )
            )
            start = time.perf_counter()
            response = stub.Generate(request, timeout=3600)
            seconds = time.perf_counter() - start
            session, stats = response.session_id, response.stats
            turns.append(Turn(list(response.token_ids), seconds, _target_passes(stats)))
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session), timeout=60)
        return turns

    return run


def _target_passes(stats) -> int:
    """A round's pass gives its accepted tokens and one more; every other token (k = 0,
    a stretch the target decodes alone) is a pass of its own."""
    from_rounds = stats.num_accepted + stats.num_rounds
    return stats.num_rounds + max(0, stats.num_generated_tokens - from_rounds)


def hf_method(target, max_new_tokens: int, **generate_kwargs):
    """HF `generate` per turn, on the conversation so far with the reference's answers."""
    tokenizer = target.tokenizer
    generate = _hf(target, max_new_tokens, **generate_kwargs)

    def run(conversation: Conversation, answers: list[str]) -> list[Turn]:
        turns, messages = [], []
        for index, text in enumerate(conversation.turns):
            messages.append({"role": "user", "content": text})
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            run = generate(ids)  # the end token included, as the services do
            # HF does not say how many passes its speculation ran (0: not known)
            passes = 0 if generate_kwargs else len(run.token_ids)
            turns.append(Turn(run.token_ids, run.seconds, passes))
            if index < len(answers):
                messages.append({"role": "assistant", "content": answers[index]})
        return turns

    return run


def methods_for(pair: Pair, stub, target, draft, args) -> dict:
    k, max_new = args.k, args.max_new_tokens
    methods = {REFERENCE: services_method(stub, "", 0, False, max_new)}
    methods[f"ngram k={k}"] = services_method(stub, "ngram", k, False, max_new)
    methods[f"ngram adaptive k<={ADAPTIVE_MAX_K}"] = services_method(
        stub, "ngram", ADAPTIVE_MAX_K, True, max_new
    )
    if pair.draft:
        for drafter in ("model", "ngram+model"):
            methods[f"{drafter} adaptive k<={ADAPTIVE_MAX_K}"] = services_method(
                stub, drafter, ADAPTIVE_MAX_K, True, max_new
            )
    if not args.no_hf:
        methods["HF generate"] = hf_method(target, max_new)
        methods[f"HF prompt lookup k={k}"] = hf_method(target, max_new, prompt_lookup_num_tokens=k)
        if draft is not None:
            methods["HF assisted"] = hf_method(target, max_new, assistant_model=draft.model)
    if args.methods:
        wanted = args.methods.split(",")
        unknown = sorted(set(wanted) - set(methods))
        if unknown:
            raise SystemExit(f"unknown --methods {unknown}: choose from {list(methods)}")
        methods = {
            name: run for name, run in methods.items() if name in wanted or name == REFERENCE
        }
    return methods


def start_services(pair: Pair, args) -> tuple[Cluster, str]:
    system = parse_args([])
    system.target_model, system.draft_model = pair.target, pair.draft or ""
    system.draft_quantization = pair.quantization
    system.drafter = "ngram+model" if pair.draft else "ngram"
    system.target_dtype, system.target_row_invariant = args.target_dtype, args.target_row_invariant
    system.port, system.http_port, system.threads = 0, -1, args.threads
    system.startup_timeout = 1800.0
    system.log_dir = tempfile.mkdtemp(prefix="bench-workload-logs-")
    cluster = Cluster(Path(system.log_dir))
    try:
        return cluster, start_system(system, cluster, layout(system))
    except BaseException:
        cluster.stop()
        raise


def measure(methods: dict, conversations: list[Conversation], repeats: int, decode, log) -> dict:
    """{conversation name: {method: [[Turn] per repeat]}}, methods interleaved per conversation."""
    results = {}
    for conversation in conversations:
        runs: dict[str, list[list[Turn]]] = {name: [] for name in methods}
        answers: list[str] = []
        for repeat in range(repeats):
            order = round_order(list(methods), repeat)
            if repeat == 0:  # the reference first: its answers make the HF turns' inputs
                order = [REFERENCE] + [name for name in order if name != REFERENCE]
            for name in order:
                runs[name].append(methods[name](conversation, answers))
                if name == REFERENCE and repeat == 0:
                    answers = [decode(turn.token_ids) for turn in runs[name][0]]
        results[conversation.name] = runs
        log(conversation, runs)
    return results


def report(results: dict, conversations: list[Conversation], methods: list[str]) -> list[str]:
    """Per category and overall: speedup, tokens/s, tokens per target pass, outputs equal."""
    by_category: dict[str, list[str]] = {}
    for conversation in conversations:
        by_category.setdefault(conversation.category, []).append(conversation.name)
    by_category["overall"] = [c.name for c in conversations]
    lines = [
        "| category | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for category, names in by_category.items():
        cells = [_cell(results, names, method) for method in methods]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return lines


def _cell(results: dict, names: list[str], method: str) -> str:
    ratios, rates, per_pass, equal, total = [], [], [], 0, 0
    for name in names:
        runs, reference = results[name][method], results[name][REFERENCE]
        for turn in range(len(runs[0])):
            mine = [repeat[turn] for repeat in runs]
            theirs = [repeat[turn] for repeat in reference]
            ratios.append(
                statistics.median(_rate(m) / _rate(r) for m, r in zip(mine, theirs) if _rate(r) > 0)
            )
            rates.append(statistics.median(_rate(m) for m in mine))
            passes = sum(m.passes for m in mine)
            if passes:
                per_pass.append(sum(len(m.token_ids) for m in mine) / passes)
            equal += sum(m.token_ids == theirs[0].token_ids for m in mine)
            total += len(mine)
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    tokens_per_pass = f"{statistics.fmean(per_pass):.2f}/pass" if per_pass else "-/pass"
    return (
        f"{geomean:.2f}x, {statistics.fmean(rates):.1f} tok/s, {tokens_per_pass}, "
        f"{equal}/{total} equal"
    )


def _rate(turn: Turn) -> float:
    return len(turn.token_ids) / turn.seconds if turn.seconds > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_workload", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--workload", default="mt-bench")
    parser.add_argument("--per-category", type=int, default=0, help="0 = every conversation")
    parser.add_argument("--turns", type=int, default=0, help="0 = every turn")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target-dtype", default="float32")
    parser.add_argument("--target-row-invariant", default="auto")
    parser.add_argument("--no-hf", action="store_true", help="no in-process HF baselines")
    parser.add_argument(
        "--methods", default="", help="comma-separated subset (target-only always runs)"
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results_workload.md"))
    args = parser.parse_args(argv)
    command = shlex.join(argv if argv is not None else sys.argv[1:])
    pair = PAIRS[args.pair]
    conversations = load(args.workload, args.per_category, args.turns)
    torch.set_num_threads(args.threads)
    target = load_model(pair.target, dtype=args.target_dtype)
    draft = None
    if pair.draft and not args.no_hf:
        draft = load_model(pair.draft, quantize=pair.quantization)

    def decode(ids: list[int]) -> str:
        return target.tokenizer.decode(ids, skip_special_tokens=True)

    started = time.monotonic()
    cluster, address = start_services(pair, args)
    out = Path(args.out)
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel(address, cluster.tls))
        methods = methods_for(pair, stub, target, draft, args)

        def log(conversation, runs):
            ratios = {
                name: [len(t.token_ids) for t in repeats[0]] for name, repeats in runs.items()
            }
            print(conversation.name, ratios, flush=True)

        results = measure(methods, conversations, args.repeats, decode, log)
    finally:
        cluster.stop()
    lines = [
        "",
        f"## {args.workload}: {pair.target}"
        + (f" with draft {pair.draft} ({pair.quantization})" if pair.draft else ", n-gram drafter"),
        "",
        f"Command: `python -m benchmarks.bench_workload {command}`",
        "",
        f"Host: {hardware()}; {args.threads} torch threads per worker and in process. Target "
        f"{args.target_dtype}, row invariance {args.target_row_invariant}. "
        f"{len(conversations)} conversations ({sum(len(c.turns) for c in conversations)} turns), "
        f"greedy, at most {args.max_new_tokens} new tokens a turn, {args.repeats} repeat(s); "
        f"{time.monotonic() - started:.0f} s.",
        "",
        "Each cell: speedup over target-only through the services (geometric mean over the "
        "category's turns), tokens/s, tokens per target pass, outputs equal to target-only.",
        "",
        *report(results, conversations, list(methods)),
    ]
    with out.open("a") as file:
        file.write("\n".join(lines) + "\n")
    raw = out.with_suffix(".json")
    previous = json.loads(raw.read_text()) if raw.exists() else []
    previous.append(
        {
            "command": command,
            "runs": {
                name: {
                    m: [[dataclasses.asdict(t) for t in r] for r in rs] for m, rs in runs.items()
                }
                for name, runs in results.items()
            },
        }
    )
    raw.write_text(json.dumps(previous))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
