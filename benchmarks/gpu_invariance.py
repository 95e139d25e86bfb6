"""The GPU check's row-invariance step (model_runtime/row_invariance.py): what it buys
and what it costs on the check's device and precision.

1. In process, the target with invariance off and on: the row check (a pass over 8
   new tokens against eight passes over 1, through ModelSession, over random
   prefixes: rows that differ in any bit, argmaxes that flip) and the step time at 1,
   5 and 9 new tokens for 1 and 8 sessions (one batched pass), CUDA synchronised.
2. Through the services (target `--row-invariant off`, then `on`; the target's own
   weights as the draft): target-only, k=4 and adaptive k<=8 for 1 session and for 8
   at once; every greedy output compared with the single-session target-only output
   of its prompt, token for token.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from benchmarks import bench_row_invariance as rows
from launcher.cluster import Cluster, start_system
from model_runtime.loading import load_model
from specdec.v1 import orchestrator_pb2_grpc

SESSIONS = (1, 8)
TITLE = "Row invariance: rows differing, step cost, outputs against target-only"


def run(plan, report, step: int, clock, check) -> None:
    """`check` is benchmarks.gpu_check (its Plan, services and timing helpers)."""
    lines = [f"## {step}. {TITLE}", ""]
    lines += in_process(plan, check)
    report.set(step, lines)
    check.off_and_on(plan, report, step, lines, clock, services, service_lines)


def in_process(plan, check) -> list[str]:
    models = {}
    for mode in ("off", "on"):
        check.log(f"  loading {plan.target}, row invariance {mode}")
        models[mode] = load_model(
            plan.target, device=plan.device, dtype=plan.dtype, row_invariant=mode
        )
    try:
        vocab = models["off"].vocab_size
        checks = {
            mode: rows.row_check(loaded.model, vocab, prefixes=8) for mode, loaded in models.items()
        }
        timed = rows.costs(
            {mode: loaded.model for mode, loaded in models.items()},
            vocab,
            plan.repeats,
            synchronize=lambda: check.synchronize(plan.device),
        )
        describe = models["on"].row_invariance.describe()
    finally:
        models.clear()
        check.free_memory()
    args = type("Args", (), {"model": plan.target, "prefixes": 8, "repeats": plan.repeats})
    return rows.report(args, plan.dtype, checks, timed, describe)[2:]


def services(plan, mode: str, check) -> dict:
    """{sessions: {method: (outputs equal to target-only, outputs, aggregate tok/s)}}."""
    log_dir = tempfile.mkdtemp(prefix=f"gpu-invariance-{mode}-")
    args, roles = check.system_args(plan, "none", log_dir)
    for role in roles:
        if role.pool == "target":
            role.args += ["--row-invariant", mode]
    cluster = Cluster(Path(log_dir))
    inputs = list(check.prompts(plan).values())
    variants = [
        ids[i % len(ids) :] + ids[: i % len(ids)]
        for i in range(max(SESSIONS))
        for ids in inputs[:1]
    ]
    try:
        channel = grpc.insecure_channel(start_system(args, cluster, roles))
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        base = "target-only (k=0)"
        references = [check.generate(stub, ids, base, plan).token_ids for ids in variants]
        result: dict[int, dict] = {}
        for sessions in SESSIONS:
            result[sessions] = {}
            for method in check.METHODS:
                with ThreadPoolExecutor(sessions) as pool:
                    start = time.perf_counter()
                    runs = list(
                        pool.map(
                            lambda ids, m=method: check.generate(stub, ids, m, plan),
                            variants[:sessions],
                        )
                    )
                    seconds = time.perf_counter() - start
                equal = sum(r.token_ids == ref for r, ref in zip(runs, references))
                result[sessions][method] = (
                    equal,
                    len(runs),
                    sum(len(r.token_ids) for r in runs) / seconds,
                )
            check.log(f"  invariance {mode}, {sessions} sessions: {result[sessions]}")
        channel.close()
    finally:
        cluster.stop()
    return result


def service_lines(plan, results: dict) -> list[str]:
    lines = [
        "",
        f"Through the services (`--device {plan.device} --dtype {plan.dtype}`, self-draft, greedy, "
        f"{plan.max_new_tokens} new tokens; sessions at once from rotations of one prompt; each output "
        "against the single-session target-only output of its prompt):",
        "",
        "| invariance | sessions | method | equal outputs | aggregate tok/s |",
        "|---|---|---|---|---|",
    ]
    differing = {mode: 0 for mode in results}
    for mode, by_sessions in results.items():
        for sessions, by_method in by_sessions.items():
            for method, (equal, total, rate) in by_method.items():
                differing[mode] += total - equal
                lines.append(
                    f"| {mode} | {sessions} | {method} | {equal} of {total} | {rate:.1f} |"
                )
    lines += [
        "",
        "Outputs differing from target-only: "
        + ", ".join(f"invariance {mode}: {count}" for mode, count in differing.items())
        + ".",
    ]
    return lines
