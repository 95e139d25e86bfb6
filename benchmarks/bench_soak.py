"""A soak: mixed traffic for a long while, one worker killed and restarted midway;
what every process's memory and descriptors do, what is left behind, what failed.

    .venv/bin/python -m benchmarks.bench_soak [--minutes 30] [--concurrency 4]

Starts a real redis-server and, through the launcher, 2 target workers (SmolLM2-135M,
the default model), 2 draft workers (the n-gram drafter) and 1 orchestrator, in pools
with the registry so that a lost worker fails over. `--concurrency` client threads
loop over a mix of calls (streams, cancellations, continued sessions, stop strings,
seeded sampling, bad requests) and close every session they create. At `--kill-at`
of the run the target worker holding the most sessions is SIGKILLed, and started
again `--restart-after-s` later. Every `--sample-s`: resident memory (VmRSS) and open
file descriptors of every process, the workers' sessions and cached tokens, the
sessions in Redis. After the clients stop: what the workers and Redis still hold.
Writes the samples and counts as JSON and prints a Markdown summary: memory growth of
each process after the warm-up, descriptors, leaks, calls by kind and status.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis

from benchmarks.prompts import PROMPTS
from specdec.v1 import (
    common_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2_grpc,
)
from tests.redis_server import RedisServer
from tests.system import LocalSystem

CALL_TIMEOUT_S = 120.0  # a call slow because the machine is shared still finishes
HEARTBEAT_S, HEARTBEAT_TTL_S = 0.5, 2.0  # a killed worker leaves its pool within 2 s
TEXTS = list(PROMPTS.values())
FOLLOW_UPS = ["\nGo on.\n", "\nShorter, please.\n", "\nAnd then?\n", "\nGive an example.\n"]

# Each kind: its share of the calls and the statuses it is meant to get (besides OK).
MIX = {
    "stream": (30, set()),
    "cancel": (15, {"CANCELLED"}),
    "conversation": (20, set()),
    "stop_string": (10, set()),
    "sampled": (10, set()),
    "bad": (15, {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"}),
}


def _request(
    text="", session_id="", max_new_tokens=32, k=4, stop=(), chat=False, **sampling
) -> orchestrator_pb2.GenerateRequest:
    """A prompt as raw text, or (chat) as a user message under the chat template."""
    request = orchestrator_pb2.GenerateRequest(
        session_id=session_id, stop=list(stop), include_stats=True
    )
    if text and chat:
        request.chat.messages.add(role="user", content=text)
    elif text:
        request.text = text
    request.sampling.CopyFrom(common_pb2.SamplingParams(max_new_tokens=max_new_tokens, **sampling))
    request.speculation.num_speculative_tokens = k
    request.speculation.drafter = "ngram"
    return request


@dataclass
class Counts:
    """Calls by kind and status, tokens, failovers; thread-safe."""

    calls: collections.Counter = field(
        default_factory=collections.Counter
    )  # (kind, status) -> calls
    unexpected: list = field(default_factory=list)  # (time s, kind, status, details)
    tokens: int = 0
    failovers: int = 0
    sessions: dict = field(default_factory=dict)  # session id -> what made it, to name leftovers
    after_cancel: collections.Counter = field(
        default_factory=collections.Counter
    )  # outcome -> sessions
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, status: str, started: float, details: str = "") -> None:
        with self.lock:
            self.calls[(kind, status)] += 1
            if status != "OK" and status not in MIX[kind][1]:
                self.unexpected.append(
                    (round(time.monotonic() - started, 1), kind, status, details[:300])
                )


class Client:
    """One client thread's calls; every session it creates, it closes."""

    def __init__(self, channel: grpc.Channel, counts: Counts, seed: int, started: float):
        self.channel, self.stub = channel, orchestrator_pb2_grpc.OrchestratorStub(channel)
        self.counts, self.random, self.started = counts, random.Random(seed), started
        self.after_cancel: list[str] = []  # sessions of cancelled calls, closed after the next call

    def run(self, stop: threading.Event) -> None:
        kinds, weights = list(MIX), [share for share, _ in MIX.values()]
        while not stop.is_set():
            kind = self.kind = self.random.choices(kinds, weights)[0]
            try:
                status = getattr(self, kind)() or "OK"
                self.counts.add(kind, status, self.started)
            except grpc.RpcError as error:
                self.counts.add(kind, error.code().name, self.started, error.details() or "")
            if kind != "cancel":
                self.close_after_cancels()
        self.close_after_cancels()

    def _stream(self, request, cancel_after: int | None = None) -> tuple[str, list]:
        """(session id, chunks) of a GenerateStream, cancelled after cancel_after chunks."""
        session_id, chunks = request.session_id, []
        stream = self.stub.GenerateStream(request, timeout=CALL_TIMEOUT_S)
        for chunk in stream:
            if not session_id:
                session_id = chunk.session_id
                self.counts.sessions[session_id] = self.kind
            chunks.append(chunk)
            # The last chunk (finish_reason set) ends the call: the session is saved, and a
            # cancel now would reach no one: the caller closes it like any other.
            if cancel_after is not None and len(chunks) >= cancel_after and not chunk.finish_reason:
                cancelled = stream.cancel()
                self.counts.sessions[session_id] = (
                    f"{self.kind}: cancelled after {len(chunks)} chunks "
                    f"(cancel() {'took effect' if cancelled else 'came after the end'})"
                )
                raise _Cancelled(session_id)
        self._account(chunks)
        return session_id, chunks

    def _account(self, chunks) -> None:
        with self.counts.lock:
            self.counts.tokens += sum(len(c.token_ids) for c in chunks)
            if chunks and chunks[-1].HasField("stats"):
                self.counts.failovers += chunks[-1].stats.num_failovers

    def _chat(self) -> bool:
        """Half the prompts go through the chat template (what an instruct model answers
        at length), half as raw text."""
        return self.random.random() < 0.5

    def _close(self, session_id: str) -> None:
        self.stub.CloseSession(
            common_pb2.CloseSessionRequest(session_id=session_id), timeout=CALL_TIMEOUT_S
        )

    def stream(self) -> None:
        session_id, _ = self._stream(
            _request(
                self.random.choice(TEXTS),
                max_new_tokens=self.random.randint(16, 64),
                chat=self._chat(),
            )
        )
        self._close(session_id)

    def cancel(self) -> str:
        """A stream cancelled after a few chunks: the orchestrator closes the session it made."""
        try:
            session_id, _ = self._stream(
                _request(self.random.choice(TEXTS), max_new_tokens=200, chat=self._chat()),
                cancel_after=self.random.randint(1, 6),
            )
        except _Cancelled as cancelled:
            # The orchestrator frees it, unless the call had ended before the cancel got
            # there (it cannot tell): a careful client closes it too, once the call is over.
            self.after_cancel.append(cancelled.session_id)
            return "CANCELLED"
        self._close(session_id)  # it ended before the cancel (a short answer)
        return "OK"

    def close_after_cancels(self) -> None:
        """Closes the sessions of earlier cancelled calls: NOT_FOUND = the orchestrator
        had freed it, OK = the call had ended before the cancel reached it."""
        for session_id in self.after_cancel:
            try:
                self._close(session_id)
                outcome = "still there: closed by the client"
            except grpc.RpcError as error:
                outcome = (
                    "freed by the orchestrator"
                    if error.code() == grpc.StatusCode.NOT_FOUND
                    else error.code().name
                )
            with self.counts.lock:
                self.counts.after_cancel[outcome] += 1
        self.after_cancel.clear()

    def conversation(self) -> None:
        """Two to four turns on one session: each reuses the workers' caches."""
        session_id, text, chat = "", self.random.choice(TEXTS), self._chat()
        try:
            for _ in range(self.random.randint(2, 4)):
                session_id, _ = self._stream(
                    _request(text, session_id=session_id, max_new_tokens=24, chat=chat)
                )
                text = self.random.choice(FOLLOW_UPS)
        finally:
            if session_id:
                self._close(session_id)

    def stop_string(self) -> None:
        request = _request(
            self.random.choice(TEXTS),
            max_new_tokens=64,
            chat=self._chat(),
            stop=[self.random.choice([".", "\n", ",", " the"])],
        )
        response = self.stub.Generate(request, timeout=CALL_TIMEOUT_S)
        self.counts.sessions[response.session_id] = self.kind
        self._account([response])
        self._close(response.session_id)

    def sampled(self) -> None:
        request = _request(
            self.random.choice(TEXTS),
            max_new_tokens=32,
            chat=self._chat(),
            temperature=0.8,
            top_p=0.95,
            seed=self.random.randrange(2**32),
        )
        session_id, _ = self._stream(request)
        self._close(session_id)

    def bad(self) -> str:
        """A request refused with a precise status; no session is created."""
        choice = self.random.randrange(6)
        if choice == 0:
            request = _request("")  # empty prompt
        elif choice == 1:
            request = _request("hello", k=99)
        elif choice == 2:
            request = _request("hello", temperature=-1.0)
        elif choice == 3:
            request = _request("hello", session_id="no-such-session")
        elif choice == 4:
            request = _request("hello", stop=["x" * 100_000])
        else:
            raw = self.channel.unary_unary("/specdec.v1.Orchestrator/Generate")
            raw(b"\x0a\x02\xc3\x28", timeout=CALL_TIMEOUT_S)  # not a GenerateRequest (bad UTF-8)
            return "ACCEPTED"
        response = self.stub.Generate(request, timeout=CALL_TIMEOUT_S)
        self._close(response.session_id)
        return "ACCEPTED"  # a bad request served: counted as unexpected


