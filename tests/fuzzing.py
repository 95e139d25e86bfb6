"""What the fuzz tests (tests/system/test_fuzz.py) share: the status table every answer is held
to, a tally of the calls made, raw calls (bytes in, bytes out), the example budget of
the CI and long runs, and a memoized target-only greedy reference."""

from __future__ import annotations

import collections
import json
import os
import time
from functools import lru_cache
from pathlib import Path

import grpc
from hypothesis import HealthCheck, Phase, Verbosity, settings

from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams

Code = grpc.StatusCode

# docs/api.md, "Statuses": what a client may get from each service. INTERNAL, UNKNOWN
# and UNIMPLEMENTED are not in it: they mean a bug (a stack trace reached the client).
DOCUMENTED = {
    Code.OK,
    Code.INVALID_ARGUMENT,
    Code.NOT_FOUND,
    Code.ALREADY_EXISTS,
    Code.FAILED_PRECONDITION,
    Code.ABORTED,
    Code.RESOURCE_EXHAUSTED,
    Code.UNAVAILABLE,
    Code.DEADLINE_EXCEEDED,
    Code.CANCELLED,
    Code.UNAUTHENTICATED,
}

# SPECDEC_FUZZ=long (make fuzz-long) multiplies every test's examples; both runs are
# derandomized (the seed is derived from each test's code), so a failure reproduces.
PROFILE = os.environ.get("SPECDEC_FUZZ", "ci")
SCALE = {"ci": 1, "long": int(os.environ.get("SPECDEC_FUZZ_SCALE", "25"))}[PROFILE]
REPORT = os.environ.get("SPECDEC_FUZZ_REPORT", "")  # a JSON file the tally is written to
# Shrinking a failure of calls to real processes can take many minutes: off unless asked
# for (the failing example is printed whole, and reproduces: the runs are derandomized).
SHRINK = os.environ.get("SPECDEC_FUZZ_SHRINK", "") == "1"
# SPECDEC_FUZZ_VERBOSE=1 (with pytest -s) prints every example, and the first error of a
# failing one even where Hypothesis then reports a flaky test.
VERBOSITY = (
    Verbosity.verbose if os.environ.get("SPECDEC_FUZZ_VERBOSE", "") == "1" else Verbosity.normal
)


def fuzz_settings(examples: int, steps: int | None = None) -> settings:
    """Bounded, derandomized examples; the calls take what they take (no deadline)."""
    extra = {"stateful_step_count": steps} if steps else {}
    phases = [Phase.explicit, Phase.generate, *([Phase.shrink] if SHRINK else [])]
    return settings(
        max_examples=examples * SCALE,
        derandomize=True,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
        verbosity=VERBOSITY,
        **extra,
    )


class Tally:
    """Calls made and the statuses they got, per method; every status checked against
    the table (and, where the test says so, against a narrower expectation)."""

    def __init__(self, log_dir: str = ""):
        self.log_dir = (
            log_dir  # the processes' logs: their unexpected errors show with a bad status
        )
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.started = time.monotonic()

    def record(self, method: str, code: Code, details: str = "", expected=DOCUMENTED) -> Code:
        self.counts[(method, code.name)] += 1
        if code not in DOCUMENTED and self.log_dir:
            details += "\n" + "\n".join(unexpected_errors(self.log_dir)[-2:])
        assert code in DOCUMENTED, f"{method}: {code.name} is not a documented status: {details}"
        assert code in expected, (
            f"{method}: {code.name} where {sorted(c.name for c in expected)} were expected: {details}"
        )
        return code

    def call(self, method: str, function, *args, expected=DOCUMENTED, **kwargs):
        """(status, response or None) of a unary call or of a stream drained to its end."""
        try:
            response = function(*args, **kwargs)
            if hasattr(response, "__next__"):
                response = list(response)
        except grpc.RpcError as error:
            self.record(method, error.code(), error.details() or "", expected)
            return error.code(), None
        self.record(method, Code.OK, "", expected)
        return Code.OK, response

    def summary(self) -> dict:
        by_status = collections.Counter()
        for (_, status), count in self.counts.items():
            by_status[status] += count
        return {
            "profile": PROFILE,
            "scale": SCALE,
            "calls": sum(self.counts.values()),
            "seconds": round(time.monotonic() - self.started, 1),
            "by_status": dict(by_status.most_common()),
            "by_method": {f"{m} {s}": c for (m, s), c in sorted(self.counts.items())},
        }

    def write(self, extra: dict) -> None:
        if REPORT:
            with open(REPORT, "w") as out:
                json.dump({**self.summary(), **extra}, out, indent=1)


def unexpected_errors(log_dir: str) -> list[str]:
    """The errors the services logged as unexpected (a status INTERNAL), with traces."""
    found = []
    for path in sorted(Path(log_dir).glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"level": "error"' in line:
                found.append(f"{path.name}: {line[-3000:]}")
    return found


def raw_method(channel: grpc.Channel, path: str, request_streaming: bool, response_streaming: bool):
    """A callable for method `path` that sends and returns bytes, whatever they hold."""
    kind = (
        ("stream" if request_streaming else "unary")
        + "_"
        + ("stream" if response_streaming else "unary")
    )
    return getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)


def methods_of(service_descriptor) -> list[tuple[str, bool, bool]]:
    """(path, request streaming, response streaming) of each method of a service."""
    return [
        (f"/{service_descriptor.full_name}/{m.name}", m.client_streaming, m.server_streaming)
        for m in service_descriptor.methods
    ]


class Reference:
    """Target-only greedy continuations of the tiny target, memoized by prefix: what
    every greedy answer of the system must equal token for token."""

    def __init__(self, loaded, stop_at_eos: bool):
        self.generator = SpeculativeGenerator(loaded)
        self.stops = (loaded.eos_token_id,) if stop_at_eos else ()
        self._continue = lru_cache(maxsize=4096)(self._compute)

    def __call__(self, tokens, max_new_tokens: int) -> list[int]:
        return list(self._continue(tuple(tokens), max_new_tokens)) if max_new_tokens > 0 else []

    def _compute(self, tokens: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
        params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=self.stops)
        return tuple(self.generator.generate(list(tokens), params, k=0).token_ids)
