"""A GPU check in one command: pass width, draft quantization, speculative speedup.

    python -m benchmarks gpu [--out DIR]      # on a CUDA machine, about 5-7 minutes
    python -m benchmarks gpu --smoke          # the same steps on a CPU, tiny sizes, fp32
    (or python -m benchmarks.gpu_check ...)

Nothing is downloaded: the models are `random:SHAPE:SEED` (model_runtime/tiny.py), random
weights with the real sizes of Qwen2.5 7B (the target) and 1.5B (a draft), bf16 on CUDA,
with the byte tokenizer: a pass's time depends on the shape, not on the values. In this
order (a time budget, --budget-s, drops the optional parts last):

1. a step's time over 512 cached tokens at 1-16 new tokens and for 4 and 16 sessions
   (forward_segments, the step scheduler's path), eager (old) against fixed-shape passes
   replayed as CUDA graphs (model_runtime/static_passes.py, new), for the target and both
   draft shapes, beside the HBM bound (the weights' bytes over a measured device copy);
   then target-only through the services with `--static-passes off` and `on`;
6. row invariance: the row check and step cost in process, off and on; through the
   services with `--row-invariant off` and `on`, target-only, k=4 and adaptive for 1 and
   8 sessions at once, every output against single-session target-only;
7. speed at a known acceptance: the benchmark-only replay drafter (replay_drafter.py) at
   acceptance 0.6, 0.8, 0.9 with a 0.5B-shaped draft's cost, k=4 and adaptive, through
   the services, against Leviathan's bound at the costs measured in process;
2. a draft's time per token (width-1 passes) per quantization scheme
   (model_runtime/quantization.py), with its greedy agreement with the unquantized model
   (teacher-forced: what a quantized self-draft can accept); a failing scheme is a row
   with its error; the 7B's rows after the first services run, as time allows;
3. tokens/s through the services (`--device cuda --dtype bfloat16`), target-only against
   k=4 and adaptive k<=8, with a `self` draft (the target's weights, same seed)
   unquantized, then 4. quantized with step 2's fastest scheme, as time allows. Every
   output against target-only's, token for token. bf16 rounds a row's logits to
   0.4-0.8%, and the top two of 151936 random logits can be closer: a batched and a
   width-1 pass can then pick different tokens, so a differing output is reported with
   both tokens' logits in bf16 steps (a tie or one step: rounding; more: a bug);
5. the same with the target sharded over the GPUs here (`--tensor-parallel N`, the most
   that divide its heads; one GPU: not run), against steps 3's target-only too.

The report is rewritten to DIR/gpu[_smoke].partial.md after each step (a run cut short
leaves what it measured), then appended to DIR/gpu[_smoke].md (DIR: benchmarks/results;
a temporary folder with --smoke).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to fetch: fail at once if something tries

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import Run, round_order  # noqa: E402
from benchmarks.prompts import PROMPTS  # noqa: E402
from benchmarks.replay_drafter import NAME, write_replay  # noqa: E402
from model_runtime import quantization, static_passes, tiny  # noqa: E402
from model_runtime.batched_forward import Segment, forward_segments  # noqa: E402
from model_runtime.loading import LoadedModel, load_model  # noqa: E402
from model_runtime.model_session import ModelSession  # noqa: E402
from speculative.drafters import ModelDrafter  # noqa: E402
from speculative.estimator import leviathan_speedup  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402

SCHEMES = ("none", "int8-dynamic", "int8-weight-only", "int4-weight-only", "fp8")
FIXED_K = 4
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
BASE = "target-only (k=0)"
METHODS = {  # name -> (num_speculative_tokens, adaptive)
    BASE: (0, False),
    f"k={FIXED_K}": (FIXED_K, False),
    f"adaptive k<={common.ADAPTIVE_MAX_K}": (common.ADAPTIVE_MAX_K, True),
}
WIDTHS, SESSIONS = (1, 2, 4, 8, 16), (4, 16)  # step 1's shapes
CHAIN = 8  # step 1: draft tokens a proposal, greedy, as a draft worker drafts them
INVARIANCE_SESSIONS = (1, 8)  # step 6: sessions at once through the services
ACCEPTANCES = (0.6, 0.8, 0.9)  # step 7
TITLES = {
    1: "Passes: eager (old) against fixed-shape passes as CUDA graphs (new), beside the HBM bound",
    2: "Draft time per token by quantization",
    3: "End to end: self-draft unquantized",
    4: "End to end: self-draft quantized {scheme}",
    5: "End to end: the target over {ranks} devices (tensor parallel), self-draft unquantized",
    6: "Row invariance: rows differing, step cost, outputs against target-only",
    7: "Speed at a known acceptance: the replay drafter (benchmarks only) against Leviathan's "
    "bound",
}


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the GPU's by default."""

    target: str = "random:qwen2.5-7b:0"
    draft: str = "random:qwen2.5-1.5b:0"  # step 2's
    device: str = "cuda"
    dtype: str = "bfloat16"
    prefix: int = 512  # cached tokens under the width passes
    repeats: int = 20  # timed passes per width
    decode_tokens: int = 32  # timed width-1 passes per quantization scheme
    prompt_tokens: int = 128  # prompt length, step 2 and 3
    prompts: int = 3  # prompts, step 3
    max_new_tokens: int = 64
    e2e_repeats: int = 3  # interleaved rounds over the methods, per prompt
    budget_s: float = 450.0  # the whole run; optional parts are skipped to stay within it
    threads: int = 0  # torch threads per service process (0: torch's default)
    startup_timeout_s: float = 180.0
    call_timeout_s: float = 60.0  # one Generate call
    # Seconds an optional part is expected to take at most: it starts only with this left.
    target_schemes_s: float = 100.0
    quantized_e2e_s: float = 150.0
    tensor_parallel_s: float = 150.0
    devices: int = 0  # ranks step 5 may use (0: the GPUs this machine has)
    replay_draft: str = "random:qwen2.5-0.5b:0"  # step 7's draft model: the replay drafter's cost


