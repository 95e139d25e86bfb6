"""The target worker at 1 and at N tensor-parallel ranks, through the services, in one run.

    .venv/bin/python -m benchmarks.bench_tp [--pair qwen] [--ranks 2] [--repeats 2] [--max-new-tokens 64]

Starts two systems side by side (launcher.cluster: target, draft and orchestrator as
local processes): one whose target is one process with all the threads, one whose
target is N ranks (`--tensor-parallel N`) with threads / N each; the draft worker the
same in both. Per prompt kind (benchmarks/prompts.py), rounds over both systems'
target-only (k=0) and speculative (ngram+model, adaptive) calls in the bench suite's
rotated order; every output is checked against the one-process target-only's. Writes
benchmarks/results_tp.md (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.bench_suite import ADAPTIVE_MAX_K, PAIRS, Run, hardware, paired_ratio, round_order
from benchmarks.prompts import PROMPTS
from launcher.cluster import Cluster, free_port, layout, parse_args, start_system
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

SPECULATIVE = f"ngram+model adaptive k<={ADAPTIVE_MAX_K}"
# the pass breakdown: cached tokens, new tokens, timed passes
PREFIX = 256
WIDTHS = (1, 5)
PASS_REPEATS = 12


def start(
    pair, ranks: int, threads: int, draft_threads: int
) -> tuple[Cluster, orchestrator_pb2_grpc.OrchestratorStub]:
    args = parse_args(["--http-port", "-1", "--port", "0"])
    args.target_model, args.draft_model, args.drafter = pair.target, pair.draft, pair.drafter
    args.draft_quantization, args.tensor_parallel, args.threads = pair.quantization, ranks, threads
    args.startup_timeout, args.log_dir = 1800.0, tempfile.mkdtemp(prefix=f"bench-tp-{ranks}-")
    roles = layout(args)
    for role in roles:  # the draft alike in both systems: only the target differs
        if role.pool == "draft":
            role.args[role.args.index("--threads") + 1] = str(draft_threads)
    cluster = Cluster(Path(args.log_dir))
    address = start_system(args, cluster, roles)
    return cluster, orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))


def call(stub, text: str, speculative: bool, max_new_tokens: int) -> Run:
    request = orchestrator_pb2.GenerateRequest(include_stats=True)
    request.chat.messages.add(role="user", content=text)
    request.sampling.max_new_tokens = max_new_tokens
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(
            num_speculative_tokens=ADAPTIVE_MAX_K if speculative else 0,
            drafter="ngram+model",
            adaptive=speculative,
        )
    )
    started = time.perf_counter()
    response = stub.Generate(request, timeout=3600)
    elapsed = time.perf_counter() - started
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=response.session_id), timeout=60)
    return Run(list(response.token_ids), elapsed, response.stats)


def measure(stubs: dict[int, object], args) -> dict[str, dict[str, list[Run]]]:
    methods = {
        f"{ranks} rank{'s' * (ranks > 1)}, {name}": (stub, name != "target-only")
        for ranks, stub in stubs.items()
        for name in ("target-only", SPECULATIVE)
    }
    for stub, speculative in methods.values():  # warm-up: first sessions, first estimates
        call(stub, "Say hello.", speculative, 8)
    results = {}
    for prompt in args.prompts.split(","):
        runs = {method: [] for method in methods}
        for repeat in range(args.repeats):
            for method in round_order(list(methods), repeat):
                stub, speculative = methods[method]
                runs[method].append(call(stub, PROMPTS[prompt], speculative, args.max_new_tokens))
        results[prompt] = runs
        print(
            f"  {prompt}: " + ", ".join(f"{m} {_rate(r):.2f} tok/s" for m, r in runs.items()),
            flush=True,
        )
    return results


def _rate(runs: list[Run]) -> float:
    return statistics.median(run.tokens_per_s for run in runs)


# --- why: one pass, taken apart ----------------------------------------------------------


def pass_times(model) -> dict[int, float]:
    """Median ms of a pass of each width over PREFIX cached tokens (the worker's path)."""
    from model_runtime.width_padding import pass_times as timed

    return timed(model, WIDTHS, prefix=PREFIX, repeats=PASS_REPEATS, untimed=2)


def _sharded_rank(rank: int, ranks: int, port: int, model: str, threads: int, out) -> None:
    """One rank of the breakdown: an all-reduce of a pass's hidden states, then passes."""
    import torch
    import torch.distributed as dist

    from model_runtime import tensor_parallel

    torch.set_num_threads(threads)
    group = tensor_parallel.join(rank, ranks, port, "cpu")
    loaded = tensor_parallel.load_shard(model, device="cpu", dtype="float32", world_size=ranks)
    hidden = torch.zeros(1, WIDTHS[-1], loaded.model.config.hidden_size)
    samples = []
    for _ in range(50):
        start = time.perf_counter()
        dist.all_reduce(hidden)
        samples.append((time.perf_counter() - start) * 1e3)
    if rank:
        tensor_parallel.follow(loaded.model, group)
        return
    tensor_parallel.Leader(group).attach(loaded.model)
    out.put(
        {
            "all_reduce_ms": statistics.median(samples[5:]),
            "layers": loaded.model.config.num_hidden_layers,
            "passes": pass_times(loaded.model),
        }
    )
    dist.broadcast_object_list([None], src=0, group=group)  # the other ranks stop following


def breakdown(model: str, ranks: int, threads: int) -> list[str]:
    """Pass times: one process packed and unpacked, N ranks; the all-reduces' share."""
    import multiprocessing

    import torch

    from model_runtime.loading import load_model

    torch.set_num_threads(threads)
    one = {}
    for packed in (True, False):
        loaded = load_model(model, pack_cpu_linears=packed)
        one[packed] = pass_times(loaded.model)
        del loaded
    context = multiprocessing.get_context("spawn")
    out, port = context.Queue(), free_port()
    processes = [
        context.Process(
            target=_sharded_rank, args=(rank, ranks, port, model, max(1, threads // ranks), out)
        )
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    sharded = out.get(timeout=1800)
    for process in processes:
        process.join(timeout=60)
    # after o_proj and down_proj of each layer
    per_pass = 2 * sharded["layers"] * sharded["all_reduce_ms"]
    rows = [
        ("1 process, oneDNN-packed linears (the worker's default)", one[True]),
        ("1 process, plain linears", one[False]),
        (f"{ranks} ranks x {max(1, threads // ranks)} thread(s), plain linears", sharded["passes"]),
    ]
    lines = [
        f"| {name} | " + " | ".join(f"{times[w]:.0f}" for w in WIDTHS) + " |"
        for name, times in rows
    ]
    return [
        "| target pass, ms over {PREFIX} cached tokens | ".replace("{PREFIX}", str(PREFIX))
        + " | ".join(f"{w} new token{'s' * (w > 1)}" for w in WIDTHS)
        + " |",
        "|---" * (len(WIDTHS) + 1) + "|",
        *lines,
        "",
        f"An all-reduce of a {WIDTHS[-1]}-token pass's hidden states between the ranks (gloo, loopback): "
        f"{sharded['all_reduce_ms']:.2f} ms; {2 * sharded['layers']} of them a pass: {per_pass:.0f} ms.",
    ]


def report(results: dict, args, ranks: int) -> list[str]:
    methods = list(next(iter(results.values())))
    baseline = methods[0]  # 1 rank, target-only
    lines = [
        "| prompt | " + " | ".join(methods) + f" | {ranks} ranks / 1 rank, target-only (paired) |",
        "|---" * (len(methods) + 2) + "|",
    ]
    ratios = {method: [] for method in methods}
    for prompt, runs in results.items():
        base = _rate(runs[baseline])
        cells = []
        for method in methods:
            ratios[method].append(_rate(runs[method]) / base)
            cells.append(f"{_rate(runs[method]):.2f} tok/s ({ratios[method][-1]:.2f}x)")
        paired = paired_ratio(runs[methods[2]], runs[baseline])
        cells.append(f"{paired[0]:.2f}x [{paired[1]:.2f}, {paired[2]:.2f}]" if paired else "-")
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    lines.append(
        "| geometric mean | "
        + " | ".join(f"{statistics.geometric_mean(r):.2f}x" for r in ratios.values())
        + " | |"
    )
    every = [
        (prompt, run)
        for prompt, runs in results.items()
        for method_runs in runs.values()
        for run in method_runs
    ]
    equal = sum(run.token_ids == results[prompt][baseline][0].token_ids for prompt, run in every)
    lines += [
        "",
        f"Every output against the one-process target-only's first of its prompt: {equal} of {len(every)} "
        "equal token for token.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_tp", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads of the one-process target (N ranks: "
        "threads / N each); the draft worker's too",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument("--out", default="benchmarks/results_tp.md")
    parser.add_argument(
        "--breakdown-only", action="store_true", help="only the pass breakdown (printed)"
    )
    args = parser.parse_args(argv)
    pair = PAIRS[args.pair]
    if args.breakdown_only:
        print("\n".join(breakdown(pair.target, args.ranks, args.threads)))
        return 0
    clusters = []
    try:
        stubs = {}
        for ranks in (1, args.ranks):
            cluster, stubs[ranks] = start(pair, ranks, max(1, args.threads // ranks), args.threads)
            clusters.append(cluster)
        results = measure(stubs, args)
    finally:
        for cluster in clusters:
            cluster.stop()
    lines = [
        f"# The target at 1 and {args.ranks} tensor-parallel ranks",
        "",
        f"Command: `python -m benchmarks.bench_tp --pair {args.pair} --ranks {args.ranks} "
        f"--repeats {args.repeats} --max-new-tokens {args.max_new_tokens}"
        + (f" --prompts {args.prompts}`" if args.prompts != ",".join(PROMPTS) else "`"),
        "",
        f"Hardware: {hardware()}. Target {pair.target} fp32, draft {pair.draft or 'n-gram'} "
        f"({pair.quantization}, {args.threads} threads); the one-process target with {args.threads} threads, "
        f"each of the {args.ranks} ranks with {max(1, args.threads // args.ranks)} (gloo on the CPU). Greedy, "
        f"{args.max_new_tokens} new tokens, chat template, median of {args.repeats} rounds in rotated order; "
        "in brackets over the one-process target-only.",
        "",
        *report(results, args, args.ranks),
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
