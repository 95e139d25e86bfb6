"""The benchmark suite: is speculation paying, in process, through the services, and
under 1, 5 and 20 ms of added network delay between draft and target?

    .venv/bin/python -m benchmarks.bench_suite --pair smollm2 --quick   # checks the script: 2 prompts, 16 tokens
    .venv/bin/python -m benchmarks.bench_suite --pair smollm2           # SmolLM2-135M target, n-gram drafter
    .venv/bin/python -m benchmarks.bench_suite --pair qwen              # Qwen2.5-Coder 0.5B -> 1.5B (an hour)

Phases, each measuring its own baseline, methods interleaved within a prompt (median of
--repeats), greedy:
1. in process, per dtype: target-only (HF `generate`, ours), HF `generate` with
   `prompt_lookup_num_tokens` and, for a pair with a draft model, with `assistant_model`
   (HF's default assistant settings), our generator at fixed k and adaptive k (and,
   with a draft model, adaptive with prompt lookup first: the ngram+model drafter);
2. through the three services (`launcher`), once over loopback and once per added
   one-way delay (`--draft-target-delay-ms`: a delaying TCP proxy in front of the target):
   target-only (`Decode`), fixed k, adaptive k (and ngram+model adaptive); traced to JSON
   lines for `python -m report`.

Ratios: in-process methods against in-process target-only (ours); service methods
against the same system's target-only (`Decode`), so each delay is compared with
target-only decoding measured minutes apart at most; with a draft model, each services
phase is also set beside HF assisted generation from the in-process fp32 phase
(`against_reference`). Writes `results_suite_<pair>.md` (the tables, the command, the
hardware, the report of the traces), every run's tokens and seconds to
`runs_suite_<pair>.json`, and plots under `plots/<pair>/` in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from benchmarks.bench_core import chat_ids
from benchmarks.prompts import PROMPT_SETS, PROMPTS, kind_of, prompt_texts
from launcher.cluster import Cluster, parse_args, start_system
from model_runtime.loading import load_model
from service_common.server import freeze_startup_heap
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK, FixedK
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent
ADAPTIVE_MAX_K = 8
ROLES = ("target", "draft", "orchestrator")


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str  # "" = no draft model: the n-gram drafter
    prompts: tuple[str, ...]
    quantization: str = "none"  # the draft model's (model_runtime/quantization.py)

    @property
    def drafter(self) -> str:
        return "model" if self.draft else "ngram"


PAIRS = {
    "smollm2": Pair("smollm2-135m", "", tuple(PROMPTS)),
    # The 0.5B draft in int8 costs a third of its fp32 self (benchmarks/results_drafts.md).
    "qwen": Pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", tuple(PROMPTS), "int8-dynamic"),
}


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    stats: object = None  # GenerationStats (ours) or its proto (services)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds


# --- methods ------------------------------------------------------------------------------


def _hf(loaded, max_new_tokens, **kwargs):
    def run(ids):
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

    return run


def ours(loaded, drafter, policy, max_new_tokens):
    """A call's runner, in process: `policy()` gives each call's k (0: target-only)."""
    generator = SpeculativeGenerator(loaded, drafter)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(loaded.eos_token_id,))

    def run(ids):
        start = time.perf_counter()
        result = generator.generate(ids, params, k=policy())
        return Run(result.token_ids, time.perf_counter() - start, result.stats)

    return run


def in_process_methods(target, draft, k: int, max_new_tokens: int) -> dict:
    drafter = ModelDrafter(draft) if draft is not None else NgramDrafter()
    methods = {
        "target-only (ours)": ours(target, None, lambda: 0, max_new_tokens),
        "target-only (HF generate)": _hf(target, max_new_tokens),
        f"HF prompt lookup k={k}": _hf(target, max_new_tokens, prompt_lookup_num_tokens=k),
    }
    if draft is not None:
        methods["HF assisted (assistant_model)"] = _hf(
            target, max_new_tokens, assistant_model=draft.model
        )
    methods[f"ours k={k}"] = ours(target, drafter, lambda: FixedK(k), max_new_tokens)
    methods[f"ours adaptive k<={ADAPTIVE_MAX_K}"] = ours(
        target, drafter, lambda: AdaptiveK(ADAPTIVE_MAX_K), max_new_tokens
    )
    if draft is not None:
        methods[f"ours ngram+model adaptive k<={ADAPTIVE_MAX_K}"] = ours(
            target,
            LookupThenModelDrafter(drafter, NgramDrafter()),
            lambda: AdaptiveK(ADAPTIVE_MAX_K),
            max_new_tokens,
        )
    return methods


def service_methods(
    stub, drafter: str, k: int, max_new_tokens: int, fixed_ks: tuple[int, ...] = ()
) -> dict:
    def method(num_speculative_tokens: int, adaptive: bool, drafter: str = drafter):
        def run(text):
            request = orchestrator_pb2.GenerateRequest(include_stats=True)
            request.chat.messages.add(role="user", content=text)
            request.sampling.max_new_tokens = max_new_tokens
            request.speculation.CopyFrom(
                common_pb2.SpeculationParams(
                    num_speculative_tokens=num_speculative_tokens,
                    drafter=drafter,
                    adaptive=adaptive,
                )
            )
            start = time.perf_counter()
            response = stub.Generate(request, timeout=3600)
            elapsed = time.perf_counter() - start
            stub.CloseSession(
                common_pb2.CloseSessionRequest(session_id=response.session_id), timeout=60
            )
            return Run(list(response.token_ids), elapsed, response.stats)

        return run

    methods = {
        "target-only (Decode)": method(0, False),
        **{f"k={fixed}": method(fixed, False) for fixed in sorted({k, *fixed_ks})},
        f"adaptive k<={ADAPTIVE_MAX_K}": method(ADAPTIVE_MAX_K, True),
    }
    if drafter == "model":
        methods[f"ngram+model adaptive k<={ADAPTIVE_MAX_K}"] = method(
            ADAPTIVE_MAX_K, True, "ngram+model"
        )
    return methods


def measure(methods: dict, inputs: dict, repeats: int) -> dict[str, dict[str, list[Run]]]:
    """{prompt: {method: [Run]}}: per prompt, repeats rounds over all methods in turn,
    in the order `round_order` gives (interleaved: drift within a round, and whatever a
    method leaves behind for the next, hit every method alike)."""
    results = {}
    for prompt, value in inputs.items():
        runs = {method: [] for method in methods}
        for repeat in range(repeats):
            for method in round_order(list(methods), repeat):
                runs[method].append(methods[method](value))
        results[prompt] = runs
        print(
            f"  {prompt}: " + ", ".join(f"{m} {_rate(r):.2f} tok/s" for m, r in runs.items()),
            flush=True,
        )
    return results


def service_delays(delays_ms: str, loopback: bool = True) -> list[float]:
    """The services phases' added one-way delays, in ms: loopback (0) first, then the list."""
    return [0.0] * loopback + [float(d) for d in delays_ms.split(",") if d]