GPU = Plan()
SMOKE = Plan(
    target="random:qwen2-tiny:0",
    draft="random:qwen2-tiny:1",
    device="cpu",
    dtype="float32",
    prefix=32,
    repeats=3,
    decode_tokens=8,
    prompt_tokens=24,
    prompts=1,
    max_new_tokens=12,
    e2e_repeats=1,
    budget_s=480.0,
    threads=1,
    startup_timeout_s=120.0,
    target_schemes_s=10.0,
    quantized_e2e_s=40.0,
    tensor_parallel_s=40.0,
    devices=2,
    replay_draft="random:qwen2-tiny:1",
)


@dataclass
class Report:
    """What the run measured so far, as markdown sections in the order of the steps."""

    path: Path  # rewritten after each step
    header: list[str] = field(default_factory=list)
    sections: dict[int, list[str]] = field(default_factory=dict)
    runs: dict[int, dict] = field(default_factory=dict)  # an end-to-end step's runs, by step

    def set(self, step: int, lines: list[str]) -> None:
        self.sections[step] = lines
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.lines()) + "\n")

    def lines(self) -> list[str]:
        return [
            *self.header,
            *(line for s in sorted(self.sections) for line in ["", *self.sections[s]]),
        ]


class Budget:
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
        prog="python -m benchmarks gpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default="", help="directory of gpu.md (default: results/)")
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
    out = Path(
        args.out or (tempfile.mkdtemp(prefix="gpu-check-") if args.smoke else common.RESULTS)
    )
    out /= "gpu_smoke.md" if args.smoke else "gpu.md"
    clock = Budget(plan.budget_s)
    report = Report(out.with_suffix(".partial.md"), header(plan, argv))
    run_steps(plan, report, clock)
    report.header.append(
        f"Run time: {clock.elapsed():.0f} s (budget {plan.budget_s:.0f} s: optional parts start "
        "only with their time left)."
    )
    common.write_results(out, report.lines())
    report.path.unlink(missing_ok=True)
    log(f"appended to {out}")
    return 0