class _Cancelled(Exception):
    def __init__(self, session_id: str):
        super().__init__(session_id)
        self.session_id = session_id


# --- sampling ---------------------------------------------------------------------------


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _processes(system: LocalSystem, redis_server: RedisServer) -> dict[str, int]:
    """Name -> pid of every live process of the system (a restarted role: its new pid)."""
    live = {name: p.pid for name, p in system.cluster.processes if p.poll() is None}
    live["redis"] = redis_server.process.pid
    return live


def _worker_load(system: LocalSystem) -> dict[str, dict]:
    load = {}
    for role in system.roles:
        if role.pool not in ("target", "draft"):
            continue
        stub_class = (
            target_pb2_grpc.TargetServiceStub
            if role.pool == "target"
            else draft_pb2_grpc.DraftServiceStub
        )
        channel = grpc.insecure_channel(role.address)
        try:
            info = stub_class(channel).Info(common_pb2.InfoRequest(), timeout=5).load
            load[role.name] = {
                "sessions": info.active_sessions,
                "cached_tokens": info.cached_tokens,
                "running_calls": info.running_calls,
            }
        except grpc.RpcError as error:
            load[role.name] = {"error": error.code().name}
        finally:
            channel.close()
    return load


def _redis_sessions(client: redis.Redis) -> dict[str, int]:
    return {
        kind: sum(1 for _ in client.scan_iter(f"specdec:{kind}:*", count=1000))
        for kind in ("session", "lease")
    }


