"""How long a client's stream stalls when the serving worker dies mid-generation.

    .venv/bin/python -m benchmarks.bench_failover [--kills 3]

Starts a real redis-server, 1 orchestrator, 2 target and 2 draft workers (tiny fp32
models, the "model" drafter so that rounds take a while), places a session, streams a
200-token continuation and SIGKILLs the worker holding the session (draft, then target,
alternately) after the 10th token; measures the largest gap between chunks after the
kill against the median gap of the stream, checks the output against an undisturbed
run, and restarts the killed worker for the next kill. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

from specdec.v1 import orchestrator_pb2
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_failover", description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=4)
    args = parser.parse_args(argv)
    redis_server = RedisServer().start()
    rows = []
    try:
        with LocalSystem(redis_url=redis_server.url, target_workers=2, draft_workers=2,
                         heartbeat_s=0.5, heartbeat_ttl_s=2.0) as system:
            time.sleep(2)
            for index in range(args.kills):
                pool = ("draft", "target")[index % 2]
                first = system.stub.Generate(_request(PROMPT[:3], max_new_tokens=2), timeout=30)
                session = system.stub.GetSession(orchestrator_pb2.GetSessionRequest(session_id=first.session_id))
                victim = system.role((session.draft if pool == "draft" else session.target).worker_address).name
                # The undisturbed run of the same continuation, on a fresh session.
                fresh = system.stub.Generate(_request(PROMPT[:3], max_new_tokens=2), timeout=30)
                expected, _, _, _ = _stream(system, _request(PROMPT[3:], fresh.session_id), None)
                tokens, gaps, killed_at, stats = _stream(system, _request(PROMPT[3:], first.session_id), victim)
                stall = max(g for g, count in gaps if count >= killed_at)
                median = statistics.median(g for g, _ in gaps)
                rows.append((pool, killed_at, stall * 1e3, median * 1e3, stats.num_failovers, tokens == expected))
                system.restart(victim)
                time.sleep(2)
    finally:
        redis_server.cleanup()
    print("| killed | after token | largest gap after the kill (ms) | median gap (ms) | failovers | output equals undisturbed |")
    print("|---|---|---|---|---|---|")
    for pool, at, stall, median, failovers, equal in rows:
        print(f"| {pool} | {at} | {stall:.0f} | {median:.0f} | {failovers} | {'yes' if equal else 'NO'} |")


if __name__ == "__main__":
    main()
