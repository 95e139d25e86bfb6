"""A GPU check in one command: pass width, draft quantization, speculative speedup.

    python -m benchmarks.gpu_check [--out DIR]      # on a CUDA machine, about 5-7 minutes
    python -m benchmarks.gpu_check --smoke          # the same steps on a CPU, tiny sizes, fp32

Nothing is downloaded: the models are `random:SHAPE:SEED` (model_runtime/tiny.py), random
weights with the real sizes of Qwen2.5 7B (the target) and 1.5B (a draft), bf16 on
CUDA, with the byte tokenizer. A pass's time depends on the shape, not on the values.
Measured, in this order (a time budget, --budget-s, drops the optional parts last):

1. (benchmarks/gpu_passes.py) a step's time over a cached prefix (512 tokens) at 1, 2,
   4, 8 and 16 new tokens and for 4 and 16 sessions, eager (the old path) against
   fixed-shape passes replayed as CUDA graphs (the new one), for the target and both
   draft shapes, beside the HBM bound (the weights' bytes over a measured device copy);
   then target-only through the services with `--static-passes off` and `on`;
2. a draft's time per token (width-1 passes, as a draft worker runs them) for each
   quantization scheme of model_runtime/quantization.py, with its greedy agreement with
   the unquantized model (teacher-forced: the share of positions where the quantized
   model picks the unquantized one's token, what a quantized self-draft can accept);
   a scheme that fails (torchao missing, a kernel this GPU lacks) is a row with its
   error; the 7B's rows come after the first services run, as time allows;
3. tokens/s through the services (`launcher.cluster`: target, draft and orchestrator
   as local processes, `--device cuda --dtype bfloat16`), target-only (k=0) against
   k=4 and adaptive k<=8, with a `self` draft: the target's own weights (same seed),
   unquantized (every draft token is the target's, up to bf16 rounding), then, as time
   allows, quantized with the fastest scheme of step 2. Greedy; every output is
   checked against target-only's, token for token. bf16 rounds a row's logits to
   0.4-0.8%, and the top two of 151936 random logits are closer than that at some
   positions: a batched pass (verifying k tokens) and a width-1 pass (target-only)
   can then pick different tokens. A differing output is reported with the logits of
   both tokens at its first difference, in bf16 steps (a tie or one step: rounding;
   more: a bug);
5. the same services with the target sharded over the GPUs this machine has (`--tensor-parallel N`:
   the most GPUs that divide the target's heads; on one GPU it says so and runs nothing),
   target-only against k=4 and adaptive, each output checked against the sharded
   target-only's and the single-process target-only's of step 3;
6. (run second) row invariance (benchmarks/gpu_invariance.py): rows differing between a
   wide and narrow passes and the step cost, invariance off and on, in process; through
   the services with `--row-invariant off` and `on`, target-only, k=4 and adaptive for
   1 and 8 sessions at once, every output against single-session target-only;
7. (run third) speed at a known acceptance (benchmarks/gpu_replay.py): the benchmark-only
   replay drafter at acceptance 0.6, 0.8, 0.9 with a 0.5B-shaped draft's cost, k=4 and
   adaptive, through the services, against Leviathan's bound at the measured costs.

Results go to DIR/results_gpu.md (DIR/results_gpu_smoke.md with --smoke), rewritten
after each step (a run cut short leaves what it measured), and are printed at the end.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to fetch: fail at once if something tries

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks import gpu_invariance, gpu_passes, gpu_replay  # noqa: E402
from benchmarks.prompts import PROMPTS  # noqa: E402
from launcher.cluster import Cluster, layout, parse_args, start_system  # noqa: E402
from model_runtime import quantization, tiny  # noqa: E402
from model_runtime.loading import LoadedModel, load_model  # noqa: E402
from model_runtime.model_session import ModelSession  # noqa: E402
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc  # noqa: E402

SCHEMES = ("none", "int8-dynamic", "int8-weight-only", "int4-weight-only", "fp8")
ADAPTIVE_MAX_K = 8
FIXED_K = 4
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
TITLES = {
    1: gpu_passes.TITLE,
    2: "Draft time per token by quantization",
    3: "End to end: self-draft unquantized",
    4: "End to end: self-draft quantized {scheme}",
    5: "End to end: the target over {ranks} devices (tensor parallel), self-draft unquantized",
    6: gpu_invariance.TITLE,
    7: gpu_replay.TITLE,
}


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    target: str
    draft: str
    device: str
    dtype: str
    prefix: int  # cached tokens under the width passes
    widths: tuple[int, ...]
    repeats: int  # timed passes per width
    decode_tokens: int  # timed width-1 passes per quantization scheme
    prompt_tokens: int  # prompt length, step 2 and 3
    prompts: int  # prompts, step 3
    max_new_tokens: int
    e2e_repeats: int  # interleaved rounds over the methods, per prompt
    budget_s: float  # the whole run; optional parts are skipped to stay within it
    threads: int  # torch threads per service process (0: torch's default)
    startup_timeout_s: float
    call_timeout_s: float  # one Generate call
    # Seconds an optional part is expected to take at most: it starts only with this left.
    target_schemes_s: float
    quantized_e2e_s: float
    tensor_parallel_s: float
    devices: int = 0  # ranks step 5 may use (0: the GPUs this machine has)
    replay_draft: str = "random:qwen2.5-0.5b:0"  # step 7's draft model: the replay drafter's cost


GPU = Plan(
    target="random:qwen2.5-7b:0",
    draft="random:qwen2.5-1.5b:0",
    device="cuda",
    dtype="bfloat16",
    prefix=512,
    widths=(1, 2, 4, 8, 16),
    repeats=20,
    decode_tokens=32,
    prompt_tokens=128,
    prompts=3,
    max_new_tokens=64,
    e2e_repeats=3,
    budget_s=450.0,
    threads=0,
    startup_timeout_s=180.0,
    call_timeout_s=60.0,
    target_schemes_s=100.0,
    quantized_e2e_s=150.0,
    tensor_parallel_s=150.0,
)
SMOKE = Plan(
    target="random:qwen2-tiny:0",
    draft="random:qwen2-tiny:1",
    device="cpu",
    dtype="float32",
    prefix=32,
    widths=(1, 2, 4, 8, 16),
    repeats=3,
    decode_tokens=8,
    prompt_tokens=24,
    prompts=1,
    max_new_tokens=12,
    e2e_repeats=1,
    budget_s=480.0,
    threads=1,
    startup_timeout_s=120.0,
    call_timeout_s=60.0,
    target_schemes_s=10.0,
    quantized_e2e_s=40.0,
    tensor_parallel_s=40.0,
    devices=2,
    replay_draft="random:qwen2-tiny:1",
)


@dataclass
class Report:
    """What the run measured so far, as markdown sections in the order of the steps."""

    path: Path
    header: list[str] = field(default_factory=list)
    sections: dict[int, list[str]] = field(default_factory=dict)
    runs: dict[int, dict] = field(default_factory=dict)  # an end-to-end step's runs, by step

    def set(self, step: int, lines: list[str]) -> None:
        self.sections[step] = lines
        self.write()

    def text(self) -> str:
        lines = list(self.header)
        for step in sorted(self.sections):
            lines += ["", *self.sections[step]]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.text())


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default="benchmarks", help="directory of results_gpu.md")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, fp32, on the CPU: checks the script"
    )
    parser.add_argument("--target", default="", help="target model (default random:qwen2.5-7b:0)")
    parser.add_argument(
        "--draft", default="", help="draft model of step 2 (default random:qwen2.5-1.5b:0)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=0.0, help="time budget of the whole run (default 450 s)"
    )
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else GPU
    plan = replace(
        plan,
        target=args.target or plan.target,
        draft=args.draft or plan.draft,
        budget_s=args.budget_s or plan.budget_s,
    )
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the CPU check of the script", file=sys.stderr)
        return 2
    clock = Clock(plan.budget_s)
    report = Report(Path(args.out) / ("results_gpu_smoke.md" if args.smoke else "results_gpu.md"))
    report.header = header(plan, argv if argv is not None else sys.argv[1:])
    report.write()

    timings: dict[str, dict[str, SchemeRow]] = {}
    guarded(
        report, 1, TITLES[1], lambda: gpu_passes.run(plan, report, 1, clock, sys.modules[__name__])
    )
    guarded(
        report,
        6,
        TITLES[6],
        lambda: gpu_invariance.run(plan, report, 6, clock, sys.modules[__name__]),
    )
    for step, run in (
        (7, lambda: gpu_replay.run(plan, report, 7, clock, sys.modules[__name__])),
        (2, lambda: step_schemes(plan, report, timings, [plan.draft], clock)),
        (3, lambda: step_e2e(plan, report, 3, quantization.NONE, clock)),
    ):
        if clock.left() < plan.quantized_e2e_s:  # the budget holds the check to its minutes
            report.set(
                step,
                [
                    f"## {step}. {TITLES[step].format(scheme='', ranks='')}",
                    "",
                    f"Skipped: {clock.left():.0f} s of the budget left.",
                ],
            )
            continue
        guarded(report, step, TITLES[step], run)
    if clock.left() >= plan.target_schemes_s:
        guarded(
            report,
            2,
            TITLES[2],
            lambda: step_schemes(plan, report, timings, [plan.draft, plan.target], clock),
        )
    else:
        note(
            report,
            2,
            f"The target's rows ({plan.target}): skipped, {clock.left():.0f} s of the budget left.",
        )
    scheme = fastest_quantized(timings, plan)
    if scheme is None:
        report.set(
            4,
            [
                f"## 4. {TITLES[4].format(scheme='')}",
                "",
                "Skipped: no quantization scheme ran in step 2.",
            ],
        )
    elif clock.left() < plan.quantized_e2e_s:
        report.set(
            4,
            [
                f"## 4. {TITLES[4].format(scheme=scheme)}",
                "",
                f"Skipped: {clock.left():.0f} s of the budget left, {plan.quantized_e2e_s:.0f} s needed.",
            ],
        )
    else:
        guarded(
            report,
            4,
            TITLES[4].format(scheme=scheme),
            lambda: step_e2e(plan, report, 4, scheme, clock),
        )
    step_tensor_parallel(plan, report, clock)
    report.header.append(
        f"- run time: {clock.elapsed():.0f} s (budget {plan.budget_s:.0f} s: optional parts start "
        "only with their time left)"
    )
    report.write()
    print(report.text())
    return 0


def off_and_on(
    plan: Plan, report: Report, step: int, lines: list[str], clock: Clock, services, render
) -> None:
    """A step's services part: `services(plan, mode, check)` with its setting off and
    on, rendered below the step's `lines`; skipped when the budget cannot hold it."""
    if clock.left() < plan.quantized_e2e_s:
        report.set(
            step, [*lines, "", f"Services part skipped: {clock.left():.0f} s of the budget left."]
        )
        return
    results = {mode: services(plan, mode, sys.modules[__name__]) for mode in ("off", "on")}
    report.set(step, [*lines, *render(plan, results)])


