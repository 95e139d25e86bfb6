"""How long a client's stream stalls when the serving worker dies mid-generation.

    .venv/bin/python -m benchmarks.bench_failover [--kills 3]
    .venv/bin/python -m benchmarks.bench_failover --sessions 16 --model smollm2   # under load

Under load (--sessions N): a real redis-server, 1 orchestrator, 2 target workers
(SmolLM2-135M fp32, one torch thread each) and an n-gram draft worker; references first
(every prompt at k=0, undisturbed), then N sessions stream at k=4 together and, once
every stream has --kill-after tokens, the target serving the most of them is SIGKILLed.
Reports every session's output against its reference, the longest gap any stream sees
after the kill (its first chunk after the kill counts from its last before it), the
median of each stream's longest gap after the kill, and the median gap of all streams
before the kill.

Starts a real redis-server, 1 orchestrator, 2 target and 2 draft workers (tiny fp32
models, the "model" drafter so that rounds take a while), places a session, streams a
200-token continuation and SIGKILLs the worker holding the session (draft, then target,
alternately) after the 10th token; measures the largest gap between chunks after the
kill against the median gap of the stream, checks the output against an undisturbed
run, and restarts the killed worker for the next kill. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import statistics
import time
from dataclasses import dataclass, field

from benchmarks.bench_load import LOAD_PROMPTS
from service_common.server import channel
from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2_grpc
from tests.redis_server import RedisServer
from tests.system import LocalSystem

PROMPT = [5, 17, 99, 3, 42, 8]


def _request(ids, session_id="", max_new_tokens=200):
    request = orchestrator_pb2.GenerateRequest(session_id=session_id, include_stats=True)
    request.token_ids.ids.extend(ids)
    request.sampling.max_new_tokens = max_new_tokens
    request.speculation.num_speculative_tokens = 4
    request.speculation.drafter = "model"
    return request


def _stream(system, request, victim: str | None):
    """(tokens, gaps in s with the token count before each, index of the kill, stats)."""
    tokens, gaps, killed_at, stats = [], [], None, None
    last = time.perf_counter()
    for chunk in system.stub.GenerateStream(request, timeout=120):
        now = time.perf_counter()
        gaps.append((now - last, len(tokens)))
        last = now
        tokens.extend(chunk.token_ids)
        if victim and killed_at is None and len(tokens) >= 10:
            os.kill(system.process(victim).pid, signal.SIGKILL)
            killed_at = len(tokens)
        if chunk.HasField("stats"):
            stats = chunk.stats
    return tokens, gaps, killed_at, stats


# Under load: the target of each --model (the n-gram drafter needs no draft model).
LOAD_MODELS = {"smollm2": "smollm2-135m", "tiny": "tiny-random:1"}


@dataclass
class Stream:
    """One session's stream: its chunks' arrival times and tokens."""

    prompt: str
    session_id: str = ""
    times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    failovers: int = 0
    error: str = ""

    def longest_gap_after(self, at: float) -> float:
        """The longest wait for a chunk after `at`, the first counted from the last chunk before it."""
        before = [t for t in self.times if t <= at]
        after = [t for t in self.times if t > at]
        edges = before[-1:] + after
        return max((b - a for a, b in zip(edges, edges[1:])), default=0.0)

    def gaps_before(self, at: float) -> list[float]:
        before = [t for t in self.times if t <= at]
        return [b - a for a, b in zip(before, before[1:])]


def _load_request(
    model: str, text: str, k: int, max_new_tokens: int
) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(include_stats=True)
    if model == "tiny":  # a byte tokenizer, no chat template
        request.text = text
    else:
        request.chat.messages.add(role="user", content=text)
    request.sampling.CopyFrom(
        common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    )
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=k, drafter="ngram")
    )
    return request


def _run_stream(stub, request, stream: Stream) -> Stream:
    try:
        for chunk in stub.GenerateStream(request, timeout=600):
            stream.session_id = stream.session_id or chunk.session_id
            if chunk.token_ids:
                stream.times.append(time.perf_counter())
                stream.token_ids.extend(chunk.token_ids)
            if chunk.HasField("stats"):
                stream.failovers = chunk.stats.num_failovers
    except Exception as error:  # noqa: BLE001 - reported in the table, never hidden
        stream.error = str(error)
    return stream


def _references(stub, args, prompts: list[str]) -> dict[str, list[int]]:
    """Each prompt's output at k=0, the sessions concurrent (batching keeps greedy output exact)."""
    distinct = sorted(set(prompts))
    with concurrent.futures.ThreadPoolExecutor(len(distinct)) as pool:
        streams = list(
            pool.map(
                lambda text: _run_stream(
                    stub, _load_request(args.model, text, 0, args.max_new_tokens), Stream(text)
                ),
                distinct,
            )
        )
    for stream in streams:
        if stream.error:
            raise SystemExit(f"reference failed: {stream.error}")
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=stream.session_id), timeout=30)
    return {stream.prompt: stream.token_ids for stream in streams}


def _kill_busiest_target(system, streams: list[Stream], args) -> tuple[float, str, int]:
    """Once every stream has kill_after tokens (or ended), SIGKILLs the target running
    the most calls; returns when, its name and how many calls it ran."""
    while any(
        len(s.token_ids) < args.kill_after and not s.error and not _ended(s, args) for s in streams
    ):
        time.sleep(0.01)
    running = {}
    for role in (r for r in system.roles if r.pool == "target"):
        with channel(role.address, None) as target:
            info = target_pb2_grpc.TargetServiceStub(target).Info(
                common_pb2.InfoRequest(), timeout=10
            )
        running[role.name] = info.load.running_calls
    victim = max(running, key=running.get)
    os.kill(system.process(victim).pid, signal.SIGKILL)
    return time.perf_counter(), victim, running[victim]


