"""Cold start: each role from process start to SERVING, the first request's time to
first token, and `make run` from command to printed completion; first start (an empty
model cache) and second starts (the cache filled).

    .venv/bin/python -m benchmarks startup [--repeats 3] [--model smollm2-135m] [--no-make-run]
                                           [--code DIR]

Each start runs in a model cache of its own (a temporary SPECULATIVE_MODEL_CACHE, empty
for the first start, then kept). A role's time is from just before its process is
started to the first SERVING of its health service, polled every 20 ms on a fresh
channel; roles are started one at a time (a 2-core machine: roles started together
share it). The first request is a GenerateStream of the `make run` prompt through the
orchestrator (n-gram drafter, k = 4) once every role serves. The orchestrator's memory
is read from /proc (VmRSS), and whether it mapped torch from /proc/PID/maps.
`--code DIR` runs the roles from another checkout (e.g. a `git worktree` of an older
commit) with this virtualenv, and the launcher's `make run` command line instead of
`make run` (whose set-up would build a virtualenv there). Appends a section to --out.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import RESULTS, request, section, write_results
from launcher.cluster import free_port
from specdec.v1 import orchestrator_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
PROMPT = (
    "Summarize in one sentence: The city council met on Monday to discuss the new park. The council "
    "approved the park's budget and chose a site near the river."
)  # the Makefile's
POLL_S = 0.02
TIMEOUT_S = 900.0
BARS = {
    "target": 10.0,
    "orchestrator": 3.0,
    "make run": 25.0,
}  # seconds, second start (the issue's)


@dataclass
class Start:
    cache: str  # "empty" or "filled"
    ready_s: dict[str, float] = field(default_factory=dict)  # role -> process start to SERVING
    ttft_s: float = 0.0  # first request: call to first token
    first_call_s: float = 0.0  # first request: call to its last chunk
    orchestrator_rss_mb: float = 0.0
    target_rss_mb: float = 0.0
    orchestrator_torch: bool = False


def _serving(address: str) -> bool:
    # A fresh channel per look: no reconnect backoff between looks.
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _start(
    module: str, args: list[str], log: Path, code: Path = REPO
) -> tuple[subprocess.Popen, float]:
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=code,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    return process, started


def _wait_serving(
    name: str, address: str, process: subprocess.Popen, started: float, log: Path
) -> float:
    while not _serving(address):
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() - started > TIMEOUT_S:
            raise SystemExit(f"{name} not serving after {TIMEOUT_S:.0f} s; see {log}")
        time.sleep(POLL_S)
    return time.monotonic() - started


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _first_request(address: str) -> tuple[float, float]:
    with grpc.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        start, first = time.monotonic(), None
        for chunk in stub.GenerateStream(request(PROMPT, 96, 4, "ngram"), timeout=TIMEOUT_S):
            if first is None and chunk.token_ids:
                first = time.monotonic() - start
        return first or 0.0, time.monotonic() - start


def one_start(model: str, cache: Path, logs: Path, label: str, code: Path = REPO) -> Start:
    """Target, draft (n-gram), orchestrator one after another, then the first request."""
    os.environ["SPECULATIVE_MODEL_CACHE"] = str(cache)
    result = Start("empty" if not any(cache.glob("converted/*")) else "filled")
    target, draft, orchestrator = (f"127.0.0.1:{free_port()}" for _ in range(3))
    roles = [
        ("target", "target_service", ["--model", model, "--address", target]),
        (
            "draft",
            "draft_service",
            ["--model", "", "--default-drafter", "ngram", "--address", draft],
        ),
        (
            "orchestrator",
            "orchestrator",
            ["--address", orchestrator, "--target-addresses", target, "--draft-addresses", draft],
        ),
    ]
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name, module, args in roles:
            log = logs / f"{label}-{name}.log"
            processes[name], started = _start(module, args, log, code)
            result.ready_s[name] = _wait_serving(
                name, args[args.index("--address") + 1], processes[name], started, log
            )
        result.ttft_s, result.first_call_s = _first_request(orchestrator)
        result.orchestrator_rss_mb = _rss_mb(processes["orchestrator"].pid)
        result.target_rss_mb = _rss_mb(processes["target"].pid)
        result.orchestrator_torch = _maps_torch(processes["orchestrator"].pid)
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    return result


def make_run(cache: Path, code: Path = REPO) -> tuple[float, float] | None:
    """`make run`, command to exit (it prints the completion last), and when the launcher
    said it was ready; None when its port is taken."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", 50050))
        except OSError:
            return None
    command = (
        ["make", "run"]
        if code == REPO
        else [
            sys.executable,
            "-m",
            "launcher",
            "--prompt",
            PROMPT,
            "--",
            "--drafter",
            "ngram",
            "--k",
            "4",
            "--max-new-tokens",
            "96",
        ]
    )  # what `make run` runs, without its set-up
    started = time.monotonic()
    run = subprocess.run(
        command,
        cwd=code,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "SPECULATIVE_MODEL_CACHE": str(cache)},
    )
    if run.returncode != 0:
        raise SystemExit(f"make run failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    ready = re.search(r"ready in (\d+) s", run.stderr)
    return time.monotonic() - started, float(ready.group(1)) if ready else 0.0


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


def startup_lines(
    starts: list[Start], make_runs: dict[str, list[tuple[float, float]]], args, load: str
) -> list[str]:
    firsts = [s for s in starts if s.cache == "empty"]
    seconds = [s for s in starts if s.cache == "filled"]
    lines = section(
        "Cold start",
        "startup",
        args.argv,
        f"Model: {args.model} (fp32, default threads). Load average (1, 5, 15 min) at the "
        f"start: {load}; at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}."
        + (f" Code: {args.code}." if args.code else ""),
    )
    lines += [
        "Seconds, process start to SERVING on the health service (roles started one at a time), the first "
        "request's time to first token and whole call (chat prompt of `make run`, n-gram drafter, k = 4, 96 "
        "tokens), and `make run` from command to printed completion (in brackets: when the launcher said "
        "it was ready, whole seconds). First start: an empty model cache "
        f"(the target converts the GGUF file); second starts: the cache filled, median of {len(seconds)}.",
        "",
        "| start | target | draft (n-gram) | orchestrator | first token | first call | make run |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, group, runs in (
        ("first (cache empty)", firsts, make_runs["empty"]),
        ("second (cache filled)", seconds, make_runs["filled"]),
    ):
        if not group:
            continue
        cells = [
            _median([s.ready_s[r] for s in group]) for r in ("target", "draft", "orchestrator")
        ]
        cells += [
            _median([s.ttft_s for s in group]),
            _median([s.first_call_s for s in group]),
            f"{_median([r[0] for r in runs])} ({_median([r[1] for r in runs])})",
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if seconds:
        lines += [
            "",
            "Every second start: "
            + "; ".join(
                f"target {s.ready_s['target']:.1f}, orchestrator {s.ready_s['orchestrator']:.1f}, "
                f"first token {s.ttft_s:.2f}"
                for s in seconds
            )
            + ".",
        ]
        bars = {
            "target": statistics.median(s.ready_s["target"] for s in seconds),
            "orchestrator": statistics.median(s.ready_s["orchestrator"] for s in seconds),
        }
        if make_runs["filled"]:
            bars["make run"] = statistics.median(r[0] for r in make_runs["filled"])
        lines += [
            "",
            "Bars (second start): "
            + "; ".join(
                f"{name} {value:.1f} s (at most {BARS[name]:.0f} s: {'met' if value <= BARS[name] else 'NOT met'})"
                for name, value in bars.items()
            )
            + ".",
        ]
    return [
        *lines,
        "",
        f"Orchestrator: {_median([s.orchestrator_rss_mb for s in starts])} MB resident after "
        f"the first request (target: {_median([s.target_rss_mb for s in starts])} MB); torch "
        f"mapped in its process: {'yes' if any(s.orchestrator_torch for s in starts) else 'no'}.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks startup", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3, help="second starts")
    parser.add_argument("--no-make-run", action="store_true", help="do not time `make run`")
    parser.add_argument(
        "--code", default="", help="run the roles from this checkout (default: this one)"
    )
    parser.add_argument("--out", default=str(RESULTS / "startup.md"))
    args = parser.parse_args(argv)
    args.argv = argv
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    code = Path(args.code).resolve() if args.code else REPO
    starts, make_runs = [], {"empty": [], "filled": []}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as scratch:
        logs = Path(scratch) / "logs"
        logs.mkdir()
        cache = Path(scratch) / "cache"
        for index in range(1 + args.repeats):
            starts.append(one_start(args.model, cache, logs, f"start{index}", code))
            print(starts[-1], file=sys.stderr)
        if not args.no_make_run:
            for label, run_cache in (
                ("empty", Path(scratch) / "make-cache"),
                ("filled", Path(scratch) / "make-cache"),
                ("filled", Path(scratch) / "make-cache"),
            ):
                timed = make_run(run_cache, code)
                if timed is not None:
                    make_runs[label].append(timed)
                print(f"make run ({label} cache): {timed}", file=sys.stderr)
    write_results(args.out, startup_lines(starts, make_runs, args, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