def guarded(report: Report, step: int, title: str, run) -> None:
    """Runs one step; an error becomes the step's section rather than the run's end."""
    log(f"step {step}: {title}")
    try:
        run()
    except Exception as error:  # noqa: BLE001 - reported, and the next step still runs
        lines = report.sections.get(step) or [f"## {step}. {title}"]
        report.set(step, [*lines, "", f"**Failed**: {describe_error(error)}"])
        log(f"step {step} failed: {describe_error(error)}")


def note(report: Report, step: int, text: str) -> None:
    report.set(step, [*report.sections.get(step, []), "", text])


def describe_error(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:300]}"


def header(plan: Plan, argv: list[str]) -> list[str]:
    if plan.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        device = (
            f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB, compute capability "
            f"{properties.major}.{properties.minor}), CUDA {torch.version.cuda}"
        )
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), no GPU: smoke run"
    return [
        "# GPU check: pass width, draft quantization, speculative speedup",
        "",
        "`" + " ".join(["python -m benchmarks.gpu_check", *argv]) + "`",
        "",
        f"- device: {device}",
        f"- torch {torch.__version__}, transformers {_version('transformers')}, torchao {_version('torchao')}; "
        f"commit {_commit()}; {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"- models: target `{plan.target}`, draft `{plan.draft}` (random weights with the real sizes, "
        f"model_runtime/tiny.py: a pass's time depends on the shape), {plan.dtype} on {plan.device}",
    ]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- timing ------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_ids(count: int, vocab_size: int, seed: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(vocab_size) for _ in range(count)]


# --- quantization --------------------------------------------------------------------------


@dataclass
class SchemeRow:
    ms_per_token: float | None = None
    agreement: float | None = None  # share of positions with the unquantized model's greedy token
    error: str = ""
    load_s: float = 0.0


def decode(
    loaded: LoadedModel, plan: Plan, forced: list[int] | None
) -> tuple[list[float], list[int]]:
    """Width-1 passes after a plan.prompt_tokens prompt: seconds per pass and the greedy
    token of each; with `forced`, those tokens are appended instead (teacher forcing)."""
    session = ModelSession(loaded.model, loaded.context_length)
    session.append(random_ids(plan.prompt_tokens, tiny.TINY_VOCAB_SIZE, seed=2))
    session.prefill()
    seconds, chosen = [], []
    for index in range(plan.decode_tokens + 3):  # 3 untimed
        token = forced[index] if forced is not None else None
        synchronize(plan.device)
        start = time.perf_counter()
        picked = int(session.logits(1)[0].argmax())
        synchronize(plan.device)
        if index >= 3:
            seconds.append(time.perf_counter() - start)
        chosen.append(picked)
        session.append([picked if token is None else token])
    session.release()
    return seconds, chosen


def step_schemes(
    plan: Plan,
    report: Report,
    timings: dict[str, dict[str, SchemeRow]],
    models: list[str],
    clock: Clock,
) -> None:
    for name in models:
        if name in timings:
            continue
        rows = timings[name] = {}
        reference: list[int] | None = None
        for scheme in SCHEMES:
            log(f"  {name}, quantization {scheme}")
            row = rows[scheme] = SchemeRow()
            loaded = None
            try:
                start = time.monotonic()
                loaded = load_model(name, device=plan.device, dtype=plan.dtype, quantize=scheme)
                synchronize(plan.device)
                row.load_s = time.monotonic() - start
                seconds, chosen = decode(loaded, plan, reference)
                row.ms_per_token = statistics.median(seconds) * 1e3
                if reference is None:
                    reference = chosen
                else:
                    row.agreement = sum(a == b for a, b in zip(chosen, reference)) / len(reference)
            except Exception as error:  # noqa: BLE001 - a row, not the end of the run
                row.error = describe_error(error)
            finally:
                del loaded
                free_memory()
            report.set(2, scheme_lines(plan, timings))
        log(f"  {name} done at {clock.elapsed():.0f} s")


def scheme_lines(plan: Plan, timings: dict[str, dict[str, SchemeRow]]) -> list[str]:
    lines = [
        f"## 2. {TITLES[2]}",
        "",
        f"Width-1 passes after a {plan.prompt_tokens}-token prompt, median of {plan.decode_tokens} after 3 "
        "untimed (synchronised around each), quantized by `load_model(..., quantize=SCHEME)` "
        "(model_runtime/quantization.py; on CUDA through torchao), output layer quantized too. Agreement: "
        "the share of positions where the quantized model's greedy token is the unquantized model's "
        "(teacher-forced on the unquantized model's tokens): what a quantized self-draft can accept.",
        "",
        "| model | scheme | ms / token | vs none | agreement with none | load + quantize | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in timings.items():
        base = rows.get("none")
        for scheme, row in rows.items():
            if row.error:
                lines.append(f"| `{name}` | {scheme} | | | | | {row.error.replace('|', '/')} |")
                continue
            speed = (
                f"{base.ms_per_token / row.ms_per_token:.2f}x" if base and base.ms_per_token else ""
            )
            agreement = "" if row.agreement is None else f"{row.agreement:.0%}"
            lines.append(
                f"| `{name}` | {scheme} | {row.ms_per_token:.2f} | {speed} | {agreement} | "
                f"{row.load_s:.1f} s | |"
            )
    return lines


def fastest_quantized(timings: dict[str, dict[str, SchemeRow]], plan: Plan) -> str | None:
    """The quantized scheme with the fewest ms per token, on the target if measured
    there, else on the draft; None if none ran."""
    rows = timings.get(plan.target) or timings.get(plan.draft) or {}
    ran = {
        scheme: row.ms_per_token
        for scheme, row in rows.items()
        if scheme != quantization.NONE and row.ms_per_token is not None
    }
    return min(ran, key=ran.get) if ran else None


# --- end to end ----------------------------------------------------------------------------


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    acceptance: float | None

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds


METHODS = {  # name -> (num_speculative_tokens, adaptive)
    "target-only (k=0)": (0, False),
    f"k={FIXED_K}": (FIXED_K, False),
    f"adaptive k<={ADAPTIVE_MAX_K}": (ADAPTIVE_MAX_K, True),
}


def prompts(plan: Plan) -> dict[str, list[int]]:
    """Byte-tokenized prompts of plan.prompt_tokens tokens (text repeated to length)."""
    tokenizer = tiny.byte_tokenizer()
    chosen = {}
    for name, text in list(PROMPTS.items())[: plan.prompts]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        chosen[name] = (ids * (plan.prompt_tokens // len(ids) + 1))[: plan.prompt_tokens]
    return chosen


def generate(stub, ids: list[int], method: str, plan: Plan) -> Run:
    return call(stub, ids, *METHODS[method], plan)


def call(stub, ids: list[int], k: int, adaptive: bool, plan: Plan, drafter: str = "model") -> Run:
    """One greedy Generate call of plan.max_new_tokens, timed by the client."""
    request = orchestrator_pb2.GenerateRequest(include_stats=True)
    request.token_ids.ids.extend(ids)
    request.sampling.max_new_tokens = plan.max_new_tokens  # greedy: temperature 0 by default
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=k, drafter=drafter, adaptive=adaptive)
    )
    start = time.perf_counter()
    response = stub.Generate(request, timeout=plan.call_timeout_s)
    seconds = time.perf_counter() - start
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=response.session_id), timeout=60)
    drafted = response.stats.num_drafted
    return Run(
        list(response.token_ids), seconds, response.stats.acceptance_rate if drafted else None
    )


