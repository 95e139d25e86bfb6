"""Failover: how long a client's stream stalls when the serving worker dies mid-generation.

    .venv/bin/python -m benchmarks failover [--kills 3]
    .venv/bin/python -m benchmarks failover --sessions 16 --pair smollm2   # under load

One at a time (default): a real redis-server, 1 orchestrator, 2 target and 2 draft
workers (tiny fp32 models, the "model" drafter so that rounds take a while); a session
is placed, a 200-token continuation streams and the worker holding the session (draft,
then target, alternately) is SIGKILLed after the 10th token; the largest gap between
chunks after the kill against the median gap of the stream, the output against an
undisturbed run; the killed worker is restarted for the next kill.

Under load (--sessions N): a real redis-server, 1 orchestrator, 2 target workers (the
pair's target, fp32, one torch thread each) and an n-gram draft worker; references first
(every prompt at k=0, undisturbed), then N sessions stream at k=4 together and, once
every stream has --kill-after tokens, the target serving the most of them is SIGKILLed.
Every session's output against its reference, the longest gap any stream sees after the
kill (its first chunk after the kill counted from its last before it), the median of each
stream's longest gap after the kill, and the median gap of all streams before the kill.
Appends a section to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field

from benchmarks.common import PAIRS, RESULTS, request, section, write_results
from benchmarks.prompts import LOAD_PROMPTS
from service_common.server import channel
from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2_grpc
from tests.local_system import LocalSystem
from tests.redis_server import RedisServer

PROMPT = [5, 17, 99, 3, 42, 8]
REGISTRY = dict(heartbeat_s=0.5, heartbeat_ttl_s=2.0, target_workers=2)


@dataclass
class Stream:
    """One session's stream: its chunks' arrival times and tokens."""

    prompt: str | list[int]
    session_id: str = ""
    start: float = 0.0
    times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    failovers: int = 0
    error: str = ""

    def longest_gap_after(self, at: float) -> float:
        """The longest wait for a chunk after `at`, the first counted from the last chunk before it."""
        edges = [t for t in self.times if t <= at][-1:] + [t for t in self.times if t > at]
        return max((b - a for a, b in zip(edges, edges[1:])), default=0.0)

    def gaps_before(self, at: float) -> list[float]:
        before = [self.start, *(t for t in self.times if t <= at)]
        return [b - a for a, b in zip(before, before[1:])]


def run_stream(stub, call, stream: Stream, on_chunk=lambda stream: None) -> Stream:
    """Streams `call` into `stream`; on_chunk(stream) after each chunk with tokens."""
    stream.start = time.perf_counter()
    try:
        for chunk in stub.GenerateStream(call, timeout=600):
            stream.session_id = stream.session_id or chunk.session_id
            if chunk.token_ids:
                stream.times.append(time.perf_counter())
                stream.token_ids.extend(chunk.token_ids)
                on_chunk(stream)
            if chunk.HasField("stats"):
                stream.failovers = chunk.stats.num_failovers
    except Exception as error:  # noqa: BLE001 - reported in the table, never hidden
        stream.error = str(error)
    return stream


def under_load(args) -> list[str]:
    pair = PAIRS[args.pair]
    texts = [list(LOAD_PROMPTS.values())[i % len(LOAD_PROMPTS)] for i in range(args.sessions)]
    redis_server = RedisServer().start()
    try:
        with LocalSystem(
            pair.target,
            "",
            args.log_dir,
            redis_url=redis_server.url,
            threads=args.threads,
            **REGISTRY,
        ) as system:

            def stream(item: Stream, k: int) -> Stream:
                made = request(item.prompt, args.max_new_tokens, k, "ngram", chat=pair.chat)
                return run_stream(system.stub, made, item)

            time.sleep(2)  # both targets registered and seen
            with concurrent.futures.ThreadPoolExecutor(args.sessions) as pool:
                # each prompt at k=0, the sessions concurrent (batching keeps greedy output exact)
                references = list(pool.map(lambda text: stream(Stream(text), 0), set(texts)))
                if failed := [s.error for s in references if s.error]:
                    raise SystemExit(f"reference failed: {failed[0]}")
                for reference in references:
                    close = common_pb2.CloseSessionRequest(session_id=reference.session_id)
                    system.stub.CloseSession(close, timeout=30)
                streams = [Stream(text) for text in texts]
                futures = [pool.submit(stream, s, 4) for s in streams]
                killed_s, victim, held = kill_busiest_target(system, streams, futures, args)
                concurrent.futures.wait(futures)
            logs = system.logs()
    finally:
        redis_server.cleanup()
    expected = {s.prompt: s.token_ids for s in references}
    wrong = [s for s in streams if s.error or s.token_ids != expected[s.prompt]]
    if wrong:
        print(logs)
    longest = [s.longest_gap_after(killed_s) for s in streams]
    before = [g for s in streams for g in s.gaps_before(killed_s)[1:]]
    moved = [g for s, g in zip(streams, longest) if s.failovers]
    stayed = [g for s, g in zip(streams, longest) if not s.failovers]
    return [
        "| sessions | killed | its sessions | failed over | exact | longest gap after the kill "
        "(s) | median longest gap (s) | longest gap, failed-over / stayed (s) | median gap "
        "before (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {len(streams)} | {victim} | {held} | {len(moved)} | {len(streams) - len(wrong)}/"
        f"{len(streams)} | {max(longest):.2f} | {statistics.median(longest):.2f} | "
        f"{max(moved, default=0):.2f} / {max(stayed, default=0):.2f} | "
        f"{statistics.median(before) * 1e3:.0f} |",
        *(f"- session {s.session_id}: {s.error or 'output differs'}" for s in wrong),
    ]


def kill_busiest_target(system, streams: list[Stream], futures, args) -> tuple[float, str, int]:
    """Once every stream has kill_after tokens (or ended), SIGKILLs the target running
    the most calls; returns when, its name and how many calls it ran."""
    while any(
        len(s.token_ids) < args.kill_after and not f.done() for s, f in zip(streams, futures)
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


def one_at_a_time(kills: int) -> list[str]:
    redis_server = RedisServer().start()
    try:
        with LocalSystem(redis_url=redis_server.url, draft_workers=2, **REGISTRY) as system:
            time.sleep(2)
            rows = [kill_one(system, ("draft", "target")[index % 2]) for index in range(kills)]
    finally:
        redis_server.cleanup()
    return [
        "| killed | after token | largest gap after the kill (ms) | median gap (ms) | failovers "
        "| output equals undisturbed |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def kill_one(system, pool: str) -> str:
    """A session's continuation with the worker of `pool` holding it SIGKILLed after the
    10th token, against the same continuation undisturbed; the worker restarted after."""

    def continuation(ids, session_id="", max_new_tokens=200):
        return request(ids, max_new_tokens, 4, "model", session_id=session_id)

    first = system.stub.Generate(continuation(PROMPT[:3], max_new_tokens=2), timeout=30)
    session = system.stub.GetSession(
        orchestrator_pb2.GetSessionRequest(session_id=first.session_id)
    )
    holder = session.draft if pool == "draft" else session.target
    victim = system.role(holder.worker_address).name
    fresh = system.stub.Generate(continuation(PROMPT[:3], max_new_tokens=2), timeout=30)
    expected = run_stream(system.stub, continuation(PROMPT[3:], fresh.session_id), Stream([]))
    killed = []

    def kill(stream: Stream) -> None:
        if not killed and len(stream.token_ids) >= 10:
            os.kill(system.process(victim).pid, signal.SIGKILL)
            killed.append((time.perf_counter(), len(stream.token_ids)))

    got = run_stream(system.stub, continuation(PROMPT[3:], first.session_id), Stream([]), kill)
    stall = got.longest_gap_after(killed[0][0])
    median = statistics.median(got.gaps_before(float("inf")))
    system.restart(victim)
    time.sleep(2)
    equal = "yes" if got.token_ids == expected.token_ids else "NO"
    return (
        f"| {pool} | {killed[0][1]} | {stall * 1e3:.0f} | {median * 1e3:.0f} | {got.failovers} "
        f"| {equal} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks failover", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--kills", type=int, default=4, help="kills, one at a time (without --sessions)"
    )
    parser.add_argument(
        "--sessions", type=int, default=0, help="N concurrent sessions, one target killed (0: off)"
    )
    parser.add_argument("--pair", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--kill-after", type=int, default=32, help="tokens every stream has when the kill comes"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--log-dir", default=None, help="the processes' logs (default: a new one)")
    parser.add_argument("--out", default=str(RESULTS / "failover.md"))
    args = parser.parse_args(argv)
    if args.sessions:
        title = f"Failover under load: {args.sessions} sessions, one of two targets SIGKILLed"
        lines = under_load(args)
    else:
        title, lines = (
            "Failover: the serving worker SIGKILLed mid-stream",
            one_at_a_time(args.kills),
        )
    write_results(args.out, [*section(title, "failover", argv), *lines])
    return 0 if not any("NO |" in line or "output differs" in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
