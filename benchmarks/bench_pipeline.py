"""Pipelined vs synchronous drafting on emulated separate hardware.

    .venv/bin/python -m benchmarks.bench_pipeline                    # SmolLM2-135M + n-gram, +0/5/20 ms
    .venv/bin/python -m benchmarks.bench_pipeline --pair qwen \\
        --prompts chat,code_edit --max-new-tokens 32 --delays 0,20    # Qwen2.5-Coder 0.5B -> 1.5B

Method. The target worker is pinned to CPU 1, everything else (two draft workers, two
orchestrators, the delay proxy, this client) to CPU 0, one torch thread per worker: the
draft and the target can truly overlap, as on two machines. Per one-way delay (a
delaying TCP proxy in front of the target; every path to it crosses the proxy) one
system runs: one target; a draft worker with pipelining (`--pipeline`) behind
orchestrator P and one without (`--disable pipeline`) behind orchestrator S. Methods,
interleaved per prompt and rotated per repeat: target-only (`k=0` through S: the
target's Decode stream), and for each drafter adaptive k <= 4 synchronous (S) and
pipelined (P). Greedy, chat template, new session per request; every output must equal
the prompt's target-only output (mismatches are counted and fail the run).

Per method and prompt: tokens/s (median of repeats) and its ratio to target-only, and the
paired noise (each repeat's ratio to that repeat's target-only; target-only's own
spread over the repeats); per method: the share of each call's decoding time the draft and the target each idle
(1 - draft time / wall, 1 - target compute / wall, from GenerationStats), per round.
Writes results_pipeline_<pair>.md and runs_pipeline_<pair>.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from benchmarks.bench_load import LOAD_PROMPTS, Method, build_request
from benchmarks.bench_load import Pair as LoadPair
from benchmarks.prompts import PROMPTS
from launcher.cluster import Cluster, free_port
from specdec.v1 import orchestrator_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
ALL_PROMPTS = {**PROMPTS, **{f"load_{name}": text for name, text in LOAD_PROMPTS.items()}}
DRAFT_CPU, TARGET_CPU = 0, 1


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str  # "" = n-gram only
    drafters: tuple[str, ...]
    chat: bool = True  # chat messages (False: raw text, for a model without a chat template)


PAIRS = {
    "smollm2": Pair("smollm2-135m", "", ("ngram",)),
    "qwen": Pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", ("model", "ngram+model")),
    "tiny": Pair(
        "tiny-random:1", "tiny-random:1", ("model", "ngram"), chat=False
    ),  # checks the script
}


@dataclass
class Run:
    delay_ms: float
    prompt: str
    method: str
    repeat: int
    tokens: int
    decode_s: float  # the call's wall time less its prefill
    rounds: int
    draft_s: float
    target_s: float
    exact: bool = True

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


def pin(pid: int, cpu: int) -> None:
    """Pins every thread of a process (and the threads it starts later) to one CPU."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except ProcessLookupError:
            pass


# Draft workers by name, each behind its own orchestrator: their flags.
PIPELINED_AND_SYNC = {"P": ["--disable", ""], "S": ["--disable", "pipeline"]}