def system_args(
    plan: Plan, draft_quantization: str, log_dir: str, ranks: int = 1
) -> tuple[argparse.Namespace, list]:
    args = parse_args(["--http-port", "-1", "--port", "0"])  # gRPC clients only
    args.target_model = plan.target
    args.draft_model = "self"
    args.draft_quantization = draft_quantization
    args.tensor_parallel = ranks
    args.drafter, args.threads, args.log_dir = "model", plan.threads, log_dir
    args.startup_timeout = plan.startup_timeout_s
    roles = layout(args)
    for role in roles:
        if role.pool in ("target", "draft"):
            role.args += ["--device", plan.device, "--dtype", plan.dtype]
    return args, roles


def shardable_ranks(plan: Plan) -> int:
    """The most devices (of those here) that divide the target's attention and key-value heads."""
    available = plan.devices or torch.cuda.device_count()
    if not tiny.is_random_shaped(plan.target):
        return available  # the worker refuses heads that do not divide, with a clear error
    shape, _ = tiny.parse_random_name(plan.target)
    return max(
        n
        for n in range(1, available + 1)
        if shape.num_heads % n == 0 and shape.num_kv_heads % n == 0
    )


def step_tensor_parallel(plan: Plan, report: Report, clock: Clock) -> None:
    ranks = shardable_ranks(plan)
    title = f"## 5. {TITLES[5].format(ranks=ranks)}"
    if ranks < 2:
        report.set(
            5,
            [
                title,
                "",
                f"Not run: {plan.devices or torch.cuda.device_count()} GPU(s) here; tensor "
                "parallelism needs 2 or more (one rank is step 3's target).",
            ],
        )
    elif clock.left() < plan.tensor_parallel_s:
        report.set(
            5,
            [
                title,
                "",
                f"Skipped: {clock.left():.0f} s of the budget left, {plan.tensor_parallel_s:.0f} s "
                "needed.",
            ],
        )
    else:
        guarded(
            report,
            5,
            TITLES[5].format(ranks=ranks),
            lambda: step_e2e(plan, report, 5, quantization.NONE, clock, ranks),
        )