def _ended(stream: Stream, args) -> bool:
    return len(stream.token_ids) >= args.max_new_tokens


def under_load(args) -> None:
    prompts = [list(LOAD_PROMPTS.values())[i % len(LOAD_PROMPTS)] for i in range(args.sessions)]
    redis_server = RedisServer().start()
    try:
        with LocalSystem(
            target_model=LOAD_MODELS[args.model],
            draft_model="",
            redis_url=redis_server.url,
            target_workers=2,
            draft_workers=1,
            heartbeat_s=0.5,
            heartbeat_ttl_s=2.0,
            threads=args.threads,
            log_dir=args.log_dir,
        ) as system:
            time.sleep(2)  # both targets registered and seen
            references = _references(system.stub, args, prompts)
            streams = [Stream(text) for text in prompts]
            with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
                futures = [
                    pool.submit(
                        _run_stream,
                        system.stub,
                        _load_request(args.model, s.prompt, 4, args.max_new_tokens),
                        s,
                    )
                    for s in streams
                ]
                killed_s, victim, held = _kill_busiest_target(system, streams, args)
                concurrent.futures.wait(futures)
            logs = system.logs()
    finally:
        redis_server.cleanup()
    _report(streams, references, killed_s, victim, held)
    if any(s.error or s.token_ids != references[s.prompt] for s in streams):
        print(logs)
        raise SystemExit(1)


def _report(
    streams: list[Stream], references: dict[str, list[int]], killed_s: float, victim: str, held: int
) -> None:
    longest = [s.longest_gap_after(killed_s) for s in streams]
    before = [g for s in streams for g in s.gaps_before(killed_s)]
    exact = sum(1 for s in streams if not s.error and s.token_ids == references[s.prompt])
    failed_over = [g for s, g in zip(streams, longest) if s.failovers]
    print(
        "| sessions | killed | its sessions | failed over | exact | longest gap after the kill (s) "
        "| median longest gap (s) | longest gap, failed-over / stayed (s) | median gap before (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    stayed = [g for s, g in zip(streams, longest) if not s.failovers]
    print(
        f"| {len(streams)} | {victim} | {held} | {len(failed_over)} | {exact}/{len(streams)} | {max(longest):.2f} "
        f"| {statistics.median(longest):.2f} | {max(failed_over, default=0):.2f} / {max(stayed, default=0):.2f} "
        f"| {statistics.median(before) * 1e3:.0f} |"
    )
    for s in streams:
        if s.error or s.token_ids != references[s.prompt]:
            print(f"session {s.session_id}: {s.error or 'output differs from its reference'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_failover", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--kills", type=int, default=4, help="kills, one at a time (without --sessions)"
    )
    parser.add_argument(
        "--sessions", type=int, default=0, help="N concurrent sessions, one target killed (0: off)"
    )
    parser.add_argument(
        "--model", choices=sorted(LOAD_MODELS), default="smollm2", help="the target, under load"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--kill-after", type=int, default=32, help="tokens every stream has when the kill comes"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--log-dir", default=None, help="the processes' logs (default: a new temporary folder)"
    )
    args = parser.parse_args(argv)
    if args.sessions:
        under_load(args)
    else:
        one_at_a_time(args.kills)


def one_at_a_time(kills: int) -> None:
    redis_server = RedisServer().start()
    rows = []
    try:
        with LocalSystem(
            redis_url=redis_server.url,
            target_workers=2,
            draft_workers=2,
            heartbeat_s=0.5,
            heartbeat_ttl_s=2.0,
        ) as system:
            time.sleep(2)
            for index in range(kills):
                pool = ("draft", "target")[index % 2]
                first = system.stub.Generate(_request(PROMPT[:3], max_new_tokens=2), timeout=30)
                session = system.stub.GetSession(
                    orchestrator_pb2.GetSessionRequest(session_id=first.session_id)
                )
                victim = system.role(
                    (session.draft if pool == "draft" else session.target).worker_address
                ).name
                # The undisturbed run of the same continuation, on a fresh session.
                fresh = system.stub.Generate(_request(PROMPT[:3], max_new_tokens=2), timeout=30)
                expected, _, _, _ = _stream(system, _request(PROMPT[3:], fresh.session_id), None)
                tokens, gaps, killed_at, stats = _stream(
                    system, _request(PROMPT[3:], first.session_id), victim
                )
                stall = max(g for g, count in gaps if count >= killed_at)
                median = statistics.median(g for g, _ in gaps)
                rows.append(
                    (
                        pool,
                        killed_at,
                        stall * 1e3,
                        median * 1e3,
                        stats.num_failovers,
                        tokens == expected,
                    )
                )
                system.restart(victim)
                time.sleep(2)
    finally:
        redis_server.cleanup()
    print(
        "| killed | after token | largest gap after the kill (ms) | median gap (ms) | failovers "
        "| output equals undisturbed |"
    )
    print("|---|---|---|---|---|---|")
    for pool, at, stall, median, failovers, equal in rows:
        print(
            f"| {pool} | {at} | {stall:.0f} | {median:.0f} | {failovers} | {'yes' if equal else 'NO'} |"
        )


if __name__ == "__main__":
    main()