def run_steps(plan: Plan, report: Report, clock: Budget) -> None:
    timings: dict[str, dict[str, SchemeRow]] = {}
    guarded(report, 1, TITLES[1], lambda: step_passes(plan, report, clock))
    guarded(report, 6, TITLES[6], lambda: step_invariance(plan, report, clock))
    for step, run in (
        (7, lambda: step_replay(plan, report)),
        (2, lambda: step_schemes(plan, report, timings, [plan.draft], clock)),
        (3, lambda: step_e2e(plan, report, 3, quantization.NONE, clock)),
    ):
        if clock.left() < plan.quantized_e2e_s:  # the budget holds the check to its minutes
            skipped(report, step, TITLES[step].format(scheme="", ranks=""), clock)
        else:
            guarded(report, step, TITLES[step], run)
    if clock.left() >= plan.target_schemes_s:
        models = [plan.draft, plan.target]
        guarded(report, 2, TITLES[2], lambda: step_schemes(plan, report, timings, models, clock))
    else:
        note(report, 2, f"The target's rows ({plan.target}): skipped, {clock.left():.0f} s left.")
    scheme = fastest_quantized(timings, plan)
    title = TITLES[4].format(scheme=scheme or "")
    if scheme is None:
        report.set(4, [f"### 4. {title}", "", "Skipped: no quantization scheme ran in step 2."])
    elif clock.left() < plan.quantized_e2e_s:
        skipped(report, 4, title, clock, plan.quantized_e2e_s)
    else:
        guarded(report, 4, title, lambda: step_e2e(plan, report, 4, scheme, clock))
    ranks = shardable_ranks(plan)
    title = TITLES[5].format(ranks=ranks)
    if ranks < 2:
        here = plan.devices or torch.cuda.device_count()
        why = f"Not run: {here} GPU(s) here; tensor parallelism needs 2 or more (one: step 3)."
        report.set(5, [f"### 5. {title}", "", why])
    elif clock.left() < plan.tensor_parallel_s:
        skipped(report, 5, title, clock, plan.tensor_parallel_s)
    else:
        guarded(report, 5, title, lambda: step_e2e(plan, report, 5, "none", clock, ranks))


def skipped(report: Report, step: int, title: str, clock: Budget, needed: float = 0.0) -> None:
    need = f", {needed:.0f} s needed" if needed else ""
    report.set(
        step,
        [f"### {step}. {title}", "", f"Skipped: {clock.left():.0f} s of the budget left{need}."],
    )


def off_and_on(
    plan: Plan, report: Report, step: int, lines: list[str], clock: Budget, services, render
):
    """A step's services part: `services(plan, mode)` with its setting off and on,
    rendered below the step's `lines`; skipped when the budget cannot hold it."""
    if clock.left() < plan.quantized_e2e_s:
        note(report, step, f"Services part skipped: {clock.left():.0f} s of the budget left.")
        return
    results = {mode: services(plan, mode) for mode in ("off", "on")}
    report.set(step, [*lines, *render(plan, results)])


def guarded(report: Report, step: int, title: str, run) -> None:
    """Runs one step; an error becomes the step's section rather than the run's end."""
    log(f"step {step}: {title}")
    try:
        run()
    except Exception as error:  # noqa: BLE001 - reported, and the next step still runs
        note(report, step, f"**Failed**: {describe_error(error)}", f"### {step}. {title}")
        log(f"step {step} failed: {describe_error(error)}")


def note(report: Report, step: int, text: str, title: str = "") -> None:
    report.set(step, [*(report.sections.get(step) or [title]), "", text])


def describe_error(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:300]}"


def header(plan: Plan, argv: list[str] | None) -> list[str]:
    if plan.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        device = (
            f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB, compute capability "
            f"{properties.major}.{properties.minor}), CUDA {torch.version.cuda}"
        )
    else:
        device = "no GPU: smoke run on the CPU"
    try:
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = "not installed"
    return common.section(
        "GPU check: pass width, draft quantization, speculative speedup",
        "gpu",
        argv,
        f"Device: {device}; torchao {torchao}; commit {_commit()}; "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}. Models: target `{plan.target}`, draft "
        f"`{plan.draft}` (random weights with the real sizes, model_runtime/tiny.py: a pass's "
        f"time depends on the shape), {plan.dtype} on {plan.device}.",
    )[:-1]


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=common.REPO,
        )
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- timing --------------------------------------------------------------------------------


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


def timed_ms(plan: Plan, step, untimed: int = 3, setup=lambda repeat: repeat) -> float:
    """The median ms of plan.repeats calls of step(setup(repeat)) after `untimed`,
    synchronised around each; setup runs untimed."""
    samples = []
    for repeat in range(plan.repeats + untimed):
        value = setup(repeat)
        synchronize(plan.device)
        start = time.perf_counter()
        step(value)
        synchronize(plan.device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[untimed:])


# --- 1. passes -----------------------------------------------------------------------------