class PinnedSystem:
    """target (CPU 1) behind a delay proxy; per variant a draft worker with its flags and
    an orchestrator (CPU 0): by default P (pipelined) and S (synchronous)."""

    def __init__(
        self,
        pair: Pair,
        delay_ms: float,
        log_dir: Path,
        threads: int = 1,
        variants: dict[str, list[str]] = PIPELINED_AND_SYNC,
    ):
        self.cluster = Cluster(log_dir)
        target, proxy = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.roles = [
            (
                "target",
                "target_service",
                [
                    "--model",
                    pair.target,
                    "--address",
                    target,
                    "--threads",
                    str(threads),
                    "--advertise-address",
                    proxy,
                ],
                target,
                TARGET_CPU,
            )
        ]
        self.roles.append(
            (
                "proxy",
                "launcher.delay_proxy",
                ["--listen", proxy, "--upstream", target, "--delay-ms", str(delay_ms)],
                None,
                DRAFT_CPU,
            )
        )
        self.orchestrators = {}
        for name, flags in variants.items():
            draft, orchestrator = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            self.roles.append(
                (
                    f"draft-{name}",
                    "draft_service",
                    ["--model", pair.draft, "--address", draft, "--threads", str(threads), *flags],
                    draft,
                    DRAFT_CPU,
                )
            )
            self.roles.append(
                (
                    f"orchestrator-{name}",
                    "orchestrator",
                    [
                        "--address",
                        orchestrator,
                        "--target-addresses",
                        proxy,
                        "--draft-addresses",
                        draft,
                    ],
                    orchestrator,
                    DRAFT_CPU,
                )
            )
            self.orchestrators[name] = orchestrator

    def __enter__(self) -> dict[str, orchestrator_pb2_grpc.OrchestratorStub]:
        os.sched_setaffinity(0, {DRAFT_CPU})
        for name, module, args, address, cpu in self.roles:
            self.cluster.start(name, module, args)
            pin(self.cluster.processes[-1][1].pid, cpu)
            if address is not None and not name.startswith("orchestrator"):
                self.cluster.wait_healthy(name, address, 1800.0)
                pin(self.cluster.processes[-1][1].pid, cpu)
        for name, _, _, address, _ in self.roles:
            if name.startswith("orchestrator"):
                self.cluster.wait_healthy(name, address, 1800.0)
        for (_, process), (_, _, _, _, cpu) in zip(self.cluster.processes, self.roles):
            pin(process.pid, cpu)  # threads started since
        self.channels = {n: grpc.insecure_channel(a) for n, a in self.orchestrators.items()}
        return {n: orchestrator_pb2_grpc.OrchestratorStub(c) for n, c in self.channels.items()}

    def __exit__(self, *exc):
        for channel in self.channels.values():
            channel.close()
        self.cluster.stop()


def generate(stub, pair: Pair, text: str, max_new_tokens: int, k: int, drafter: str):
    """(tokens, stats) of one greedy call on a new session (adaptive k <= k; k = 0: target-only)."""
    request = build_request(
        LoadPair(pair.target, pair.draft, (), pair.chat),
        Method("", k, adaptive=k > 0),
        text,
        max_new_tokens,
    )
    request.speculation.drafter = drafter
    response = stub.Generate(request, timeout=3600)
    return list(response.token_ids), response.stats


def methods(pair: Pair) -> list[tuple[str, str, int, str]]:
    """(name, orchestrator, k, drafter)."""
    out = [("target-only", "S", 0, "")]
    for drafter in pair.drafters:
        out += [(f"sync {drafter}", "S", 4, drafter), (f"pipelined {drafter}", "P", 4, drafter)]
    return out