def step_e2e(
    plan: Plan, report: Report, step: int, draft_quantization: str, clock: Clock, ranks: int = 1
) -> None:
    title = f"## {step}. {TITLES[step].format(scheme=draft_quantization, ranks=ranks)}"
    log_dir = tempfile.mkdtemp(prefix="gpu-check-logs-")
    args, roles = system_args(plan, draft_quantization, log_dir, ranks)
    cluster = Cluster(Path(log_dir))
    inputs = prompts(plan)
    try:
        start = time.monotonic()
        channel = grpc.insecure_channel(start_system(args, cluster, roles))
        started_s = time.monotonic() - start
        log(f"  services serving after {started_s:.0f} s")
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        first = next(iter(inputs.values()))
        for method in METHODS:  # warm-up: first sessions, the adaptive policy's first estimates
            generate(stub, first, method, plan)
        runs: dict[str, dict[str, list[Run]]] = {}
        for name, ids in inputs.items():
            runs[name] = {method: [] for method in METHODS}
            for repeat in range(plan.e2e_repeats):
                for method in rotated(list(METHODS), repeat):
                    runs[name][method].append(generate(stub, ids, method, plan))
            log(
                f"  {name}: "
                + ", ".join(f"{m} {median_rate(r):.1f} tok/s" for m, r in runs[name].items())
            )
        channel.close()
    finally:
        cluster.stop()
    report.runs[step] = runs
    lines = e2e_lines(plan, title, runs, started_s, draft_quantization)
    if ranks > 1:
        lines += single_process_lines(report, runs)
    report.set(step, lines)
    mismatches = [
        (name, method, run)
        for name, by_method in runs.items()
        for method, method_runs in by_method.items()
        for run in method_runs
        if run.token_ids != by_method["target-only (k=0)"][0].token_ids
    ]
    if mismatches:
        report.set(step, [*lines, *diagnose(plan, inputs, runs, mismatches, clock)])