def step_passes(plan: Plan, report: Report, clock: Budget) -> None:
    bandwidth = copy_bandwidth(plan)
    shapes = [f"w={w}" for w in WIDTHS] + [f"s={s}, w=1" for s in SESSIONS]
    lines = [
        f"### 1. {TITLES[1]}",
        "",
        f"Copy bandwidth measured here: {bandwidth / 1e9:.0f} GB/s. One step of w new tokens for "
        f"each of s sessions over {plan.prefix} cached tokens (forward_segments, the workers' "
        f"path), median of {plan.repeats} after 3 untimed, synchronised; in brackets, the bound "
        "over the time (1.00 = at the bound). New: `--static-passes on` (CUDA graphs on a GPU; "
        "eager fixed shapes on a CPU).",
        "",
        "| model | path | bound | " + " | ".join(shapes) + f" | drafting, a token of {CHAIN} |",
        "|---" * (4 + len(shapes)) + "|",
    ]
    report.set(1, lines)
    for name in dict.fromkeys((plan.target, plan.replay_draft, plan.draft)):
        lines += model_rows(plan, name, bandwidth)
        report.set(1, lines)
    off_and_on(plan, report, 1, lines, clock, passes_services, passes_lines)


def copy_bandwidth(plan: Plan) -> float:
    """Bytes a second a device copy reads and writes (the HBM's usable bandwidth)."""
    size = (1 << 30) if plan.device == "cuda" else (1 << 26)
    source = torch.empty(size, dtype=torch.uint8, device=plan.device)
    target = torch.empty_like(source)
    ms = timed_ms(replace(plan, repeats=5), lambda _: target.copy_(source), untimed=1)
    return 2 * size / (ms / 1e3)


def model_rows(plan: Plan, name: str, bandwidth: float) -> list[str]:
    loaded = load_model(name, device=plan.device, dtype=plan.dtype)
    rows = []
    try:
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        bound_ms = weight_bytes / bandwidth * 1e3
        for path in ("old (eager)", "new (static)"):
            failure = ""
            if path.startswith("new"):
                passes = static_passes.install(
                    loaded.model, static_passes.ON, max(SESSIONS), plan.prefix + 32
                )
                failure = f" ({passes.failure})" if passes.failure else ""
            timed = step_times(loaded, plan)
            cells = [f"{ms:.2f} ms ({bound_ms / ms:.2f})" for ms in timed]
            cells.append(f"{draft_ms_per_token(loaded, plan):.2f} ms")
            rows.append(
                f"| `{name}` | {path}{failure} | {bound_ms:.2f} ms | " + " | ".join(cells) + " |"
            )
            log(f"  {name} {path}: " + ", ".join(f"{ms:.2f}" for ms in timed))
    finally:
        del loaded
        free_memory()
    return rows


def step_times(loaded: LoadedModel, plan: Plan) -> list[float]:
    """ms of a step at each of WIDTHS for one session, then of SESSIONS sessions at w=1."""
    sessions = []
    for index in range(max(SESSIONS)):
        session = ModelSession(loaded.model, loaded.context_length)
        session.append(random_ids(plan.prefix + 1, loaded.vocab_size, seed=index))
        session.prefill()
        session.truncate_to(plan.prefix)
        sessions.append(session)

    def segments(count: int, width: int):
        return lambda repeat: [
            Segment(s._kv, plan.prefix, random_ids(width, loaded.vocab_size, repeat), width)
            for s in sessions[:count]
        ]

    def step(built: list[Segment]) -> None:
        forward_segments(loaded.model, built)

    shapes = [(1, w) for w in WIDTHS] + [(s, 1) for s in SESSIONS]
    result = [timed_ms(plan, step, setup=segments(count, width)) for count, width in shapes]
    for session in sessions:
        session.release()
    return result


def draft_ms_per_token(loaded: LoadedModel, plan: Plan) -> float:
    """A greedy proposal of CHAIN tokens as a draft worker drafts it (the new path: one
    chain on the device where passes are CUDA graphs), in ms a token."""
    session = ModelDrafter(loaded).open(
        random_ids(plan.prefix, loaded.vocab_size, seed=5), SamplingParams()
    )
    session.prefill()
    base = session.length

    def again(_) -> None:
        session.truncate_to(base)  # each proposal drafts the same positions again

    ms = timed_ms(plan, lambda _: session.propose(CHAIN), setup=again) / CHAIN
    session.release()
    return ms


def passes_services(plan: Plan, mode: str) -> float:
    """Target-only tokens/s through the services (median over prompts), both workers
    with `--static-passes mode`."""
    flags = ["--static-passes", mode]
    rates = []
    with gpu_system(plan, target_flags=flags, draft_flags=flags) as stub:
        for ids in prompts(plan).values():
            timed_call(stub, ids, BASE, plan)  # warm-up: the graphs of this prompt's shapes
            repeats = [timed_call(stub, ids, BASE, plan) for _ in range(plan.e2e_repeats)]
            rates.append(statistics.median(r.tokens_per_s for r in repeats))
    return statistics.median(rates)


