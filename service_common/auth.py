"""API keys for the public API: bearer tokens in gRPC metadata, checked at the door.

A keys file holds one key per line as `NAME sha256:HEX` (the SHA-256 of the key, never
the key itself; `#` starts a comment). Keys are random 256-bit tokens made by
`python -m service_common.auth add NAME FILE`, so an unsalted fast hash is safe (a slow
password hash protects guessable secrets, which these are not) and a check costs a
microsecond. Two lines with one name are two keys of one caller (a rotation): sessions
belong to the name. The file is re-read when it changes (a rotated Kubernetes Secret).

`ApiGate` is the server interceptor: every call except the health and reflection
services must carry `authorization: Bearer <key>` with a known key, else
UNAUTHENTICATED with the same words whether the key is missing, malformed or unknown;
it also applies the per-server and per-key call limits (service_common/limits.py). The
servicer learns who called from `current_caller()`.
"""

from __future__ import annotations

import argparse
import contextvars
import hashlib
import logging
import os
import re
import secrets
import sys
import threading
import time
from pathlib import Path

import grpc

from foundation.errors import InvalidArgument, ResourceExhausted
from service_common.limits import CallLimits

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"  # gRPC metadata keys are lower case; HTTP's Authorization maps to it
SCHEME = "bearer"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
HASH_PREFIX = "sha256:"
KEY_PREFIX = "sk-"  # makes a leaked key easy to spot in logs and scanners
# Open without a key: probes and tools that discover the API.
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)
# One answer for a missing, malformed or unknown key: no hint of which keys exist.
REFUSAL = "a valid API key is required: send the metadata 'authorization: Bearer <key>'"
ANONYMOUS = ""  # the caller when the server checks no keys

_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_caller", default=ANONYMOUS)


def current_caller() -> str:
    """The name of the key the current call presented; ANONYMOUS without keys."""
    return _CALLER.get()


def hash_key(key: str) -> str:
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_keys(text: str, source: str = "keys file") -> dict[str, str]:
    """{hash: name} from a keys file's text; InvalidArgument naming the bad line."""
    keys = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if (
            len(parts) != 2
            or not NAME_PATTERN.fullmatch(parts[0])
            or not re.fullmatch(HASH_PREFIX + "[0-9a-f]{64}", parts[1])
        ):
            raise InvalidArgument(f"{source} line {number}: expected 'NAME sha256:<64 hex digits>'")
        keys[parts[1]] = parts[0]
    return keys


class ApiKeys:
    """The keys of one file, re-read when the file changes (checked at most every reload_s)."""

    def __init__(self, path: str, reload_s: float = 5.0):
        self.path, self.reload_s = path, reload_s
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._keys = parse_keys(self._read(), path)  # a bad file stops the start-up
        self._checked = time.monotonic()

    def name_of(self, key: str) -> str | None:
        self._maybe_reload()
        return self._keys.get(hash_key(key))

    def __len__(self) -> int:
        return len(self._keys)

    def _read(self) -> str:
        try:
            return Path(self.path).read_text()
        except OSError as error:
            raise InvalidArgument(
                f"api_keys_file: cannot read {self.path!r}: {error.strerror}"
            ) from None

    def _file_stamp(self):
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_s or not self._lock.acquire(blocking=False):
            return
        try:
            self._checked = now
            stamp = self._file_stamp()
            if stamp is None or stamp == self._stamp:
                return
            try:
                self._keys = parse_keys(self._read(), self.path)
                log.info("API keys reloaded: %d keys", len(self._keys))
            except InvalidArgument as error:  # a half-written file: keep the keys we have
                log.error("API keys not reloaded, keeping the previous ones: %s", error)
            self._stamp = stamp
        finally:
            self._lock.release()


def bearer_key(metadata) -> str | None:
    """The key of the first `authorization: Bearer <key>` entry, if any."""
    for name, value in metadata or ():
        if name == METADATA_KEY:
            scheme, _, key = str(value).strip().partition(" ")
            if scheme.lower() != SCHEME or not key.strip():
                return None
            return key.strip()
    return None