def chosen(table: dict, names: str, kept: tuple[str, ...], what: str) -> list[str]:
    """The entries of `table` a `--methods`-like option names (comma-separated; "": all),
    in the table's order, those `kept` always (the ratios' baseline); an unknown name
    stops the run before anything loads."""
    picked = {*kept, *names.split(",")} if names else set(table)
    if unknown := picked - set(table):
        raise SystemExit(f"no such {what} {sorted(unknown)}; there are {list(table)}")
    return [name for name in table if name in picked]


def round_order(names: list[str], repeat: int) -> list[str]:
    """The methods' order in round `repeat`: rotated by repeat // 2, reversed in odd
    rounds. Rotation alone moves each method through every position but keeps who runs
    right after whom (with target-only, k=4, adaptive, adaptive followed k=4 in 4 of 5
    rounds and target-only never did); the reversed rounds give each method each
    predecessor as often (over 6 rounds of 3 methods, every order once)."""
    shift = (repeat // 2) % len(names)
    order = names[shift:] + names[:shift]
    return order[::-1] if repeat % 2 else order


def _rate(runs: list[Run]) -> float:
    return statistics.median(run.tokens_per_s for run in runs)


# --- phases -------------------------------------------------------------------------------


def run_in_process(pair: Pair, dtype: str, args) -> dict:
    print(
        f"in process, {dtype}: loading {pair.target}"
        + (f" and {pair.draft}" if pair.draft else ""),
        flush=True,
    )
    target = load_model(
        pair.target, dtype=dtype, row_invariant="auto"
    )  # as a target worker loads it
    quantize = pair.quantization if dtype == "float32" else "none"  # CPU int8 starts from fp32
    draft = load_model(pair.draft, dtype=dtype, quantize=quantize) if pair.draft else None
    freeze_startup_heap()  # as the services do: no method pays for walking the models in a collection
    try:
        methods = in_process_methods(target, draft, args.k, args.max_new_tokens)
        texts = prompt_texts(pair.prompts, args.prompt_set)
        inputs = {name: chat_ids(target.tokenizer, text) for name, text in texts.items()}
        _warm_up(methods, next(iter(inputs.values())))
        return measure(methods, inputs, args.repeats)
    finally:
        gc.unfreeze()  # the models go with the phase
        del target, draft
        gc.collect()


def run_services(pair: Pair, delay_ms: float, trace_dir: Path, args) -> dict:
    print(
        f"services, {'loopback' if not delay_ms else f'{delay_ms:g} ms added one-way delay'}: starting",
        flush=True,
    )
    system_args = parse_args(["--http-port", "-1"])  # no HTTP front: gRPC clients only
    system_args.target_model = pair.target
    system_args.draft_model = pair.draft
    system_args.drafter = pair.drafter
    system_args.draft_quantization = pair.quantization
    system_args.port, system_args.threads, system_args.startup_timeout = 0, args.threads, 1800.0
    system_args.log_dir = tempfile.mkdtemp(prefix="bench-suite-logs-")
    system_args.draft_target_delay_ms = delay_ms
    cluster = Cluster(Path(system_args.log_dir))
    with _traced_to(trace_dir / f"delay-{delay_ms:g}ms"):
        try:
            channel = grpc.insecure_channel(start_system(system_args, cluster))
            methods = service_methods(
                orchestrator_pb2_grpc.OrchestratorStub(channel),
                pair.drafter,
                args.k,
                args.max_new_tokens,
                fixed_ks(args.fixed_ks),
            )
            inputs = prompt_texts(pair.prompts, args.prompt_set)
            _warm_up(methods, next(iter(inputs.values())))
            results = measure(methods, inputs, args.repeats)
            channel.close()
            return results
        finally:
            cluster.stop()  # the services flush their spans as they stop


@contextlib.contextmanager
def _traced_to(directory: Path):
    """The services started inside write JSON-lines spans to directory/ROLE.jsonl."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [
        f"{role.upper()}_{field}" for role in ROLES for field in ("TRACE_EXPORTER", "TRACE_FILE")
    ]
    saved = {name: os.environ.get(name) for name in names}
    for role in ROLES:
        os.environ[f"{role.upper()}_TRACE_EXPORTER"] = "jsonl"
        os.environ[f"{role.upper()}_TRACE_FILE"] = str(directory / f"{role}.jsonl")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _warm_up(methods: dict, value) -> None:
    """One run of each method (first calls pay one-off costs: allocation, packing)."""
    for run in methods.values():
        run(value)


# --- output -------------------------------------------------------------------------------


def table(title: str, results: dict, baseline: str, reference: str) -> tuple[list[str], dict]:
    """Markdown rows of tok/s and ratios; returns them and {method: [ratio per prompt]}."""
    methods = list(next(iter(results.values())))
    lines = [
        f"### {title}",
        "",
        "| prompt | " + " | ".join(methods) + " | acceptance | runs equal to target-only |",
        "|---" * (len(methods) + 3) + "|",
    ]
    ratios = {m: [] for m in methods}
    for prompt, runs in results.items():
        base = _rate(runs[baseline])
        cells = []
        for method in methods:
            rate = _rate(runs[method])
            ratios[method].append(rate / base)
            cells.append(f"{rate:.2f} tok/s ({rate / base:.2f}x)")
        speculative = [
            m for m in methods if m not in (baseline, reference) and runs[m][0].stats is not None
        ]
        stats = runs[speculative[0]][0].stats if speculative else None
        acceptance = (
            f"{stats.acceptance_rate:.0%}, {stats.num_generated_tokens / max(stats.num_rounds, 1):.2f} tok/round"
            if stats is not None
            else "-"
        )
        equal, total = _equal_runs(runs, reference)
        lines.append(f"| {prompt} | " + " | ".join(cells) + f" | {acceptance} | {equal}/{total} |")
    lines.append("")
    for method in methods:
        lines.append(
            f"- {method}: geometric mean {statistics.geometric_mean(ratios[method]):.2f}x, "
            f"min {min(ratios[method]):.2f}x, max {max(ratios[method]):.2f}x"
            + ("" if method == baseline else _significance(results, method, baseline))
        )
    lines.append("")
    return lines, ratios


HF_ASSISTED = "HF assisted (assistant_model)"


def fixed_ks(text: str) -> tuple[int, ...]:
    return tuple(int(k) for k in text.split(",") if k)


def against_hindsight(title: str, results: dict) -> list[str]:
    """Markdown rows: per prompt, the fixed k that was fastest there in hindsight (median
    tok/s), and each adaptive method over it, with the 95% interval of paired repeats."""
    methods = list(next(iter(results.values())))
    fixed = [m for m in methods if m.startswith("k=")]
    adaptive = [m for m in methods if "adaptive" in m]
    if len(fixed) < 2 or not adaptive:
        return []
    lines = [
        f"### {title}",
        "",
        "| prompt | best fixed k (tok/s) | " + " | ".join(f"{m} / best" for m in adaptive) + " |",
        "|---" * (len(adaptive) + 2) + "|",
    ]
    ratios = {m: [] for m in adaptive}
    for prompt, runs in results.items():
        best = max(fixed, key=lambda m: _rate(runs[m]))
        cells = []
        for name in adaptive:
            ratio = _rate(runs[name]) / _rate(runs[best])
            ratios[name].append(ratio)
            paired = paired_ratio(runs[name], runs[best])
            cells.append(
                f"{ratio:.2f}x" + (f" [{paired[1]:.2f}, {paired[2]:.2f}]" if paired else "")
            )
        lines.append(f"| {prompt} | {best} ({_rate(runs[best]):.2f}) | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [
        f"- {name} over the hindsight-best fixed k: geometric mean {statistics.geometric_mean(values):.2f}x, "
        f"lowest {min(values):.2f}x"
        for name, values in ratios.items()
    ]
    lines.append("")
    return lines + against_kind_best(results, fixed, adaptive)


def against_kind_best(results: dict, fixed: list[str], adaptive: list[str]) -> list[str]:
    """Where there are several prompts of a kind (kind/i): per kind, the fixed k fastest over
    its prompts (geometric mean of their median tok/s) and each adaptive method over it. One
    prompt's hindsight pick also gains from where that path's rejections fall."""
    kinds: dict[str, list[dict]] = {}
    for prompt, runs in results.items():
        kinds.setdefault(kind_of(prompt), []).append(runs)
    if all(len(prompts) == 1 for prompts in kinds.values()):
        return []
    lines = [
        "| kind (prompts) | fixed k fastest for the kind | "
        + " | ".join(f"{m} / it" for m in adaptive)
        + " |",
        "|---" * (len(adaptive) + 2) + "|",
    ]
    for kind, prompts in kinds.items():
        best = max(
            fixed, key=lambda m: statistics.geometric_mean([_rate(runs[m]) for runs in prompts])
        )
        cells = [
            f"{statistics.geometric_mean([_rate(runs[m]) / _rate(runs[best]) for runs in prompts]):.2f}x "
            f"(lowest {min(_rate(runs[m]) / _rate(runs[best]) for runs in prompts):.2f}x)"
            for m in adaptive
        ]
        lines.append(f"| {kind} ({len(prompts)}) | {best} | " + " | ".join(cells) + " |")
    return lines + [""]


def against_reference(
    title: str,
    reference: dict,
    reference_baseline: str,
    services: dict,
    services_baseline: str,
    method: str = HF_ASSISTED,
) -> list[str]:
    """Markdown rows setting each service method beside an in-process reference method
    (HF assisted generation), per prompt, two ways. Raw: tok/s over the reference's tok/s.
    By speedup: each over the target-only of its own phase, so drift between the phases
    (measured tens of minutes apart) cancels; the reference's target-only is HF `generate`,
    the path HF assisted generation takes without an assistant."""
    methods = [m for m in next(iter(services.values())) if m != services_baseline]
    lines = [
        f"### {title}",
        "",
        "| prompt | " + method + " | " + " | ".join(methods) + " |",
        "|---" * (len(methods) + 2) + "|",
    ]
    behind = {m: [] for m in methods}
    for prompt, runs in services.items():
        ref_rate = _rate(reference[prompt][method])
        ref_speedup = ref_rate / _rate(reference[prompt][reference_baseline])
        base_rate = _rate(runs[services_baseline])
        cells = [f"{ref_rate:.2f} tok/s ({ref_speedup:.2f}x)"]
        for name in methods:
            rate = _rate(runs[name])
            raw, by_speedup = rate / ref_rate, rate / base_rate / ref_speedup
            cells.append(f"{raw:.2f}x raw, {by_speedup:.2f}x by speedup")
            if raw < 1.0 or by_speedup < 1.0:
                behind[name].append(f"{prompt} ({raw:.2f}x raw, {by_speedup:.2f}x by speedup)")
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [
        f"- {name}: behind {method} on {', '.join(prompts) if prompts else 'no prompt, either way'}"
        for name, prompts in behind.items()
    ]
    lines.append("")
    return lines


def exactness_line(results: dict) -> str:
    """How many runs of every method equal their prompt's first target-only output."""
    exact = sum(
        run.token_ids == runs["target-only"][0].token_ids
        for runs in results.values()
        for method_runs in runs.values()
        for run in method_runs
    )
    total = sum(len(method_runs) for runs in results.values() for method_runs in runs.values())
    return f"Every output equal to target-only greedy: {exact} of {total} runs."


def paired_ratio(method_runs: list[Run], baseline_runs: list[Run], confidence: float = 0.95):
    """(ratio, low, high) of method / baseline tok/s, each repeat's two runs paired
    (measured in the same round, minutes apart at most): `ratio_interval`. A call's speed
    moves 10-15% from one call to the next on a shared machine: the interval says which
    cells that noise cannot explain."""
    return ratio_interval(
        [m.tokens_per_s / b.tokens_per_s for m, b in zip(method_runs, baseline_runs)], confidence
    )


def ratio_interval(ratios: list[float], confidence: float = 0.95):
    """(ratio, low, high): the geometric mean of paired repeats' ratios and the two-sided
    Student t interval of the mean log ratio at `confidence`. None below two repeats."""
    from scipy import stats  # benchmarks only (the dev extra)

    logs = [math.log(r) for r in ratios]
    if len(logs) < 2:
        return None
    mean, spread = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    half = stats.t.ppf(0.5 + confidence / 2, len(logs) - 1) * spread
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _significance(results: dict, method: str, baseline: str) -> str:
    """The prompts where the method is slower, and faster, than the baseline beyond the
    95% interval of paired repeats."""
    slower, faster = [], []
    for prompt, runs in results.items():
        paired = paired_ratio(runs[method], runs[baseline])
        if paired is None:
            return ""
        ratio, low, high = paired
        cell = f"{prompt} {ratio:.2f}x [{low:.2f}, {high:.2f}]"
        if high < 1.0:
            slower.append(cell)
        elif low > 1.0:
            faster.append(cell)
    return (
        f"; slower than {baseline} beyond the 95% interval of paired repeats: {', '.join(slower) or 'none'}"
        f"; faster: {', '.join(faster) or 'none'}"
    )


def _equal_runs(runs: dict[str, list[Run]], reference: str) -> tuple[int, int]:
    """How many runs, of every method and repeat, output exactly the reference's first
    run's tokens; and how many runs there were."""
    expected = runs[reference][0].token_ids
    every = [run for method_runs in runs.values() for run in method_runs]
    return sum(run.token_ids == expected for run in every), len(every)


def runs_as_json(measured: dict) -> dict:
    """{phase: {prompt: {method: [[tokens, seconds], ...]}}}: every run's size and time,
    so that tables other than the printed ones can be drawn from a run later."""
    return {
        phase: {
            prompt: {
                method: [[len(run.token_ids), round(run.seconds, 4)] for run in runs]
                for method, runs in methods.items()
            }
            for prompt, methods in results.items()
        }
        for phase, results in measured.items()
    }


def plot_ratios(
    path: Path, sections: dict[str, dict[str, list[float]]], prompts: list[str]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        (f"{section}: {method}", values)
        for section, methods in sections.items()
        for method, values in methods.items()
        if not method.startswith("target-only")
    ]
    figure, axes = plt.subplots(figsize=(max(8, len(prompts) * 2.2), 5))
    width = 0.8 / max(len(bars), 1)
    for index, (label, values) in enumerate(bars):
        axes.bar([p + index * width for p in range(len(prompts))], values, width, label=label)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([p + 0.4 - width / 2 for p in range(len(prompts))], prompts)
    axes.set_ylabel("speedup over target-only (same phase)")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import transformers

    return (
        f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}, transformers "
        f"{transformers.__version__}, Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_suite", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 prompts, 16 tokens, 1 repeat, float32, 5 ms only: checks the script",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="fixed k of the speculative methods")
    parser.add_argument(
        "--fixed-ks",
        default="1,2,4,6,8",
        help="more fixed k through the services: adaptive is set beside the best in hindsight",
    )
    parser.add_argument(
        "--draft-quantization",
        default=None,
        help="the draft model's quantization (default: the pair's: int8-dynamic for qwen)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads in process and per worker process"
    )
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="in-process dtypes (services run float32)"
    )
    parser.add_argument(
        "--delays-ms",
        default="1,5,20",
        help="added one-way draft<->target delays, besides loopback",
    )
    parser.add_argument(
        "--in-process-only", action="store_true", help="no services phases (and no trace report)"
    )
    parser.add_argument(
        "--no-loopback",
        action="store_true",
        help="services at the added delays only (loopback measured in an earlier run)",
    )
    parser.add_argument(
        "--prompts", default="", help="comma-separated prompt kinds (default: every kind)"
    )
    parser.add_argument(
        "--prompt-set",
        choices=PROMPT_SETS,
        default="",
        help="more: six other prompts of each kind (benchmarks/prompts.py); all: those and the "
        "default ones; also compared by kind",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="directory for results and plots (default: benchmarks/; "
        "a temporary directory with --quick)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens, args.repeats, args.dtypes, args.delays_ms = 16, 1, "float32", "5"
        args.fixed_ks = "2"  # one more fixed k: the hindsight table runs too
    pair = PAIRS[args.pair]
    if args.draft_quantization is not None:
        pair = dataclasses.replace(pair, quantization=args.draft_quantization)
    if args.quick:  # two prompts with text to copy: the drafts get accepted
        pair = dataclasses.replace(pair, prompts=("code_edit", "summary"))
    if args.prompts:
        pair = dataclasses.replace(pair, prompts=tuple(args.prompts.split(",")))
    out = Path(
        args.out or (tempfile.mkdtemp(prefix="bench-suite-") if args.quick else REPO / "benchmarks")
    )
    plots = out / "plots" / args.pair
    plots.mkdir(parents=True, exist_ok=True)
    trace_dir = Path(tempfile.mkdtemp(prefix="bench-suite-traces-"))
    torch.set_num_threads(args.threads)
    started = time.monotonic()

    lines = [
        f"# Benchmark suite: {pair.target}"
        + (
            f" with draft {pair.draft} ({pair.quantization})"
            if pair.draft
            else " with the n-gram drafter"
        ),
        "",
        f"Command: `python -m benchmarks.bench_suite {shlex.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"Hardware: {hardware()}; {args.threads} torch threads in process and in each worker process "
        f"(draft and target share the cores). Greedy, {args.max_new_tokens} new tokens (fewer when the model "
        f"ends its answer), chat template, median of {args.repeats} interleaved repeats.",
        "",
    ]
    sections, measured = {}, {}
    for dtype in [d for d in args.dtypes.split(",") if d]:  # "" = services only
        results = run_in_process(pair, dtype, args)
        rows, ratios = table(
            f"In process, {dtype} (ratios against target-only, ours)",
            results,
            "target-only (ours)",
            "target-only (ours)",
        )
        lines += rows
        measured[f"in process, {dtype}"] = results
        if dtype == "float32":
            sections["in process"] = {
                m: v for m, v in ratios.items() if m.startswith(("ours", "HF"))
            }
    delays = (
        []
        if args.in_process_only
        else service_delays(args.delays_ms, loopback=not args.no_loopback)
    )
    for delay in delays:
        results = run_services(pair, delay, trace_dir, args)
        label = "loopback" if not delay else f"+{delay:g} ms one-way"
        rows, ratios = table(
            f"Services, float32, {label} (ratios against target-only through the same services)",
            results,
            "target-only (Decode)",
            "target-only (Decode)",
        )
        lines += rows
        measured[f"services, {label}"] = results
        sections[label] = {m: v for m, v in ratios.items() if not m.startswith("target-only")}
        lines += against_hindsight(
            f"Services, {label}: adaptive against the fixed k fastest in hindsight", results
        )
        in_process = measured.get("in process, float32")
        if in_process is not None and HF_ASSISTED in next(iter(in_process.values())):
            lines += against_reference(
                f"Services, float32, {label}, against {HF_ASSISTED} in process, float32 (cell: the {HF_ASSISTED} "
                f"tok/s (its speedup over HF generate); the services' tok/s over it, and their speedup over Decode "
                f"over its speedup)",
                in_process,
                "target-only (HF generate)",
                results,
                "target-only (Decode)",
            )
    if sections:
        plot_ratios(
            plots / "speedups.png", sections, list(prompt_texts(pair.prompts, args.prompt_set))
        )

    traces = sorted(str(p) for p in trace_dir.rglob("*.jsonl"))
    if traces:
        report = subprocess.run(
            [sys.executable, "-m", "report", *traces, "--plots", str(plots)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        lines += [
            "## Report of the services' traces (`python -m report`, all phases together)",
            "",
            "```",
            report.stdout.strip() or report.stderr.strip(),
            "```",
            "",
        ]
    written = ", ".join(f"`{path.name}`" for path in sorted(plots.glob("*.png")))
    lines += [
        f"Plots in `plots/{args.pair}/`: {written or 'none'}. Total time {time.monotonic() - started:.0f} s.",
        "",
    ]
    result_file = out / f"results_suite_{args.pair}.md"
    result_file.write_text("\n".join(lines))
    runs_file = out / f"runs_suite_{args.pair}.json"
    runs_file.write_text(json.dumps(runs_as_json(measured), indent=1))
    print("\n".join(lines))
    print(f"wrote {result_file}, {runs_file} and {plots}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
