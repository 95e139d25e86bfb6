"""The GPU check's first step: a pass's time, eager (the old path) against fixed-shape
passes replayed as CUDA graphs (model_runtime/static_passes.py, the new one), beside
the HBM bound, and through the services, target-only, old path against new.

In process, for the target and the two draft shapes: one step of w new tokens for each
of s sessions (forward_segments, as the step scheduler runs it) over `plan.prefix`
cached tokens, at w = 1, 2, 4, 8, 16 for one session and s = 4, 16 at w = 1; median of
`plan.repeats` after 3 untimed, synchronised around each. The bound: the weights' bytes
over the device's copy bandwidth, measured here (a device-to-device copy of 1 GiB,
read and written: twice its bytes a copy).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from launcher.cluster import Cluster, start_system
from model_runtime import static_passes
from model_runtime.batched_forward import Segment, forward_segments
from model_runtime.loading import load_model
from model_runtime.model_session import ModelSession
from specdec.v1 import orchestrator_pb2_grpc
from speculative.drafters import ModelDrafter
from speculative.sampling import SamplingParams

TITLE = "Passes: eager (old) against fixed-shape passes as CUDA graphs (new), beside the HBM bound"
WIDTHS = (1, 2, 4, 8, 16)
SESSIONS = (4, 16)
CHAIN = 8  # draft tokens a proposal: greedy, as a draft worker drafts them


def run(plan, report, step: int, clock, check) -> None:
    bandwidth = copy_bandwidth(plan, check)
    lines = [
        f"## {step}. {TITLE}",
        "",
        f"Copy bandwidth measured here: {bandwidth / 1e9:.0f} GB/s. One step of w new tokens for each of s "
        f"sessions over {plan.prefix} cached tokens (forward_segments, the workers' path), median of "
        f"{plan.repeats} after 3 untimed, synchronised; in brackets, the bound over the time (1.00 = at "
        "the bound). New: `--static-passes on` (CUDA graphs on a GPU; eager fixed shapes on a CPU).",
        "",
        "| model | path | bound | "
        + " | ".join(f"w={w}" for w in WIDTHS)
        + " | "
        + " | ".join(f"s={s}, w=1" for s in SESSIONS)
        + f" | drafting, a token of {CHAIN} |",
        "|---" * (4 + len(WIDTHS) + len(SESSIONS)) + "|",
    ]
    report.set(step, lines)
    for name in dict.fromkeys((plan.target, plan.replay_draft, plan.draft)):
        for row in model_rows(plan, name, bandwidth, check):
            lines.append(row)
            report.set(step, lines)
    check.off_and_on(plan, report, step, lines, clock, services, service_lines)


def copy_bandwidth(plan, check) -> float:
    """Bytes a second a device copy reads and writes (the HBM's usable bandwidth)."""
    size = (1 << 30) if plan.device == "cuda" else (1 << 26)
    source = torch.empty(size, dtype=torch.uint8, device=plan.device)
    target = torch.empty_like(source)
    samples = []
    for _ in range(6):
        check.synchronize(plan.device)
        start = time.perf_counter()
        target.copy_(source)
        check.synchronize(plan.device)
        samples.append(time.perf_counter() - start)
    del source, target
    return 2 * size / statistics.median(samples[1:])


def model_rows(plan, name: str, bandwidth: float, check) -> list[str]:
    loaded = load_model(name, device=plan.device, dtype=plan.dtype)
    rows = []
    try:
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        bound_ms = weight_bytes / bandwidth * 1e3
        for path in ("old (eager)", "new (static)"):
            if path.startswith("new"):
                passes = static_passes.install(
                    loaded.model, static_passes.ON, max(SESSIONS), plan.prefix + 32
                )
            timed = step_times(loaded, plan, check)
            cells = [f"{ms:.2f} ms ({bound_ms / ms:.2f})" for ms in timed]
            cells.append(f"{draft_ms_per_token(loaded, plan, check):.2f} ms")
            note = f" ({passes.failure})" if path.startswith("new") and passes.failure else ""
            rows.append(
                f"| `{name}` | {path}{note} | {bound_ms:.2f} ms | " + " | ".join(cells) + " |"
            )
            check.log(f"  {name} {path}: " + ", ".join(f"{ms:.2f}" for ms in timed))
    finally:
        del loaded
        check.free_memory()
    return rows


def step_times(loaded, plan, check) -> list[float]:
    """ms of a step at each of WIDTHS for one session, then of SESSIONS sessions at w=1."""
    sessions = []
    for index in range(max(SESSIONS)):
        session = ModelSession(loaded.model, loaded.context_length)
        session.append(check.random_ids(plan.prefix + 1, loaded.vocab_size, seed=index))
        session.prefill()
        session.truncate_to(plan.prefix)
        sessions.append(session)
    shapes = [(1, w) for w in WIDTHS] + [(s, 1) for s in SESSIONS]
    result = []
    for count, width in shapes:
        samples = []
        for repeat in range(plan.repeats + 3):
            segments = [
                Segment(
                    s._kv,
                    plan.prefix,
                    check.random_ids(width, loaded.vocab_size, seed=repeat),
                    width,
                )
                for s in sessions[:count]
            ]
            check.synchronize(plan.device)
            start = time.perf_counter()
            forward_segments(loaded.model, segments)
            check.synchronize(plan.device)
            samples.append((time.perf_counter() - start) * 1e3)
        result.append(statistics.median(samples[3:]))
    for session in sessions:
        session.release()
    return result


def draft_ms_per_token(loaded, plan, check) -> float:
    """A greedy proposal of CHAIN tokens as a draft worker drafts it (the new path: one
    chain on the device where passes are CUDA graphs), in ms a token, median of repeats."""
    drafter = ModelDrafter(loaded)
    session = drafter.open(
        check.random_ids(plan.prefix, loaded.vocab_size, seed=5), SamplingParams()
    )
    session.prefill()
    base = session.length
    samples = []
    for _ in range(plan.repeats + 3):
        check.synchronize(plan.device)
        start = time.perf_counter()
        session.propose(CHAIN)
        check.synchronize(plan.device)
        samples.append((time.perf_counter() - start) * 1e3 / CHAIN)
        session.truncate_to(base)  # the next proposal drafts the same positions again
    session.release()
    return statistics.median(samples[3:])


def services(plan, mode: str, check) -> float:
    """Target-only tokens/s through the services (median over prompts), both workers
    with `--static-passes mode`; every output checked against the first run's."""
    log_dir = tempfile.mkdtemp(prefix=f"gpu-passes-{mode}-")
    args, roles = check.system_args(plan, "none", log_dir)
    for role in roles:
        if role.pool in ("target", "draft"):
            role.args += ["--static-passes", mode]
    cluster = Cluster(Path(log_dir))
    try:
        channel = grpc.insecure_channel(start_system(args, cluster, roles))
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        base = "target-only (k=0)"
        rates = []
        for ids in check.prompts(plan).values():
            check.generate(stub, ids, base, plan)  # warm-up: the graphs of this prompt's shapes
            rates.append(
                statistics.median(
                    check.generate(stub, ids, base, plan).tokens_per_s
                    for _ in range(plan.e2e_repeats)
                )
            )
        channel.close()
    finally:
        cluster.stop()
    return statistics.median(rates)


def service_lines(plan, rates: dict[str, float]) -> list[str]:
    return [
        "",
        f"Through the services, target-only (`Generate` with k=0, {plan.max_new_tokens} new tokens, median over "
        f"prompts of the median of {plan.e2e_repeats}): old path (`--static-passes off`) {rates['off']:.1f} "
        f"tok/s, new (`on`) {rates['on']:.1f} tok/s: {rates['on'] / rates['off']:.2f}x.",
    ]