class ApiGate(grpc.ServerInterceptor):
    """Authentication and call limits for every method outside OPEN_SERVICES.
    keys None = no authentication (callers are ANONYMOUS)."""

    def __init__(self, keys: ApiKeys | None, limits: CallLimits, open_services=OPEN_SERVICES):
        self.keys, self.limits = keys, limits
        self.open_prefixes = tuple(f"/{service}/" for service in open_services)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.open_prefixes):
            return handler
        caller = ANONYMOUS
        if self.keys is not None:
            key = bearer_key(handler_call_details.invocation_metadata)
            caller = self.keys.name_of(key) if key else None
            if caller is None:
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        return _admitted(handler, caller, self.limits)


def _refusing(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str
) -> grpc.RpcMethodHandler:
    def refuse(request_or_iterator, context):
        context.abort(code, details)

    return _same_kind(handler, refuse, refuse)


def _admitted(
    handler: grpc.RpcMethodHandler, caller: str, limits: CallLimits
) -> grpc.RpcMethodHandler:
    """The handler run with current_caller() = caller, counted by limits from when it
    starts to when it ends. Counting starts in the handler, not when gRPC looks it up:
    gRPC never runs a call whose request did not parse or whose client left first, and
    such a call would hold its slot for good (the fuzzing filled all 128 of them with
    malformed requests). Each call runs in a context of its own: the caller cannot leak
    into another call that a pool thread serves next."""
    behavior = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )

    def unary(request_or_iterator, context):
        _admit(limits, caller, context)
        call_context = contextvars.copy_context()
        call_context.run(_CALLER.set, caller)
        try:
            return call_context.run(behavior, request_or_iterator, context)
        finally:
            limits.release(caller)

    def streaming(request_or_iterator, context):
        _admit(limits, caller, context)
        call_context = contextvars.copy_context()
        call_context.run(_CALLER.set, caller)
        responses = None
        try:
            responses = call_context.run(behavior, request_or_iterator, context)
            while True:
                try:
                    response = call_context.run(next, responses)
                except StopIteration:
                    return
                yield response
        finally:
            # The handler's own clean-up (its generator closed on cancellation) first.
            if hasattr(responses, "close"):
                call_context.run(responses.close)
            limits.release(caller)

    return _same_kind(handler, unary, streaming)


def _admit(limits: CallLimits, caller: str, context: grpc.ServicerContext) -> None:
    try:
        limits.admit(caller)
    except ResourceExhausted as error:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))


def _same_kind(
    handler: grpc.RpcMethodHandler, unary_response, streaming_response
) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind and (de)serializers with other behaviour."""
    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary_response, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming_response, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary_response, **serializers)
    return grpc.stream_stream_rpc_method_handler(streaming_response, **serializers)


# The command line: make keys, hash them.


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service_common.auth", description="API keys for the orchestrator."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser(
        "add", help="make a new key for NAME, append its hash to FILE, print the key once"
    )
    add.add_argument("name")
    add.add_argument("file")
    hashed = commands.add_parser("hash", help="read a key on stdin, print its line for a keys file")
    hashed.add_argument("name")
    args = parser.parse_args(argv)
    if not NAME_PATTERN.fullmatch(args.name):
        parser.error(f"NAME must match {NAME_PATTERN.pattern}")
    if args.command == "hash":
        key = sys.stdin.readline().strip()
        if not key:
            parser.error("no key on stdin")
        print(f"{args.name} {hash_key(key)}")
        return 0
    key = new_key()
    path = Path(args.file)
    fresh = not path.exists()
    with open(path, "a") as keys_file:
        if fresh:
            os.chmod(path, 0o600)
        keys_file.write(f"{args.name} {hash_key(key)}\n")
    print(key)
    print(f"added key {args.name!r} to {path}; the key is shown only now", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