def passes_lines(plan: Plan, rates: dict[str, float]) -> list[str]:
    return [
        "",
        f"Through the services, target-only (`Generate` with k=0, {plan.max_new_tokens} new "
        f"tokens, median over prompts of the median of {plan.e2e_repeats}): old path "
        f"(`--static-passes off`) {rates['off']:.1f} tok/s, new (`on`) {rates['on']:.1f} tok/s: "
        f"{rates['on'] / rates['off']:.2f}x.",
    ]


# --- 2. quantization -----------------------------------------------------------------------


@dataclass
class SchemeRow:
    ms_per_token: float | None = None
    agreement: float | None = None  # share of positions with the unquantized model's greedy token
    error: str = ""
    load_s: float = 0.0


def greedy_passes(
    loaded: LoadedModel, plan: Plan, forced: list[int] | None
) -> tuple[list[float], list[int]]:
    """Width-1 passes after a plan.prompt_tokens prompt: seconds per pass and the greedy
    token of each; with `forced`, those tokens are appended instead (teacher forcing)."""
    session = ModelSession(loaded.model, loaded.context_length)
    session.append(random_ids(plan.prompt_tokens, tiny.TINY_VOCAB_SIZE, seed=2))
    session.prefill()
    seconds, chosen = [], []
    for index in range(plan.decode_tokens + 3):  # 3 untimed
        synchronize(plan.device)
        start = time.perf_counter()
        picked = int(session.logits(1)[0].argmax())
        synchronize(plan.device)
        if index >= 3:
            seconds.append(time.perf_counter() - start)
        chosen.append(picked)
        session.append([picked if forced is None else forced[index]])
    session.release()
    return seconds, chosen


def step_schemes(plan: Plan, report: Report, timings: dict, models: list[str], clock: Budget):
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
                seconds, chosen = greedy_passes(loaded, plan, reference)
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
        f"### 2. {TITLES[2]}",
        "",
        f"Width-1 passes after a {plan.prompt_tokens}-token prompt, median of "
        f"{plan.decode_tokens} after 3 untimed (synchronised around each), quantized by "
        "`load_model(..., quantize=SCHEME)` (model_runtime/quantization.py; on CUDA through "
        "torchao), output layer quantized too. Agreement: the share of positions where the "
        "quantized model's greedy token is the unquantized model's (teacher-forced on the "
        "unquantized model's tokens): what a quantized self-draft can accept.",
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


# --- 3-5. end to end -----------------------------------------------------------------------