def _sample(system, redis_server, client, started) -> dict:
    processes = _processes(system, redis_server)
    return {
        "t_s": round(time.monotonic() - started, 1),
        "processes": {
            name: {"pid": pid, "rss_kib": _rss_kib(pid), "fds": _open_fds(pid)}
            for name, pid in processes.items()
        },
        "workers": _worker_load(system),
        "redis": _redis_sessions(client),
    }


# --- the run ----------------------------------------------------------------------------


def _victim(system: LocalSystem) -> str:
    """The target worker holding the most sessions."""
    load = _worker_load(system)
    targets = [r.name for r in system.roles if r.pool == "target"]
    return max(targets, key=lambda name: load.get(name, {}).get("sessions", 0))


def _wait_for_workers(
    system: LocalSystem, targets: int, drafts: int, timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = system.stub.ListWorkers(orchestrator_pb2.ListWorkersRequest(), timeout=5).workers
        pools = collections.Counter(w.pool for w in workers)
        if (
            pools[common_pb2.WORKER_POOL_TARGET] >= targets
            and pools[common_pb2.WORKER_POOL_DRAFT] >= drafts
        ):
            return
        time.sleep(0.5)
    raise SystemExit(f"the pools did not reach {targets} targets and {drafts} drafts")


def soak(args) -> dict:
    redis_server = RedisServer().start()
    client = redis.Redis(port=redis_server.port)
    try:
        with LocalSystem(
            target_model=args.target_model,
            draft_model="",
            redis_url=redis_server.url,
            target_workers=2,
            draft_workers=2,
            heartbeat_s=HEARTBEAT_S,
            heartbeat_ttl_s=HEARTBEAT_TTL_S,
            startup_timeout=600.0,
            log_dir=args.log_dir or None,
        ) as system:
            _wait_for_workers(system, 2, 2)
            return _run(args, system, redis_server, client)
    finally:
        redis_server.cleanup()


def _run(args, system, redis_server, client) -> dict:
    counts, stop = Counts(), threading.Event()
    started = time.monotonic()
    channel = system.channels[0]  # the first orchestrator's, as the system made it
    threads = [
        threading.Thread(
            target=Client(channel, counts, seed, started).run, args=(stop,), daemon=True
        )
        for seed in range(args.concurrency)
    ]
    for thread in threads:
        thread.start()
    duration_s = args.minutes * 60
    kill_at_s, events, samples = duration_s * args.kill_at, [], []
    victim = None
    next_sample = 0.0
    while (now := time.monotonic() - started) < duration_s:
        if now >= next_sample:
            samples.append(_sample(system, redis_server, client, started))
            print(f"[{now / 60:5.1f} min] {_one_line(samples[-1], counts)}", flush=True)
            next_sample += args.sample_s
        if victim is None and now >= kill_at_s:
            victim = _victim(system)
            os.kill(system.process(victim).pid, signal.SIGKILL)
            events.append({"t_s": round(now, 1), "event": f"SIGKILL {victim}"})
            print(f"[{now / 60:5.1f} min] SIGKILL {victim}", flush=True)
        if victim is not None and len(events) == 1 and now >= kill_at_s + args.restart_after_s:
            system.restart(victim)
            events.append(
                {"t_s": round(time.monotonic() - started, 1), "event": f"restarted {victim}"}
            )
            print(f"[{now / 60:5.1f} min] restarted {victim}", flush=True)
        time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(timeout=CALL_TIMEOUT_S * 2)
    samples.append(_sample(system, redis_server, client, started))
    left = _left_behind(system, client, counts)
    return {
        "args": vars(args),
        "events": events,
        "samples": samples,
        "left_after_close": left,
        "calls": {f"{kind} {status}": n for (kind, status), n in sorted(counts.calls.items())},
        "unexpected": counts.unexpected,
        "tokens": counts.tokens,
        "failovers": counts.failovers,
        "sessions_of_cancelled_calls": dict(counts.after_cancel),
        "clients_stopped": all(not t.is_alive() for t in threads),
    }


def _left_behind(system, client, counts: Counts) -> dict:
    """Sessions on the workers and in Redis once the clients closed theirs (polled: a
    cancelled call frees its session as it unwinds)."""
    deadline = time.monotonic() + 30
    while True:
        workers, stored = _worker_load(system), _redis_sessions(client)
        held = (
            sum(w.get("sessions", 0) for w in workers.values())
            + stored["session"]
            + stored["lease"]
        )
        if held == 0 or time.monotonic() > deadline:
            return {"workers": workers, "redis": stored, "sessions": _leftovers(client, counts)}
        time.sleep(1)


def _leftovers(client: redis.Redis, counts: Counts) -> list[dict]:
    """The sessions still in Redis: which call made each, what it holds."""
    now_ms, found = time.time() * 1000, []
    for key in client.scan_iter("specdec:session:*", count=1000):
        record = json.loads(client.get(key) or "{}")
        session_id = key.decode().rsplit(":", 1)[-1]
        found.append(
            {
                "session_id": session_id,
                "made_by": counts.sessions.get(session_id, "unknown"),
                "tokens": len(record.get("token_ids", [])),
                "messages": len(record.get("messages", [])),
                "idle_s": round((now_ms - record.get("last_used_ms", now_ms)) / 1000),
            }
        )
    return found


def _one_line(sample: dict, counts: Counts) -> str:
    rss = " ".join(
        f"{name}={p['rss_kib'] / 1024:.0f}M/{p['fds']}fd"
        for name, p in sorted(sample["processes"].items())
        if p["rss_kib"]
    )
    sessions = " ".join(
        f"{name}:{w.get('sessions', w.get('error'))}"
        for name, w in sorted(sample["workers"].items())
    )
    with counts.lock:
        calls = sum(counts.calls.values())
    return f"{rss} | sessions {sessions} redis {sample['redis']} | {calls} calls, {len(counts.unexpected)} unexpected"


# --- the summary ------------------------------------------------------------------------


def growth(result: dict, warmup_s: float) -> list[dict]:
    """Per process (each pid of a restarted role apart): RSS and descriptors at the first
    sample after its warm-up and at the last, and the growth between them."""
    series: dict[tuple[str, int], list] = collections.defaultdict(list)
    for sample in result["samples"]:
        for name, p in sample["processes"].items():
            if p["rss_kib"]:
                series[(name, p["pid"])].append((sample["t_s"], p["rss_kib"], p["fds"]))
    rows = []
    for (name, pid), points in sorted(series.items()):
        first_t = points[0][0]
        after = [p for p in points if p[0] >= first_t + warmup_s]
        if len(after) < 2:
            rows.append(
                {
                    "process": name,
                    "pid": pid,
                    "samples": len(points),
                    "note": "too short after warm-up",
                }
            )
            continue
        (t0, rss0, fd0), (t1, rss1, fd1) = after[0], after[-1]
        peak = max(p[1] for p in after)
        rows.append(
            {
                "process": name,
                "pid": pid,
                "samples": len(points),
                "from_s": t0,
                "to_s": t1,
                "rss_start_mib": round(rss0 / 1024, 1),
                "rss_end_mib": round(rss1 / 1024, 1),
                "rss_peak_mib": round(peak / 1024, 1),
                "growth_pct": round(100 * (rss1 - rss0) / rss0, 2),
                "fds_start": fd0,
                "fds_end": fd1,
                "fds_max": max(p[2] for p in after),
            }
        )
    return rows


def markdown(result: dict, warmup_s: float) -> str:
    lines = [
        "| process | pid | RSS after warm-up (MiB) | RSS at end (MiB) | peak (MiB) | growth "
        "| fds after warm-up | fds at end | fds max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in growth(result, warmup_s):
        if "note" in row:
            lines.append(
                f"| {row['process']} | {row['pid']} | {row['note']} ({row['samples']} samples) | | | | | | |"
            )
            continue
        lines.append(
            f"| {row['process']} | {row['pid']} | {row['rss_start_mib']} | {row['rss_end_mib']} | "
            f"{row['rss_peak_mib']} | {row['growth_pct']:+.2f}% | {row['fds_start']} | {row['fds_end']} | "
            f"{row['fds_max']} |"
        )
    lines += ["", "| kind | status | calls |", "|---|---|---|"]
    for key, n in result["calls"].items():
        kind, status = key.split(" ")
        lines.append(f"| {kind} | {status} | {n} |")
    left = result["left_after_close"]
    lines += [
        "",
        f"Left after the clients closed their sessions: workers "
        f"{ {k: v.get('sessions', v.get('error')) for k, v in left['workers'].items()} }, Redis {left['redis']}.",
        f"Events: {result['events']}. Tokens generated: {result['tokens']}; failovers: {result['failovers']}.",
        f"Sessions of cancelled calls, when their client came back to close them: "
        f"{result['sessions_of_cancelled_calls']}.",
        f"Unexpected statuses: {len(result['unexpected'])}",
    ]
    lines += [
        f"- at {t} s, {kind}: {status} {details}"
        for t, kind, status, details in result["unexpected"][:20]
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_soak", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=4, help="client threads")
    parser.add_argument("--target-model", default="smollm2-135m")
    parser.add_argument(
        "--kill-at", type=float, default=0.5, help="fraction of the run at which a target is killed"
    )
    parser.add_argument("--restart-after-s", type=float, default=30.0)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument(
        "--warmup-minutes",
        type=float,
        default=5.0,
        help="growth is measured after this much of each process's life",
    )
    parser.add_argument("--json", default="benchmarks/results_soak.json")
    parser.add_argument(
        "--log-dir", default="", help="the processes' logs (default: a new temporary folder)"
    )
    args = parser.parse_args(argv)
    # Stopped with SIGTERM (a background run ignores SIGINT): the processes stop with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = soak(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(markdown(result, args.warmup_minutes * 60))


if __name__ == "__main__":
    main()
