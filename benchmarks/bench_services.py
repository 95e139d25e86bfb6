"""End-to-end through the orchestrator over loopback gRPC against the in-process
generator and target-only decoding: same model, same prompts, same run.

    .venv/bin/python -m benchmarks.bench_services [--max-new-tokens 64] [--repeats 3]

Starts target (SmolLM2-135M), draft (n-gram) and orchestrator as local processes.
Prints tokens/s per prompt and method, ratios, and the share of each round spent in
gRPC (verify round trip minus the target's compute).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from benchmarks.bench_core import chat_ids
from benchmarks.prompts import PROMPTS
from launcher.cluster import Cluster, start_system
from model_runtime.loading import load_model
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from speculative.generator import SpeculativeGenerator
from speculative.prompt_lookup import NgramDrafter
from speculative.sampling import SamplingParams

K = 4


def _in_process(loaded, k, max_new_tokens):
    generator = SpeculativeGenerator(loaded, NgramDrafter() if k else None)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(loaded.eos_token_id,))

    def run(text):
        ids = chat_ids(loaded.tokenizer, text)
        start = time.perf_counter()
        result = generator.generate(ids, params, k=k)
        return result.token_ids, time.perf_counter() - start, None

    return run


def _service(stub, k, max_new_tokens):
    def run(text):
        request = orchestrator_pb2.GenerateRequest(include_stats=True)
        request.chat.messages.add(role="user", content=text)
        request.sampling.max_new_tokens = max_new_tokens
        request.speculation.CopyFrom(
            common_pb2.SpeculationParams(num_speculative_tokens=k, drafter="ngram")
        )
        start = time.perf_counter()
        response = stub.Generate(request, timeout=300)
        elapsed = time.perf_counter() - start
        stub.CloseSession(
            common_pb2.CloseSessionRequest(session_id=response.session_id), timeout=30
        )
        return list(response.token_ids), elapsed, response.stats

    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m")
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="bench-logs-")))
    system_args = argparse.Namespace(
        target_model="smollm2-135m",
        draft_model="",
        drafter="ngram",
        target_workers=1,
        draft_workers=1,
        port=0,
        threads=args.threads,
        log_dir=str(cluster.log_dir),
        startup_timeout=300.0,
    )
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(
            grpc.insecure_channel(start_system(system_args, cluster))
        )
        methods = {
            "target-only, in process": _in_process(loaded, 0, args.max_new_tokens),
            f"n-gram k={K}, in process": _in_process(loaded, K, args.max_new_tokens),
            "target-only, services (Decode)": _service(stub, 0, args.max_new_tokens),
            f"n-gram k={K}, services": _service(stub, K, args.max_new_tokens),
        }
        report(measure(methods, args.repeats), args)
    finally:
        cluster.stop()


def measure(methods, repeats):
    results = {}
    for name, text in PROMPTS.items():
        for run in methods.values():
            run(text)  # warm-up
        runs = {method: [] for method in methods}
        for _ in range(repeats):  # interleaved, so drift hits every method alike
            for method, run in methods.items():
                runs[method].append(run(text))
        results[name] = runs
    return results


def report(results, args):
    methods = list(next(iter(results.values())))
    print(
        f"SmolLM2-135M-Instruct fp32, {args.max_new_tokens} new tokens, greedy, {args.threads} threads per "
        f"process, median of {args.repeats} interleaved repeats; ratios against target-only in process\n"
    )
    print(
        "| prompt | "
        + " | ".join(methods)
        + " | services / in process (k=4) | gRPC share of round |"
    )
    print("|---" * (len(methods) + 3) + "|")
    keep = []
    for prompt, runs in results.items():
        rates = {m: statistics.median(len(t) / s for t, s, _ in runs[m]) for m in methods}
        base = rates[methods[0]]
        stats = runs[f"n-gram k={K}, services"][0][2]
        grpc_share = stats.network_ns / stats.verify_ns if stats.verify_ns else 0.0
        ratio = rates[f"n-gram k={K}, services"] / rates[f"n-gram k={K}, in process"]
        keep.append(ratio)
        equal = all(runs[m][0][0] == runs[methods[0]][0][0] for m in methods)
        cells = " | ".join(f"{rates[m]:.1f} tok/s ({rates[m] / base:.2f}x)" for m in methods)
        print(
            f"| {prompt} | {cells} | {ratio:.2f} | {grpc_share:.1%}{'' if equal else ' (OUTPUT DIFFERS)'} |"
        )
    print(
        f"\nservices keep {statistics.geometric_mean(keep):.1%} of in-process speculative throughput "
        f"(geometric mean; min {min(keep):.1%})"
    )


if __name__ == "__main__":
    main()