def prompts(plan: Plan) -> dict[str, list[int]]:
    """Byte-tokenized prompts of plan.prompt_tokens tokens (text repeated to length)."""
    tokenizer = tiny.byte_tokenizer()
    chosen = {}
    for name, text in list(PROMPTS.items())[: plan.prompts]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        chosen[name] = (ids * (plan.prompt_tokens // len(ids) + 1))[: plan.prompt_tokens]
    return chosen


def timed_call(stub, ids: list[int], method: str, plan: Plan, drafter: str = "model") -> Run:
    """One greedy Generate call of a METHODS' method, timed by the client."""
    k, adaptive = METHODS[method]
    made = common.request(ids, plan.max_new_tokens, k, drafter, adaptive)
    return common.generate(stub, made, plan.call_timeout_s)


def gpu_system(plan: Plan, target_flags=(), draft_flags=(), **options):
    """The services on plan's device and precision, a `self` draft unless told otherwise."""
    device = ["--device", plan.device, "--dtype", plan.dtype]
    settings = dict(draft_model="self", draft_quantization="none", drafter="model") | options
    return common.services(
        {"target": [*device, *target_flags], "draft": [*device, *draft_flags]},
        target_model=plan.target,
        threads=plan.threads,
        startup_timeout=plan.startup_timeout_s,
        **settings,
    )


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


def step_e2e(plan: Plan, report: Report, step: int, scheme: str, clock: Budget, ranks: int = 1):
    title = f"### {step}. {TITLES[step].format(scheme=scheme, ranks=ranks)}"
    inputs = prompts(plan)
    start = time.monotonic()
    with gpu_system(plan, draft_quantization=scheme, tensor_parallel=ranks) as stub:
        started_s = time.monotonic() - start
        log(f"  services serving after {started_s:.0f} s")
        for method in METHODS:  # warm-up: first sessions, the adaptive policy's first estimates
            timed_call(stub, next(iter(inputs.values())), method, plan)
        runs: dict[str, dict[str, list[Run]]] = {}
        for name, ids in inputs.items():
            runs[name] = {method: [] for method in METHODS}
            for repeat in range(plan.e2e_repeats):
                for method in round_order(list(METHODS), repeat):
                    runs[name][method].append(timed_call(stub, ids, method, plan))
            log(
                f"  {name}: "
                + ", ".join(f"{m} {median_rate(r):.1f} tok/s" for m, r in runs[name].items())
            )
    report.runs[step] = runs
    lines = e2e_lines(plan, title, runs, started_s, scheme)
    if ranks > 1:
        lines += single_process_lines(report, runs)
    report.set(step, lines)
    mismatches = [
        (name, method, run)
        for name, by_method in runs.items()
        for method, method_runs in by_method.items()
        for run in method_runs
        if run.token_ids != by_method[BASE][0].token_ids
    ]
    if mismatches:
        report.set(step, [*lines, *diagnose(plan, inputs, runs, mismatches, clock)])


def single_process_lines(report: Report, runs: dict[str, dict[str, list[Run]]]) -> list[str]:
    """The sharded target's target-only output and speed against step 3's single process."""
    single = report.runs.get(3)
    if not single:
        return ["", "Step 3 did not run: nothing to compare with the single-process target."]
    equal = sum(runs[name][BASE][0].token_ids == single[name][BASE][0].token_ids for name in runs)
    speeds = [median_rate(runs[name][BASE]) / median_rate(single[name][BASE]) for name in runs]
    return [
        "",
        f"Against step 3's single-process target: {equal} of {len(runs)} target-only outputs "
        f"equal token for token; target-only tokens/s {statistics.geometric_mean(speeds):.2f}x "
        "the single process's (geometric mean; the steps ran minutes apart).",
    ]


def median_rate(runs: list[Run]) -> float:
    return statistics.median(run.tokens_per_s for run in runs)


def e2e_lines(plan: Plan, title: str, runs: dict, started_s: float, scheme: str) -> list[str]:
    methods = list(METHODS)
    lines = [
        title,
        "",
        f"Target `{plan.target}` and draft `self` (`--draft-model self --draft-quantization "
        f"{scheme}`: the same model and seed in the draft worker) as local processes, "
        f"`--device {plan.device} --dtype {plan.dtype}`, serving {started_s:.0f} s after start. "
        f"Greedy, {plan.max_new_tokens} new tokens from {plan.prompt_tokens}-token prompts "
        f"(token ids), `Generate` timed by the client, median of {plan.e2e_repeats} interleaved "
        "rounds after a warm-up; in brackets over target-only; acceptance from the calls' "
        "statistics (-: nothing drafted, the adaptive policy let the target decode alone).",
        "",
        "| prompt | " + " | ".join(methods) + " | acceptance " + " / ".join(methods[1:]) + " |",
        "|---" * (len(methods) + 2) + "|",
    ]
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    for name, by_method in runs.items():
        base = median_rate(by_method[BASE])
        cells = []
        for method in methods:
            rate = median_rate(by_method[method])
            ratios[method].append(rate / base)
            cells.append(f"{rate:.1f} tok/s ({rate / base:.2f}x)")
        acceptance = " / ".join(_acceptance(by_method[m]) for m in methods[1:])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {acceptance} |")
    if len(runs) > 1:
        means = (f"{statistics.geometric_mean(ratios[m]):.2f}x" for m in methods)
        lines.append("| geometric mean | " + " | ".join(means) + " | |")
    every = [(r, by[BASE][0]) for by in runs.values() for rs in by.values() for r in rs]
    equal = sum(run.token_ids == reference.token_ids for run, reference in every)
    verdict = (
        "every output equals" if equal == len(every) else f"**{len(every) - equal} differ from**"
    )
    lines += [
        "",
        f"Exactness: {equal} of {len(every)} outputs (all methods, all rounds) equal "
        f"target-only's first output of their prompt token for token: {verdict} target-only.",
    ]
    return lines


def _acceptance(runs: list[Run]) -> str:
    rates = [run.acceptance for run in runs if run.acceptance is not None]
    return f"{statistics.fmean(rates):.0%}" if rates else "-"


def diagnose(
    plan: Plan, inputs: dict, runs, mismatches, clock: Budget, limit: int = 3
) -> list[str]:
    """For the first differing outputs: the target's own logits (in process, same seed,
    a width-1 pass as target-only's) of both tokens at the first difference."""
    lines = ["", "First differences (the target in process, width-1 pass, as target-only):", ""]
    if clock.left() < 30:
        return [*lines, f"not examined: {clock.left():.0f} s of the budget left"]
    loaded = load_model(plan.target, device=plan.device, dtype=plan.dtype)
    try:
        for name, method, run in mismatches[:limit]:
            reference = runs[name][BASE][0].token_ids
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
            # As target-only computed it: the prompt's prefill gives token 0, a width-1
            # pass over token i - 1 gives token i.
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
                f"- {name}, {method}: token {index}: target-only {reference[index]} (logit "
                f"{ours:.4g}), this run {run.token_ids[index]} (logit {theirs:.4g}); gap "
                f"{ours - theirs:.3g} = {(ours - theirs) / step:.1f} "
                f"{str(loaded.model.dtype).removeprefix('torch.')} steps; the pass's argmax "
                f"{int(row.argmax())}"
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


# --- 6. row invariance ---------------------------------------------------------------------


def step_invariance(plan: Plan, report: Report, clock: Budget) -> None:
    models = {}
    for mode in ("off", "on"):
        log(f"  loading {plan.target}, row invariance {mode}")
        models[mode] = load_model(
            plan.target, device=plan.device, dtype=plan.dtype, row_invariant=mode
        )
    try:
        vocab = models["off"].vocab_size
        checks = {mode: common.row_check(m.model, vocab, prefixes=8) for mode, m in models.items()}
        timed = common.step_costs(
            {mode: loaded.model for mode, loaded in models.items()},
            vocab,
            plan.repeats,
            synchronize=lambda: synchronize(plan.device),
        )
        describe = models["on"].row_invariance.describe()
    finally:
        models.clear()
        free_memory()
    lines = [f"### 6. {TITLES[6]}", "", f"Invariant linears chosen here: {describe}.", ""]
    lines += common.invariance_lines(8, plan.repeats, checks, timed)
    report.set(6, lines)
    off_and_on(plan, report, 6, lines, clock, invariance_services, invariance_service_lines)


def invariance_services(plan: Plan, mode: str) -> dict:
    """{sessions: {method: (outputs equal to target-only, outputs, aggregate tok/s)}}."""
    ids = next(iter(prompts(plan).values()))
    variants = [ids[i % len(ids) :] + ids[: i % len(ids)] for i in range(max(INVARIANCE_SESSIONS))]
    result: dict[int, dict] = {}
    with gpu_system(plan, target_flags=["--row-invariant", mode]) as stub:
        references = [timed_call(stub, v, BASE, plan).token_ids for v in variants]
        for sessions in INVARIANCE_SESSIONS:
            result[sessions] = {}
            for method in METHODS:
                with ThreadPoolExecutor(sessions) as pool:
                    start = time.perf_counter()
                    runs = list(
                        pool.map(
                            lambda v, m=method: timed_call(stub, v, m, plan), variants[:sessions]
                        )
                    )
                    seconds = time.perf_counter() - start
                equal = sum(r.token_ids == ref for r, ref in zip(runs, references))
                tokens = sum(len(r.token_ids) for r in runs)
                result[sessions][method] = (equal, len(runs), tokens / seconds)
            log(f"  invariance {mode}, {sessions} sessions: {result[sessions]}")
    return result


def invariance_service_lines(plan: Plan, results: dict) -> list[str]:
    lines = [
        "",
        f"Through the services (`--device {plan.device} --dtype {plan.dtype}`, self-draft, "
        f"greedy, {plan.max_new_tokens} new tokens; sessions at once from rotations of one "
        "prompt; each output against the single-session target-only output of its prompt):",
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
    counts = ", ".join(f"invariance {mode}: {count}" for mode, count in differing.items())
    return [*lines, "", f"Outputs differing from target-only: {counts}."]


# --- 7. a known acceptance -----------------------------------------------------------------


def step_replay(plan: Plan, report: Report) -> None:
    """Random weights make acceptance meaningless: the draft worker runs a 0.5B-shaped
    draft model for its cost and proposes the target's own recorded greedy tokens,
    replaced at rate 1 - acceptance. The bound: tokens a round expects at acceptance a,
    (1 - a^(k+1)) / (1 - a), over k draft passes and one verification, against a
    target-only pass per token, at the passes' costs measured in process (Leviathan et
    al. 2023, eq. 1)."""
    costs = measured_costs(plan)
    lines = [
        f"### 7. {TITLES[7]}",
        "",
        "**Every number here uses the benchmark-only replay drafter.**",
        "",
        f"Measured in process: target pass {costs['target_1']:.2f} ms at 1 new token, "
        f"{costs['target_k']:.2f} ms at {FIXED_K + 1}; draft `{plan.replay_draft}` "
        f"{costs['draft']:.2f} ms a token ({costs['draft'] / costs['target_1']:.2f} of a "
        "target pass).",
        "",
    ]
    report.set(7, lines)
    report.set(7, [*lines, *replay_lines(replay_services(plan), costs)])


def measured_costs(plan: Plan) -> dict[str, float]:
    """ms of a target pass at 1 and FIXED_K + 1 new tokens, and of a draft pass at 1."""
    costs = {}
    for name, widths in (
        (plan.target, {"target_1": 1, "target_k": FIXED_K + 1}),
        (plan.replay_draft, {"draft": 1}),
    ):
        loaded = load_model(name, device=plan.device, dtype=plan.dtype)
        try:
            costs |= {key: pass_ms(loaded, plan, width) for key, width in widths.items()}
        finally:
            del loaded
            free_memory()
    return costs


def pass_ms(loaded: LoadedModel, plan: Plan, width: int) -> float:
    session = ModelSession(loaded.model, loaded.context_length)
    session.append(random_ids(plan.prompt_tokens + 1, loaded.vocab_size, seed=3))
    session.prefill()
    session.truncate_to(plan.prompt_tokens)

    def append(repeat: int) -> None:
        session.truncate_to(plan.prompt_tokens)
        session.append(random_ids(width, loaded.vocab_size, seed=repeat))

    ms = timed_ms(plan, lambda _: session.logits(width), setup=append)
    session.release()
    return ms


def replay_services(plan: Plan) -> dict:
    """{acceptance: {method: (speedup, equal, total, acceptance measured)}}, with the
    target-only tok/s under key 0.0."""
    replay_file = str(Path(tempfile.mkdtemp(prefix="gpu-replay-")) / "replay.json")
    plugin = ["--drafter-plugin", f"benchmarks.replay_drafter:drafters:{replay_file}"]
    inputs = prompts(plan)
    with gpu_system(plan, draft_flags=plugin, draft_model=plan.replay_draft) as stub:
        references = {name: timed_call(stub, ids, BASE, plan, NAME) for name, ids in inputs.items()}
        recorded = [inputs[name] + r.token_ids for name, r in references.items()]
        results: dict = {0.0: statistics.median(r.tokens_per_s for r in references.values())}
        for acceptance in ACCEPTANCES:
            write_replay(replay_file, acceptance, recorded)
            results[acceptance] = {}
            for method in list(METHODS)[1:]:
                runs = {
                    name: timed_call(stub, ids, method, plan, NAME) for name, ids in inputs.items()
                }
                equal = sum(runs[name].token_ids == references[name].token_ids for name in runs)
                rates = [runs[name].tokens_per_s / references[name].tokens_per_s for name in runs]
                measured = [r.acceptance for r in runs.values() if r.acceptance is not None]
                results[acceptance][method] = (
                    statistics.geometric_mean(rates),
                    equal,
                    len(runs),
                    statistics.fmean(measured) if measured else None,
                )
            log(f"  replay acceptance {acceptance}: {results[acceptance]}")
    return results


def replay_lines(results: dict, costs: dict[str, float]) -> list[str]:
    lines = [
        f"Through the services, target-only: {results[0.0]:.1f} tok/s (median over prompts). "
        "Speedup over it (geometric mean over prompts), outputs equal to target-only's, the "
        "calls' measured acceptance (accepted over drafted: a chain stops at its first replaced "
        "token), and the bound:",
        "",
        "| acceptance | method | speedup | bound at k=4 | equal outputs | measured acceptance |",
        "|---|---|---|---|---|---|",
    ]
    for acceptance in ACCEPTANCES:
        bound = leviathan_speedup(
            acceptance, FIXED_K, costs["draft"], costs["target_1"], costs["target_k"]
        )
        for method, (speedup, equal, total, measured) in results[acceptance].items():
            shown = "-" if measured is None else f"{measured:.2f}"
            lines.append(
                f"| {acceptance} | {method} | {speedup:.2f}x | {bound:.2f}x | {equal} of {total} "
                f"| {shown} |"
            )
    return lines


if __name__ == "__main__":
    sys.exit(main())