def single_process_lines(report: Report, runs: dict[str, dict[str, list[Run]]]) -> list[str]:
    """The sharded target's target-only output and speed against step 3's single process."""
    single = report.runs.get(3)
    if not single:
        return ["", "Step 3 did not run: nothing to compare with the single-process target."]
    base = "target-only (k=0)"
    equal = sum(runs[name][base][0].token_ids == single[name][base][0].token_ids for name in runs)
    speeds = [median_rate(runs[name][base]) / median_rate(single[name][base]) for name in runs]
    return [
        "",
        f"Against step 3's single-process target: {equal} of {len(runs)} target-only outputs equal token for "
        f"token; target-only tokens/s {statistics.geometric_mean(speeds):.2f}x the single process's "
        "(geometric mean; the steps ran minutes apart).",
    ]


def rotated(names: list[str], repeat: int) -> list[str]:
    """Round `repeat`'s order: rotated, reversed every other round (each method gets
    each position and each predecessor)."""
    shift = (repeat // 2) % len(names)
    order = names[shift:] + names[:shift]
    return order[::-1] if repeat % 2 else order


def median_rate(runs: list[Run]) -> float:
    return statistics.median(run.tokens_per_s for run in runs)


def e2e_lines(
    plan: Plan,
    title: str,
    runs: dict[str, dict[str, list[Run]]],
    started_s: float,
    draft_quantization: str,
) -> list[str]:
    methods = list(METHODS)
    lines = [
        title,
        "",
        f"Target `{plan.target}` and draft `self` (`--draft-model self --draft-quantization "
        f"{draft_quantization}`: the same model and seed in the draft worker) as local processes, "
        f"`--device {plan.device} --dtype {plan.dtype}`, serving {started_s:.0f} s after start. "
        f"Greedy, {plan.max_new_tokens} new tokens from {plan.prompt_tokens}-token prompts (token ids), "
        f"`Generate` timed by the client, median of {plan.e2e_repeats} interleaved rounds after a warm-up; "
        "in brackets over target-only; acceptance from the calls' statistics (-: nothing drafted, the "
        "adaptive policy let the target decode alone).",
        "",
        "| prompt | " + " | ".join(methods) + " | acceptance " + " / ".join(methods[1:]) + " |",
        "|---" * (len(methods) + 2) + "|",
    ]
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    for name, by_method in runs.items():
        base = median_rate(by_method[methods[0]])
        cells = []
        for method in methods:
            rate = median_rate(by_method[method])
            ratios[method].append(rate / base)
            cells.append(f"{rate:.1f} tok/s ({rate / base:.2f}x)")
        acceptance = " / ".join(_acceptance(by_method[m]) for m in methods[1:])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {acceptance} |")
    if len(runs) > 1:
        lines.append(
            "| geometric mean | "
            + " | ".join(f"{statistics.geometric_mean(ratios[m]):.2f}x" for m in methods)
            + " | |"
        )
    total = equal = 0
    for by_method in runs.values():
        reference = by_method[methods[0]][0].token_ids
        for method_runs in by_method.values():
            for run in method_runs:
                total += 1
                equal += run.token_ids == reference
    verdict = "every output equals" if equal == total else f"**{total - equal} differ from**"
    lines += [
        "",
        f"Exactness: {equal} of {total} outputs (all methods, all rounds) equal target-only's first "
        f"output of their prompt token for token: {verdict} target-only.",
    ]
    return lines


def _acceptance(runs: list[Run]) -> str:
    rates = [run.acceptance for run in runs if run.acceptance is not None]
    return f"{statistics.fmean(rates):.0%}" if rates else "-"


def diagnose(
    plan: Plan, inputs: dict[str, list[int]], runs, mismatches, clock: Clock, limit: int = 3
) -> list[str]:
    """For the first differing outputs: the target's own logits (in process, same seed,
    a width-1 pass as target-only's) of both tokens at the first difference."""
    lines = [
        "",
        "First differences (the target in process, width-1 pass at that position, as target-only):",
        "",
    ]
    if clock.left() < 30:
        return [*lines, f"not examined: {clock.left():.0f} s of the budget left"]
    loaded = load_model(plan.target, device=plan.device, dtype=plan.dtype)
    try:
        for name, method, run in mismatches[:limit]:
            reference = runs[name]["target-only (k=0)"][0].token_ids
            index = next(
                (i for i, (a, b) in enumerate(zip(reference, run.token_ids)) if a != b),
                min(len(reference), len(run.token_ids)),
            )
            if index >= min(len(reference), len(run.token_ids)):
                lines.append(
                    f"- {name}, {method}: lengths {len(run.token_ids)} vs {len(reference)}, "
                    f"equal up to {index}"
                )
                continue
            # As target-only computed it: the prompt's prefill gives token 0, a
            # width-1 pass over token i - 1 gives token i.
            history = inputs[name] + reference[:index]
            session = ModelSession(loaded.model, loaded.context_length)
            session.append(history[:-1] if index else history)
            session.prefill()
            row = session.logits(1)[0]
            if index:
                session.append(history[-1:])
                row = session.logits(1)[0]
            row = row.float()
            session.release()
            ours, theirs = row[reference[index]].item(), row[run.token_ids[index]].item()
            step = spacing(max(abs(ours), abs(theirs)), loaded.model.dtype)
            lines.append(
                f"- {name}, {method}: token {index}: target-only {reference[index]} (logit {ours:.4g}), "
                f"this run {run.token_ids[index]} (logit {theirs:.4g}); gap {ours - theirs:.3g} = "
                f"{(ours - theirs) / step:.1f} {str(loaded.model.dtype).removeprefix('torch.')} steps; "
                f"the pass's argmax {int(row.argmax())}"
            )
    finally:
        del loaded
        free_memory()
    if len(mismatches) > limit:
        lines.append(f"- and {len(mismatches) - limit} more differing outputs")
    return lines


def spacing(value: float, dtype: torch.dtype) -> float:
    """The distance between adjacent numbers of dtype around value."""
    exponent = math.floor(math.log2(value)) if value > 0 else -126
    return 2.0 ** (exponent - MANTISSA_BITS.get(dtype, 23))


if __name__ == "__main__":
    sys.exit(main())
