"""The GPU check's speed at a known acceptance: the benchmark-only replay drafter
(benchmarks/replay_drafter.py) through the services, against Leviathan's bound.

Random weights make acceptance meaningless, so the draft worker runs a 0.5B-shaped
draft model for its cost and proposes the target's own recorded greedy tokens,
replaced at rate 1 - acceptance. Per acceptance (0.6, 0.8, 0.9): target-only, k=4 and
adaptive k<=8 through the services, every output against target-only's; the bound at
the measured costs (in process: the target's pass at 1 and k + 1 new tokens, the
draft's at 1): tokens a round expects, (1 - a^(k+1)) / (1 - a), over the round's time,
k draft passes and one verification, against a target-only pass per token (Leviathan
et al. 2023, eq. 1 with the measured costs in place of c).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.replay_drafter import NAME, write_replay
from launcher.cluster import Cluster, layout, parse_args, start_system
from model_runtime.loading import load_model
from model_runtime.model_session import ModelSession
from specdec.v1 import orchestrator_pb2_grpc
from speculative.estimator import leviathan_speedup

ACCEPTANCES = (0.6, 0.8, 0.9)
FIXED_K = 4
ADAPTIVE_MAX_K = 8
TITLE = (
    "Speed at a known acceptance: the replay drafter (benchmarks only) against Leviathan's bound"
)


def run(plan, report, step: int, clock, check) -> None:
    lines = [
        f"## {step}. {TITLE}",
        "",
        "**Every number here uses the benchmark-only replay drafter.**",
        "",
    ]
    costs = measured_costs(plan, check)
    lines += [
        f"Measured in process: target pass {costs['target_1']:.2f} ms at 1 new token, "
        f"{costs['target_k']:.2f} ms at {FIXED_K + 1}; draft `{plan.replay_draft}` {costs['draft']:.2f} ms a "
        f"token ({costs['draft'] / costs['target_1']:.2f} of a target pass).",
        "",
    ]
    report.set(step, lines)
    results = services(plan, check)
    report.set(step, [*lines, *result_lines(results, costs)])


def _pass_ms(loaded, plan, width: int, check) -> float:
    session = ModelSession(loaded.model, loaded.context_length)
    session.append(check.random_ids(plan.prompt_tokens + 1, loaded.vocab_size, seed=3))
    session.prefill()
    session.truncate_to(plan.prompt_tokens)
    samples = []
    for repeat in range(plan.repeats + 3):
        session.append(check.random_ids(width, loaded.vocab_size, seed=repeat))
        check.synchronize(plan.device)
        start = time.perf_counter()
        session.logits(width)
        check.synchronize(plan.device)
        samples.append((time.perf_counter() - start) * 1e3)
        session.truncate_to(plan.prompt_tokens)
    session.release()
    return statistics.median(samples[3:])


def measured_costs(plan, check) -> dict[str, float]:
    costs = {}
    for name, key, widths in (
        (plan.target, "target", (1, FIXED_K + 1)),
        (plan.replay_draft, "draft", (1,)),
    ):
        loaded = load_model(name, device=plan.device, dtype=plan.dtype)
        try:
            for width in widths:
                suffix = "" if key == "draft" else ("_1" if width == 1 else "_k")
                costs[key + suffix] = _pass_ms(loaded, plan, width, check)
        finally:
            del loaded
            check.free_memory()
    return costs


def leviathan_bound(acceptance: float, k: int, costs: dict[str, float]) -> float:
    """Speedup over target-only of rounds of k at per-token acceptance `acceptance`."""
    return leviathan_speedup(acceptance, k, costs["draft"], costs["target_1"], costs["target_k"])


def services(plan, check) -> dict:
    """{acceptance: {method: (tok/s median over prompts' runs, equal, total, acceptance measured)}},
    with the target-only baseline under key 0.0."""
    log_dir = tempfile.mkdtemp(prefix="gpu-replay-")
    replay_file = str(Path(log_dir) / "replay.json")
    args = parse_args(["--http-port", "-1", "--port", "0"])
    args.target_model = plan.target
    args.draft_model = plan.replay_draft
    args.draft_quantization = "none"
    args.drafter = "model"
    args.threads = plan.threads
    args.log_dir = log_dir
    args.startup_timeout = plan.startup_timeout_s
    roles = layout(args)
    for role in roles:
        if role.pool in ("target", "draft"):
            role.args += ["--device", plan.device, "--dtype", plan.dtype]
        if role.pool == "draft":
            role.args += ["--drafter-plugin", f"benchmarks.replay_drafter:drafters:{replay_file}"]
    inputs = check.prompts(plan)
    cluster = Cluster(Path(log_dir))
    try:
        channel = grpc.insecure_channel(start_system(args, cluster, roles))
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        references = {
            name: _generate(stub, ids, 0, False, plan, check) for name, ids in inputs.items()
        }
        baseline = [r[1] for r in references.values()]
        write_replay(replay_file, 1.0, [inputs[name] + r[0] for name, r in references.items()])
        results: dict = {
            0.0: {
                "target-only (k=0)": (
                    statistics.median(baseline),
                    len(baseline),
                    len(baseline),
                    None,
                )
            }
        }
        for acceptance in ACCEPTANCES:
            write_replay(
                replay_file, acceptance, [inputs[name] + r[0] for name, r in references.items()]
            )
            results[acceptance] = {}
            for method, k, adaptive in (
                (f"k={FIXED_K}", FIXED_K, False),
                (f"adaptive k<={ADAPTIVE_MAX_K}", ADAPTIVE_MAX_K, True),
            ):
                runs = {
                    name: _generate(stub, ids, k, adaptive, plan, check)
                    for name, ids in inputs.items()
                }
                equal = sum(runs[name][0] == references[name][0] for name in runs)
                rates = [runs[name][1] / references[name][1] for name in runs]
                measured = [r[2] for r in runs.values() if r[2] is not None]
                results[acceptance][method] = (
                    statistics.geometric_mean(rates),
                    equal,
                    len(runs),
                    statistics.fmean(measured) if measured else None,
                )
            check.log(f"  replay acceptance {acceptance}: {results[acceptance]}")
        channel.close()
    finally:
        cluster.stop()
    return results


def _generate(
    stub, ids: list[int], k: int, adaptive: bool, plan, check
) -> tuple[list[int], float, float | None]:
    run = check.call(stub, ids, k, adaptive, plan, drafter=NAME)
    return run.token_ids, run.tokens_per_s, run.acceptance


def result_lines(results: dict, costs: dict[str, float]) -> list[str]:
    base = results[0.0]["target-only (k=0)"][0]
    lines = [
        f"Through the services, target-only: {base:.1f} tok/s (median over prompts). Speedup over it "
        "(geometric mean over prompts), outputs equal to target-only's, the calls' measured acceptance "
        "(accepted over drafted: a chain stops at its first replaced token), and the bound:",
        "",
        "| acceptance | method | speedup | bound at k=4 | equal outputs | measured acceptance |",
        "|---|---|---|---|---|---|",
    ]
    for acceptance in ACCEPTANCES:
        for method, (speedup, equal, total, measured) in results[acceptance].items():
            shown = "-" if measured is None else f"{measured:.2f}"
            lines.append(
                f"| {acceptance} | {method} | {speedup:.2f}x | {leviathan_bound(acceptance, FIXED_K, costs):.2f}x "
                f"| {equal} of {total} | {shown} |"
            )
    return lines