def measure(pair: Pair, delay_ms: float, prompts: list[str], args) -> list[Run]:
    runs = []
    with PinnedSystem(pair, delay_ms, Path(tempfile.mkdtemp(prefix="bench-pipeline-"))) as stubs:
        table = methods(pair)
        for _, orchestrator, k, drafter in table:  # warm-up
            generate(stubs[orchestrator], pair, "Hello!", 8, k, drafter)
        for prompt in prompts:
            outputs = []  # (run, tokens)
            for repeat in range(args.repeats):
                turn = repeat % len(table)
                order = table[turn:] + table[:turn]
                for name, orchestrator, k, drafter in order if repeat % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    tokens, stats = generate(
                        stubs[orchestrator],
                        pair,
                        ALL_PROMPTS[prompt],
                        args.max_new_tokens,
                        k,
                        drafter,
                    )
                    wall = time.perf_counter() - start
                    run = Run(
                        delay_ms,
                        prompt,
                        name,
                        repeat,
                        len(tokens),
                        max(1e-9, wall - stats.prefill_ns * 1e-9),
                        stats.num_rounds,
                        stats.draft_ns * 1e-9,
                        stats.target_compute_ns * 1e-9,
                    )
                    outputs.append((run, tokens))
                    print(
                        f"+{delay_ms:g} ms {prompt:>14} {name:>22} #{repeat}: {run.tokens_per_s:6.2f} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
            reference = next(tokens for run, tokens in outputs if run.method == "target-only")
            for run, tokens in outputs:
                run.exact = tokens == reference
                runs.append(run)
    return runs


def report(pair_name: str, runs: list[Run], args, command: str) -> str:
    lines = [
        f"# Pipelined vs synchronous drafting, {pair_name} (pinned: draft CPU 0, target CPU 1)",
        "",
        f"Command: `{command}`",
        "",
        "Tokens/s per prompt (median of repeats), and ratio to target-only "
        "of the same delay; idle: share of decoding time the side waited, per call, mean.",
        "",
    ]
    for delay in sorted({r.delay_ms for r in runs}):
        at = [r for r in runs if r.delay_ms == delay]
        names = list(dict.fromkeys(r.method for r in at))
        prompts = list(dict.fromkeys(r.prompt for r in at))
        lines += [
            f"## +{delay:g} ms one way",
            "",
            "| prompt | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        medians = {
            (p, m): statistics.median(r.tokens_per_s for r in at if r.prompt == p and r.method == m)
            for p in prompts
            for m in names
        }
        for p in prompts:
            base = medians[(p, "target-only")]
            cells = [f"{medians[(p, m)]:.2f} ({medians[(p, m)] / base:.2f}x)" for m in names]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| method | geomean vs target-only | draft idle | target idle |",
            "|---|---|---|---|",
        ]
        for m in names:
            ratios = [medians[(p, m)] / medians[(p, "target-only")] for p in prompts]
            geomean = statistics.geometric_mean(ratios)
            mine = [r for r in at if r.method == m]
            draft_idle = (
                statistics.mean(1 - r.draft_s / r.decode_s for r in mine)
                if m != "target-only"
                else float("nan")
            )
            target_idle = statistics.mean(max(0.0, 1 - r.target_s / r.decode_s) for r in mine)
            lines.append(f"| {m} | {geomean:.2f}x | {draft_idle:.0%} | {target_idle:.0%} |")
        lines += [
            "",
            "Paired noise: each method against target-only of the same repeat (lowest-highest), and",
            "target-only's own spread over the repeats ((max - min) / median).",
            "",
            "| prompt | target-only spread | " + " | ".join(names[1:]) + " |",
            "|---|---|" + "---|" * (len(names) - 1),
        ]
        for p in prompts:
            lines.append(
                f"| {p} | {_spread(at, p):.0%} | "
                + " | ".join(_paired(at, p, m) for m in names[1:])
                + " |"
            )
        for drafter in PAIRS[pair_name].drafters:
            sync = [medians[(p, f"sync {drafter}")] for p in prompts]
            piped = [medians[(p, f"pipelined {drafter}")] for p in prompts]
            lines.append(
                f"\npipelined / sync ({drafter}): geomean "
                f"{statistics.geometric_mean([a / b for a, b in zip(piped, sync)]):.2f}x"
            )
        lines.append("")
    mismatches = [r for r in runs if not r.exact]
    lines.append(
        f"Outputs that differ from the prompt's target-only output: {len(mismatches)} of {len(runs)}."
    )
    return "\n".join(lines) + "\n"


def _spread(runs: list[Run], prompt: str) -> float:
    """Target-only's tokens/s over the repeats of one prompt: (max - min) / median."""
    rates = [r.tokens_per_s for r in runs if r.prompt == prompt and r.method == "target-only"]
    return (max(rates) - min(rates)) / statistics.median(rates)


def _paired(runs: list[Run], prompt: str, method: str) -> str:
    """A method's tokens/s over target-only's of the same repeat: lowest-highest."""
    base = {
        r.repeat: r.tokens_per_s for r in runs if r.prompt == prompt and r.method == "target-only"
    }
    ratios = sorted(
        r.tokens_per_s / base[r.repeat] for r in runs if r.prompt == prompt and r.method == method
    )
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_pipeline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--delays", default="0,5,20", help="one-way delays in ms, comma-separated")
    parser.add_argument("--prompts", default="chat,code_new,code_edit,summary,explain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 CPUs: the draft side on one, the target on the other")
    pair = PAIRS[args.pair]
    runs = []
    for delay in [float(d) for d in args.delays.split(",")]:
        runs += measure(pair, delay, args.prompts.split(","), args)
    command = "python -m benchmarks.bench_pipeline " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    text = report(args.pair, runs, args, command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results_pipeline_{args.pair}.md").write_text(text)
    (out / f"runs_pipeline_{args.pair}.json").write_text(
        json.dumps([asdict(r) for r in runs], indent=1)
    )
    print(text)
    return 0 if all(r.exact for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
