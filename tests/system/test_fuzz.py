"""Fuzzing against real processes: one target, one draft and one orchestrator (tiny
seeded models, started once for the module) get random and malformed messages
(Hypothesis, derandomized, bounded: `make fuzz-long` runs the same tests with 25 times
the examples).

- random field values in every request message of the public API and of the workers'
  APIs (generated from the message descriptors, with the fields that matter biased to
  the values that reach deep: live session ids, lengths near the committed one, token
  ids in the vocabulary);
- random bytes (and mutated valid messages) as the serialized request of every method;
- random call orders on sessions: at the public API generate, continue, stop strings,
  cancel mid-stream, a second call on a busy session, close, get; on the workers open,
  extend, truncate, decode, verify, speculate, cancel, close.

Every answer must be a status of the table in docs/api.md (never INTERNAL / UNKNOWN),
every process must still run after each example, every greedy answer on a session must
equal target-only greedy decoding of what the session holds, and at the end a normal
request on a fresh session still equals target-only greedy and no session is left on
the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from foundation.errors import NotFound
from model_runtime.step_scheduler import FORGET_AFTER_NS, _Turnarounds
from model_runtime.tiny import TINY_VOCAB_SIZE
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Generation
from orchestrator.store import InMemorySessionStore
from orchestrator.text import TextAssembler
from orchestrator.workers import Worker
from service_common.auth import ApiGate
from service_common.limits import CallLimits
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    target_pb2,
    target_pb2_grpc,
)
from tests.fuzzing import DOCUMENTED, Code, Reference, Tally, fuzz_settings, methods_of, raw_method
from tests.local_system import LocalSystem

TIMEOUT_S = 30.0  # per call: every call here finishes in well under a second
I32 = st.integers(-(2**31), 2**31 - 1)
SMALL_TOKENS = st.integers(0, TINY_VOCAB_SIZE - 2)  # in the vocabulary, end-of-text excluded

ORCHESTRATOR = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"]
TARGET = target_pb2.DESCRIPTOR.services_by_name["TargetService"]
DRAFT = draft_pb2.DESCRIPTOR.services_by_name["DraftService"]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with LocalSystem(log_dir=str(tmp_path_factory.mktemp("fuzz-logs"))) as local:
        yield local


@pytest.fixture(scope="module")
def tally(system):
    counts = Tally(system.args.log_dir)
    yield counts
    counts.write({"processes_alive": all(p.poll() is None for _, p in system.cluster.processes)})


@pytest.fixture(scope="module")
def reference(tiny_target):
    """What the orchestrator answers: it always stops at end-of-text."""
    return Reference(tiny_target, stop_at_eos=True)


@pytest.fixture(scope="module")
def worker_reference(tiny_target):
    """What the workers answer: they stop only at the stop tokens they are given."""
    return Reference(tiny_target, stop_at_eos=False)


@pytest.fixture(scope="module")
def channels(system):
    ADDRESSES.update({r.pool: r.address for r in system.roles})
    opened = {pool: grpc.insecure_channel(address) for pool, address in ADDRESSES.items()}
    yield opened
    for channel in opened.values():
        channel.close()


def assert_alive(system) -> None:
    dead = [(name, p.returncode) for name, p in system.cluster.processes if p.poll() is not None]
    assert not dead, f"processes died: {dead}\n{system.logs()}"


def assert_fresh_session_is_greedy(system, reference) -> None:
    """A normal request on a fresh session, after whatever came before."""
    prompt = [5, 17, 99, 3, 42, 8, 5, 17]
    for k, drafter in ((0, ""), (4, "model"), (3, "ngram")):
        request = orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=prompt))
        request.sampling.max_new_tokens = 24
        request.speculation.num_speculative_tokens, request.speculation.drafter = k, drafter
        response = system.stub.Generate(request, timeout=TIMEOUT_S)
        assert list(response.token_ids) == reference(prompt, 24), (k, drafter)
        system.stub.CloseSession(
            common_pb2.CloseSessionRequest(session_id=response.session_id), timeout=TIMEOUT_S
        )


def worker_sessions(channels) -> dict[str, int]:
    load = {}
    for pool, stub_class in (
        ("target", target_pb2_grpc.TargetServiceStub),
        ("draft", draft_pb2_grpc.DraftServiceStub),
    ):
        load[pool] = (
            stub_class(channels[pool])
            .Info(common_pb2.InfoRequest(), timeout=TIMEOUT_S)
            .load.active_sessions
        )
    return load


def wait_for_no_worker_sessions(channels) -> dict[str, int]:
    """Sessions freed by a cancelled call are closed once that call unwinds: poll."""
    deadline = time.monotonic() + 15
    while (left := worker_sessions(channels)) != {
        "target": 0,
        "draft": 0,
    } and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


# --- random field values, from the message descriptors --------------------------------


class Live:
    """Ids the fuzzed calls created, so that later examples can hit real sessions."""

    def __init__(self):
        self.ids: dict[str, list[str]] = {"orchestrator": [], "target": [], "draft": []}
        self.all: dict[str, set[str]] = {
            "orchestrator": set(),
            "target": set(),
            "draft": set(),
        }  # to close

    def pick(self, pool: str, index: int) -> str:
        ids = self.ids[pool]
        return ids[index % len(ids)] if ids else ""

    def add(self, pool: str, session_id: str) -> None:
        if session_id and session_id not in self.ids[pool]:
            self.all[pool].add(session_id)
            self.ids[pool].append(session_id)
            del self.ids[pool][:-32]  # the most recent ones


LIVE = Live()
ADDRESSES: dict[str, str] = {}  # pool -> address, set by the channels fixture


def _session_ids(pool: str):
    return st.one_of(
        st.just(""),
        st.text(max_size=12),
        st.integers(0, 10**6).map(lambda i: LIVE.pick(pool, i)),
        st.integers(0, 10**6).map(lambda i: LIVE.pick(pool, i)),
    )


def _addresses():
    return st.one_of(
        st.sampled_from(["target", "draft", "orchestrator"]).map(
            lambda pool: ADDRESSES.get(pool, "")
        ),
        st.sampled_from(
            ["", "127.0.0.1:1", "localhost:0", "[::1]:1", "unix:/nonexistent", "dns:///bad host"]
        ),
        st.text(max_size=20),
    )


def _lengths():
    return st.one_of(st.integers(-2, 40), I32)


def _field_strategy(field: pb_descriptor.FieldDescriptor, pool: str, depth: int):
    """Values for one field; the fields that steer a call deep get biased values."""
    name, kind = field.name, field.type
    F = pb_descriptor.FieldDescriptor
    if name == "session_id":
        return _session_ids(pool)
    if name in ("worker_address", "address"):
        return _addresses()
    if name == "drafter":
        return st.one_of(
            st.sampled_from(["", "model", "ngram", "ngram+model"]), st.text(max_size=12)
        )
    if name == "role":
        return st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=8))
    if name in ("base_len", "length", "committed_len"):
        return _lengths()
    if name in ("max_new_tokens", "max_tokens"):
        return st.one_of(st.integers(-2, 12), I32)  # long valid generations would only cost time
    if name == "num_speculative_tokens":
        return st.one_of(st.integers(-2, 18), I32)
    if name == "temperature":
        return st.one_of(st.just(0.0), st.floats(width=32))
    if kind in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.one_of(SMALL_TOKENS, st.integers(-3, 300), I32)
    if kind in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return st.one_of(st.integers(-3, 300), st.integers(-(2**63), 2**63 - 1))
    if kind in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if kind in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1))
    if kind in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if kind == F.TYPE_FLOAT else 64)
    if kind == F.TYPE_BOOL:
        return st.booleans()
    if kind == F.TYPE_STRING:
        return st.text(max_size=40)
    if kind == F.TYPE_BYTES:
        return st.binary(max_size=20)
    if kind == F.TYPE_ENUM:
        return st.one_of(
            st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 100)
        )
    if kind == F.TYPE_MESSAGE:
        return messages(field.message_type, pool, depth + 1)
    raise AssertionError(f"no strategy for {field.full_name}")


@st.composite
def _message(draw, descriptor, pool: str, depth: int):
    message = _new(descriptor)
    oneofs_set = set()
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and not oneof.name.startswith("_"):  # a real oneof: one member at most
            if oneof.name in oneofs_set or not draw(st.booleans()):
                continue
            oneofs_set.add(oneof.name)
        elif not field.is_repeated and not draw(st.booleans()):
            continue  # unset: the default a client gets by leaving it out
        if depth > 3 and field.type == field.TYPE_MESSAGE:
            continue
        if field.is_repeated:
            values = draw(_repeated(field, pool, depth))
            if field.type == field.TYPE_MESSAGE:
                for value in values:
                    getattr(message, field.name).add().CopyFrom(value)
            else:
                getattr(message, field.name).extend(values)
        elif field.type == field.TYPE_MESSAGE:
            getattr(message, field.name).CopyFrom(draw(_field_strategy(field, pool, depth)))
        else:
            setattr(message, field.name, draw(_field_strategy(field, pool, depth)))
    return message


def _repeated(field, pool: str, depth: int):
    if field.type == field.TYPE_MESSAGE:
        return st.lists(_field_strategy(field, pool, depth), max_size=3)
    if "token_ids" in field.name or field.name == "ids":
        # past the context
        return st.one_of(
            st.lists(SMALL_TOKENS, max_size=24),
            st.lists(_field_strategy(field, pool, depth), max_size=6),
            st.integers(1000, 1100).map(lambda n: [7] * n),
        )
    return st.lists(_field_strategy(field, pool, depth), max_size=5)


def _new(descriptor):
    return message_factory.GetMessageClass(descriptor)()


def messages(descriptor, pool: str, depth: int = 0):
    return _message(descriptor, pool, depth)


def _stub_call(channels, pool: str, method):
    """A typed callable for a method of a worker or of the orchestrator."""
    channel = channels[pool]
    request_class = type(_new(method.input_type))
    response_class = type(_new(method.output_type))
    kind = (
        ("stream" if method.client_streaming else "unary")
        + "_"
        + ("stream" if method.server_streaming else "unary")
    )
    return getattr(channel, kind)(
        f"/{method.containing_service.full_name}/{method.name}",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )


def _remember(pool: str, method_name: str, response) -> None:
    """Session ids in answers, for later examples to hit."""
    responses = response if isinstance(response, list) else [response]
    for message in responses:
        if hasattr(message, "session_id"):
            LIVE.add(pool, message.session_id)
        if hasattr(message, "handle"):
            LIVE.add(pool, message.handle.session_id)


SERVICES = [("orchestrator", ORCHESTRATOR), ("target", TARGET), ("draft", DRAFT)]
METHODS = [(pool, m) for pool, service in SERVICES for m in service.methods]


# With every process up and no other client, only a draft sent to a random address has
# a reason to be UNAVAILABLE, and only a draft session is ABORTED (held too long).
NOT_EXPECTED = {
    "orchestrator": {Code.UNAVAILABLE, Code.ABORTED, Code.ALREADY_EXISTS},
    "target": {Code.UNAVAILABLE, Code.ABORTED},
    "draft": set(),
}


def _call_with_random_fields(channels, tally, pool, method, request_or_requests, cancel_after):
    call = _stub_call(channels, pool, method)
    path = f"{method.containing_service.name}.{method.name}"
    expected = DOCUMENTED - NOT_EXPECTED[pool]
    if method.client_streaming:
        request_or_requests = iter(request_or_requests)
    if not method.server_streaming:
        status, response = tally.call(
            path, call, request_or_requests, timeout=TIMEOUT_S, expected=expected
        )
        if status == Code.OK:
            _remember(pool, method.name, response)
        return
    stream = call(request_or_requests, timeout=TIMEOUT_S)
    received = []
    try:
        for message in stream:
            received.append(message)
            if cancel_after is not None and len(received) > cancel_after:
                stream.cancel()
        tally.record(path, Code.OK, expected=expected)
    except grpc.RpcError as error:
        tally.record(path, error.code(), error.details() or "", expected)
    _remember(pool, method.name, received)


@st.composite
def _calls(draw):
    pool, method = draw(st.sampled_from(METHODS))
    if method.client_streaming:
        request = draw(st.lists(messages(method.input_type, pool), min_size=1, max_size=4))
    else:
        request = draw(messages(method.input_type, pool))
    cancel_after = draw(st.none() | st.integers(0, 2)) if method.server_streaming else None
    return pool, method.full_name, request, cancel_after


def test_random_field_values_get_documented_statuses(system, channels, tally, reference):
    """Every method of the three services, random values in every field."""

    @fuzz_settings(240)
    @given(_calls())
    def run(call):
        pool, name, request, cancel_after = call
        method = next(m for _, m in METHODS if m.full_name == name)
        _call_with_random_fields(channels, tally, pool, method, request, cancel_after)
        assert_alive(system)

    run()
    assert_fresh_session_is_greedy(system, reference)


# --- random bytes -----------------------------------------------------------------------


def _valid_requests():
    """Serialized valid-looking requests of every method, to mutate."""
    prompt = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=[5, 17, 99]), stop=["x"]
    )
    prompt.sampling.max_new_tokens = 4
    return [
        prompt.SerializeToString(),
        target_pb2.OpenSessionRequest(prompt_token_ids=[5, 17, 99]).SerializeToString(),
        target_pb2.Proposal(
            session_id="s",
            base_len=3,
            draft=target_pb2.Draft(
                token_ids=[1, 2],
                distributions=[common_pb2.SparseDistribution(token_ids=[1], probs=[1.0])],
            ),
        ).SerializeToString(),
        target_pb2.Proposal(
            session_id="s", base_len=3, stretch=target_pb2.Stretch(max_tokens=2)
        ).SerializeToString(),
        draft_pb2.SpeculateRequest(
            session_id="s",
            base_len=3,
            target=common_pb2.KvHandle(
                worker_address="127.0.0.1:1", session_id="t", committed_len=3
            ),
        ).SerializeToString(),
        common_pb2.ExtendRequest(session_id="s", base_len=3, token_ids=[4, 5]).SerializeToString(),
    ]


@st.composite
def _mutated(draw):
    data = bytearray(draw(st.sampled_from(_valid_requests())))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, max(0, len(data) - 1)))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and data:
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif action == "cut":
            del data[position:]
        else:
            data[position:position] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


PAYLOADS = st.one_of(
    st.binary(max_size=64),
    _mutated(),
    st.sampled_from([b"", b"\xff", b"\x0a\x02\xc3\x28", b"\x0a\xff\xff\xff\xff\x0f"]),
)
RAW_METHODS = [
    (pool, path, rs, ss) for pool, service in SERVICES for path, rs, ss in methods_of(service)
]


def test_random_bytes_get_documented_statuses(system, channels, tally, reference):
    """Bytes that are not the method's message are INVALID_ARGUMENT; bytes that happen
    to parse are served like any request."""

    @fuzz_settings(160)
    @given(st.sampled_from(RAW_METHODS), st.lists(PAYLOADS, min_size=1, max_size=3))
    def run(method, payloads):
        pool, path, request_streaming, response_streaming = method
        call = raw_method(channels[pool], path, request_streaming, response_streaming)
        status, response = tally.call(
            f"raw {path.rsplit('/', 2)[-2].rsplit('.', 1)[-1]}.{path.rsplit('/', 1)[-1]}",
            call,
            iter(payloads) if request_streaming else payloads[0],
            timeout=TIMEOUT_S,
        )
        if status == Code.OK:  # bytes that parsed may have opened a session: closed at the end
            method = next(
                m for _, m in METHODS if f"/{m.containing_service.full_name}/{m.name}" == path
            )
            output = type(_new(method.output_type))
            _remember(
                pool,
                method.name,
                [output.FromString(r) for r in response]
                if response_streaming
                else output.FromString(response),
            )
        assert_alive(system)

    run()
    assert_fresh_session_is_greedy(system, reference)


def test_undecodable_bytes_are_invalid_argument(system, channels, tally):
    """A regression test: gRPC answered INTERNAL "Exception deserializing request!" (and
    logged a stack trace per call) for bytes that are not the method's message."""
    for pool, path, request_streaming, response_streaming in RAW_METHODS:
        call = raw_method(channels[pool], path, request_streaming, response_streaming)
        payload = b"\x0a\x02\xc3\x28"  # field 1, a string of invalid UTF-8 (or not a valid field)
        status, _ = tally.call(
            f"raw {path}",
            call,
            iter([payload]) if request_streaming else payload,
            timeout=TIMEOUT_S,
        )
        if status != Code.OK:  # Info and ListWorkers have no field 1: they parse it as unknown
            assert status == Code.INVALID_ARGUMENT, path
    with pytest.raises(grpc.RpcError) as error:
        raw_method(channels["orchestrator"], "/specdec.v1.Orchestrator/Generate", False, False)(
            b"\xff", timeout=TIMEOUT_S
        )
    assert error.value.code() == Code.INVALID_ARGUMENT
    assert "specdec.v1.GenerateRequest" in error.value.details()


# --- random call orders on public sessions ----------------------------------------------

SPECULATION = st.tuples(
    st.sampled_from([0, 1, 2, 4, 8]),
    st.sampled_from(["", "model", "ngram", "ngram+model"]),
    st.booleans(),
)
NEW_TOKENS = st.integers(1, 10)
SETTLE_S = 15.0  # a cancelled call unwinds within a few rounds


def _generate_request(session_id: str, tokens, speculation, max_new_tokens: int, stop=()):
    k, drafter, adaptive = speculation
    request = orchestrator_pb2.GenerateRequest(session_id=session_id, stop=list(stop))
    if tokens:
        request.token_ids.ids.extend(tokens)
    request.sampling.max_new_tokens = max_new_tokens
    request.speculation.num_speculative_tokens, request.speculation.drafter = k, drafter
    request.speculation.adaptive = adaptive
    return request


def _assembled(tokenizer, token_ids, stops, rounds) -> tuple[str, list[int]]:
    """The text and kept tokens of a generation whose rounds commit token_ids in pieces
    of the given sizes, cut before the first stop string (orchestrator.text)."""
    assembler, streamed, start = TextAssembler(tokenizer, stops), "", 0
    for size in rounds:
        _, delta = assembler.add(token_ids[start : start + size])
        streamed, start = streamed + delta, start + size
        if assembler.stopped_at is not None or start >= len(token_ids):
            break
    streamed += assembler.finish()[1]
    assert streamed == assembler.text  # the streamed deltas add up to the whole text
    return assembler.text, assembler.kept_tokens


class PublicSessions(RuleBasedStateMachine):
    """Sessions of the public API in random call orders, greedy: every answer equals
    target-only greedy decoding of what the session holds, as the model of it here
    (history) says; a closed session is NOT_FOUND; after a cancelled stream the session
    holds its history, or that plus the new input and a prefix of its continuation."""

    system = tally = reference = tokenizer = None  # set by the test
    sessions = Bundle("sessions")

    def __init__(self):
        super().__init__()
        self.history: dict[str, list[int] | None] = {}  # None: closed
        # Sessions whose cancelled call may still be unwinding: what they may hold.
        self.unsettled: dict[str, tuple[list[int], list[int]]] = {}  # id -> (before, continuation)

    def _call(self, name, function, request, expected):
        return self.tally.call(
            f"sessions {name}", function, request, timeout=TIMEOUT_S, expected=expected
        )

    def _expect_ok_or_gone(self, session_id):
        return {Code.OK} if self.history.get(session_id) is not None else {Code.NOT_FOUND}

    @rule(
        target=sessions,
        prompt=st.lists(SMALL_TOKENS, min_size=1, max_size=12),
        speculation=SPECULATION,
        max_new_tokens=NEW_TOKENS,
    )
    def generate_new(self, prompt, speculation, max_new_tokens):
        _, response = self._call(
            "Generate",
            self.system.stub.Generate,
            _generate_request("", prompt, speculation, max_new_tokens),
            {Code.OK},
        )
        assert list(response.token_ids) == self.reference(prompt, max_new_tokens), speculation
        self.history[response.session_id] = prompt + list(response.token_ids)
        return response.session_id

    @rule(target=sessions)
    def create(self):
        _, session = self._call(
            "CreateSession",
            self.system.stub.CreateSession,
            orchestrator_pb2.CreateSessionRequest(),
            {Code.OK},
        )
        self.history[session.session_id] = []
        return session.session_id

    @rule(
        session=sessions,
        new=st.lists(SMALL_TOKENS, max_size=6),
        speculation=SPECULATION,
        max_new_tokens=NEW_TOKENS,
    )
    def continue_(self, session, new, speculation, max_new_tokens):
        self._settle(session)
        history = self.history[session]
        expected = (
            {Code.NOT_FOUND}
            if history is None
            else {Code.INVALID_ARGUMENT}
            if not history + new
            else {Code.OK}
        )
        status, response = self._call(
            "Generate",
            self.system.stub.Generate,
            _generate_request(session, new, speculation, max_new_tokens),
            expected,
        )
        if status == Code.OK:
            assert list(response.token_ids) == self.reference(history + new, max_new_tokens), (
                speculation
            )
            self.history[session] = history + new + list(response.token_ids)

    @rule(
        session=sessions,
        new=st.lists(SMALL_TOKENS, max_size=4),
        sampling=messages(common_pb2.SamplingParams.DESCRIPTOR, "orchestrator"),
        speculation=messages(common_pb2.SpeculationParams.DESCRIPTOR, "orchestrator"),
    )
    def continue_with_random_fields(self, session, new, sampling, speculation):
        """Refused (nothing changes) or served (sampled tokens, whatever they are, are
        what the session then holds)."""
        self._settle(session)
        history = self.history[session]
        if sampling.max_new_tokens > 12 or sampling.max_new_tokens == 0:
            sampling.max_new_tokens = 12  # a long valid generation would only cost time
        request = orchestrator_pb2.GenerateRequest(
            session_id=session, sampling=sampling, speculation=speculation
        )
        request.token_ids.ids.extend(new)
        expected = {Code.NOT_FOUND} if history is None else {Code.OK, Code.INVALID_ARGUMENT}
        status, response = self._call(
            "Generate (random fields)", self.system.stub.Generate, request, expected
        )
        if status == Code.OK:
            self.history[session] = history + new + list(response.token_ids)
        if history is not None:
            self.get(session)  # a refused call changed nothing

    @rule(
        session=sessions,
        new=st.lists(SMALL_TOKENS, max_size=6),
        speculation=SPECULATION,
        start=st.integers(0, 40),
        width=st.integers(1, 3),
    )
    def continue_with_stop_string(self, session, new, speculation, start, width):
        self._settle(session)
        history = self.history[session]
        if history is None or not history + new:
            return
        continuation = self.reference(history + new, 10)
        text = self.tokenizer.decode(continuation, skip_special_tokens=True)
        stop = text[start % max(1, len(text)) :][:width]
        if not stop or "\ufffd" in stop:
            return  # a stop string is text: never a byte of an unfinished character
        _, response = self._call(
            "Generate",
            self.system.stub.Generate,
            _generate_request(session, new, speculation, 10, [stop]),
            {Code.OK},
        )
        expected_text, expected_kept = _assembled(
            self.tokenizer, continuation, [stop], [1] * len(continuation)
        )
        assert (response.text, list(response.token_ids)) == (expected_text, expected_kept)
        assert response.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
        self.history[session] = history + new + expected_kept

    @rule(
        session=sessions,
        new=st.lists(SMALL_TOKENS, max_size=6),
        speculation=SPECULATION,
        after=st.integers(0, 3),
    )
    def cancel_mid_stream(self, session, new, speculation, after):
        self._settle(session)
        history = self.history[session]
        if history is None or not history + new:
            return
        stream = self.system.stub.GenerateStream(
            _generate_request(session, new, speculation, 200), timeout=TIMEOUT_S
        )
        self._cancel_after(stream, after)
        self.unsettled[session] = (history, history + new + self.reference(history + new, 200))

    @rule(session=sessions, speculation=SPECULATION)
    def close_while_busy(self, session, speculation):
        """A second call on a session that a stream holds is FAILED_PRECONDITION (or,
        should the stream end first, served)."""
        self._settle(session)
        history = self.history[session]
        if not history or len(self.reference(history, 200)) < 200:
            return  # no stream that lasts
        stream = self.system.stub.GenerateStream(
            _generate_request(session, [], speculation, 200), timeout=TIMEOUT_S
        )
        next(stream)
        status, _ = self._call(
            "CloseSession (busy)",
            self.system.stub.CloseSession,
            common_pb2.CloseSessionRequest(session_id=session),
            {Code.FAILED_PRECONDITION, Code.OK},
        )
        stream.cancel()
        if status == Code.OK:
            self.history[session] = None
        else:
            self.unsettled[session] = (history, history + self.reference(history, 200))

    @rule(session=sessions)
    def close(self, session):
        self._settle(session)
        self._call(
            "CloseSession",
            self.system.stub.CloseSession,
            common_pb2.CloseSessionRequest(session_id=session),
            self._expect_ok_or_gone(session),
        )
        self.history[session] = None

    @rule(session=sessions)
    def get(self, session):
        self._settle(session)
        status, described = self._call(
            "GetSession",
            self.system.stub.GetSession,
            orchestrator_pb2.GetSessionRequest(session_id=session),
            self._expect_ok_or_gone(session),
        )
        if status == Code.OK:
            assert described.num_committed_tokens == len(self.history[session])

    @invariant()
    def processes_alive(self):
        assert_alive(self.system)

    def teardown(self):
        for session, history in self.history.items():
            if history is not None:
                self._settle(session)
                self.system.stub.CloseSession(
                    common_pb2.CloseSessionRequest(session_id=session), timeout=TIMEOUT_S
                )

    def _cancel_after(self, stream, after: int) -> None:
        try:
            for index, _ in enumerate(stream):
                if index + 1 >= after:
                    break
        except grpc.RpcError as error:
            self.tally.record(
                "sessions GenerateStream", error.code(), error.details() or "", {Code.CANCELLED}
            )
        stream.cancel()
        self.tally.record("sessions GenerateStream", Code.CANCELLED)

    def _settle(self, session) -> None:
        """After a cancelled call: probe the session with one more token once the call
        let go of it (FAILED_PRECONDITION until then), and check what it holds."""
        if session not in self.unsettled:
            return
        before, continuation = self.unsettled.pop(session)
        probe = _generate_request(session, [7], (0, "", False), 1)
        deadline = time.monotonic() + SETTLE_S
        while True:
            status, response = self._call(
                "Generate (probe)",
                self.system.stub.Generate,
                probe,
                {Code.OK, Code.FAILED_PRECONDITION},
            )
            if status == Code.OK or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == Code.OK, (
            f"session {session} still busy {SETTLE_S} s after its call was cancelled"
        )
        _, described = self._call(
            "GetSession",
            self.system.stub.GetSession,
            orchestrator_pb2.GetSessionRequest(session_id=session),
            {Code.OK},
        )
        held = described.num_committed_tokens - 2  # before the probe's input and token
        prefix = before if held == len(before) else continuation[:held]
        assert held == len(before) or len(before) < held <= len(continuation), (
            held,
            len(before),
            len(continuation),
        )
        assert list(response.token_ids) == self.reference(prefix + [7], 1)
        self.history[session] = prefix + [7] + list(response.token_ids)


def test_random_call_orders_on_public_sessions(system, tally, reference, tiny_target):
    PublicSessions.system, PublicSessions.tally = system, tally
    PublicSessions.reference, PublicSessions.tokenizer = reference, tiny_target.tokenizer
    run_state_machine_as_test(PublicSessions, settings=fuzz_settings(12, steps=10))
    assert_fresh_session_is_greedy(system, reference)


# --- random call orders on the workers' sessions ---------------------------------------

SIDES = st.sampled_from(["target", "draft"])


class Lockstep:
    """A Verify stream fed one proposal at a time: each verdict is read before the next
    proposal is made from it."""

    def __init__(self, stub):
        self._requests: queue.Queue = queue.Queue()
        self._verdicts = stub.Verify(iter(self._requests.get, None), timeout=TIMEOUT_S)

    def send(self, proposal) -> None:
        self._requests.put(proposal)

    def receive(self):
        return next(self._verdicts)

    def close(self) -> None:
        self._requests.put(None)
        for _ in self._verdicts:
            pass


@dataclass
class Pair:
    """A target session and a draft session opened on the same prompt, and what each
    holds as far as the model here knows (None: closed). dirty: a cancelled call may have
    run past that (a round in flight): the protocol truncates before the next call."""

    target_id: str
    draft_id: str
    drafter: str
    tokens: dict  # side -> list[int] | None
    dirty: set = dataclasses.field(default_factory=set)


class WorkerSessions(RuleBasedStateMachine):
    """The workers' sessions in random call orders, greedy, against the target-only
    reference: after any sequence of extend / truncate / decode / verify / speculate /
    cancel / close, every token a target answers with is the greedy continuation of
    what its session holds; a speculating draft whose own tokens differ from the
    target's still produces exactly the target's tokens."""

    system = tally = reference = channels = None  # set by the test
    pairs = Bundle("pairs")

    def __init__(self):
        super().__init__()
        self.target = target_pb2_grpc.TargetServiceStub(self.channels["target"])
        self.draft = draft_pb2_grpc.DraftServiceStub(self.channels["draft"])
        self.opened: list[Pair] = []

    def _stub(self, side):
        return self.target if side == "target" else self.draft

    def _id(self, pair, side):
        return pair.target_id if side == "target" else pair.draft_id

    def _call(self, name, function, request, expected):
        return self.tally.call(
            f"workers {name}", function, request, timeout=TIMEOUT_S, expected=expected
        )

    @rule(
        target=pairs,
        prompt=st.lists(SMALL_TOKENS, min_size=1, max_size=10),
        drafter=st.sampled_from(["", "model", "ngram", "ngram+model"]),
    )
    def open_pair(self, prompt, drafter):
        _, opened_target = self._call(
            "target OpenSession",
            self.target.OpenSession,
            target_pb2.OpenSessionRequest(prompt_token_ids=prompt),
            {Code.OK},
        )
        _, opened_draft = self._call(
            "draft OpenSession",
            self.draft.OpenSession,
            draft_pb2.DraftOpenSessionRequest(prompt_token_ids=prompt, drafter=drafter),
            {Code.OK},
        )
        assert (
            opened_target.handle.committed_len == opened_draft.handle.committed_len == len(prompt)
        )
        pair = Pair(
            opened_target.handle.session_id,
            opened_draft.handle.session_id,
            drafter or "ngram",
            {"target": list(prompt), "draft": list(prompt)},
        )
        self.opened.append(pair)
        return pair

    @rule(pair=pairs, side=SIDES, prompt=st.lists(SMALL_TOKENS, min_size=1, max_size=6))
    def open_with_a_used_id(self, pair, side, prompt):
        """ALREADY_EXISTS while the session lives; a closed id may be used again."""
        session_id = self._id(pair, side)
        request = (
            target_pb2.OpenSessionRequest(session_id=session_id, prompt_token_ids=prompt)
            if side == "target"
            else draft_pb2.DraftOpenSessionRequest(
                session_id=session_id, prompt_token_ids=prompt, drafter=pair.drafter
            )
        )
        closed = pair.tokens[side] is None
        self._settle(pair, side)
        status, _ = self._call(
            f"{side} OpenSession",
            self._stub(side).OpenSession,
            request,
            {Code.OK} if closed else {Code.ALREADY_EXISTS},
        )
        if status == Code.OK:
            pair.tokens[side] = list(prompt)

    @rule(
        pair=pairs,
        side=SIDES,
        new=st.lists(SMALL_TOKENS, max_size=6),
        off=st.sampled_from([0, 0, 0, -1, 1, 5]),
    )
    def extend(self, pair, side, new, off):
        held = self._settle(pair, side)
        expected = (
            {Code.NOT_FOUND} if held is None else {Code.FAILED_PRECONDITION} if off else {Code.OK}
        )
        if held is not None and not new:  # "no token ids given" (the first check that fails)
            expected = {Code.INVALID_ARGUMENT} | (expected - {Code.OK})
        status, response = self._call(
            f"{side} Extend",
            self._stub(side).Extend,
            common_pb2.ExtendRequest(
                session_id=self._id(pair, side), base_len=len(held or []) + off, token_ids=new
            ),
            expected,
        )
        if status == Code.OK:
            held += new
            assert response.committed_len == len(held)

    @rule(pair=pairs, side=SIDES, length=st.integers(-1, 40))
    def truncate(self, pair, side, length):
        held = self._settle(pair, side)
        expected = (
            {Code.NOT_FOUND}
            if held is None
            else {Code.OK}
            if 1 <= length <= len(held)
            else {Code.INVALID_ARGUMENT}
        )
        status, response = self._call(
            f"{side} Truncate",
            self._stub(side).Truncate,
            common_pb2.TruncateRequest(session_id=self._id(pair, side), length=length),
            expected,
        )
        if status == Code.OK:
            del held[length:]
            assert response.committed_len == length

    @rule(pair=pairs, max_new_tokens=st.integers(1, 8), off=st.sampled_from([0, 0, 0, -1, 2]))
    def decode(self, pair, max_new_tokens, off):
        held = self._settle(pair, "target")
        expected = (
            {Code.NOT_FOUND} if held is None else {Code.FAILED_PRECONDITION} if off else {Code.OK}
        )
        request = target_pb2.DecodeRequest(
            session_id=pair.target_id,
            base_len=len(held or []) + off,
            sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens),
        )
        status, tokens = self._call("target Decode", self.target.Decode, request, expected)
        if status == Code.OK:
            out = [t.token_id for t in tokens]
            assert out == self.reference(held, max_new_tokens)
            assert [t.committed_len for t in tokens] == list(
                range(len(held) + 1, len(held) + len(out) + 1)
            )
            held += out

    @rule(pair=pairs, after=st.integers(0, 3))
    def decode_cancelled(self, pair, after):
        held = self._settle(pair, "target")
        if held is None:
            return
        stream = self.target.Decode(
            target_pb2.DecodeRequest(
                session_id=pair.target_id,
                base_len=len(held),
                sampling=common_pb2.SamplingParams(max_new_tokens=100),
            ),
            timeout=TIMEOUT_S,
        )
        received = _read_then_cancel(stream, after, self.tally, "workers target Decode")
        out = [t.token_id for t in received]
        assert out == self.reference(held, 100)[: len(out)]
        held += out
        pair.dirty.add("target")

    @rule(
        pair=pairs,
        rounds=st.lists(
            st.tuples(
                st.integers(0, 5),
                st.integers(0, 6),
                st.sampled_from([0, 0, 0, -1, 1]),
                st.booleans(),
                st.booleans(),
            ),
            min_size=1,
            max_size=4,
        ),
    )
    def verify(self, pair, rounds):
        """Proposals right for their first `right` tokens of k (greedy, deterministic),
        stale ones (a wrong base_len or last token: discarded in-band), stretches."""
        held = self._settle(pair, "target")
        if held is None:
            proposals = iter(
                [
                    target_pb2.Proposal(
                        session_id=pair.target_id, base_len=1, draft=target_pb2.Draft(token_ids=[1])
                    )
                ]
            )
            self._call("target Verify", self.target.Verify, proposals, {Code.NOT_FOUND})
            return
        stream = Lockstep(self.target)
        try:
            for index, (k, right, off, wrong_last, stretch) in enumerate(rounds):
                proposal = target_pb2.Proposal(session_id=pair.target_id, base_len=len(held) + off)
                if index == 0:  # greedy from here on, whatever an earlier call set
                    proposal.sampling.max_new_tokens = 1000
                if wrong_last and held:
                    proposal.expected_last_token_id = (held[-1] + 1) % (TINY_VOCAB_SIZE - 1)
                if stretch:
                    proposal.stretch.max_tokens = k + 1
                    expected_tokens = self.reference(held, k + 1)
                else:
                    draft = self.reference(held, k)
                    if right < k:
                        draft[right] = (draft[right] + 1) % (TINY_VOCAB_SIZE - 1)
                    proposal.draft.token_ids.extend(draft)
                    accepted = min(right, k)
                    expected_tokens = draft[:accepted] + self.reference(held + draft[:accepted], 1)
                stream.send(proposal)
                stale = off != 0 or (wrong_last and held)
                verdicts = [stream.receive()]
                while stretch and not stale and not verdicts[-1].stretch_pass.ended:
                    verdicts.append(stream.receive())
                if stale:
                    assert verdicts[0].discarded.committed_len == len(held)
                    assert verdicts[0].WhichOneof("kind") == "discarded"
                    continue
                decisions = [v.stretch_pass.decision if stretch else v.decision for v in verdicts]
                if stretch:
                    tokens = [d.next_token_id for d in decisions]
                else:
                    tokens = list(proposal.draft.token_ids[: decisions[0].num_accepted]) + [
                        decisions[0].next_token_id
                    ]
                assert tokens == expected_tokens, (k, right, stretch)
                held += tokens
                assert decisions[-1].committed_len == len(held)
            stream.close()
            self.tally.record("workers target Verify", Code.OK)
        except grpc.RpcError as error:
            self.tally.record(
                "workers target Verify", error.code(), error.details() or "", {Code.OK}
            )

    @rule(
        pair=pairs,
        k=st.sampled_from([1, 2, 4, 8]),
        max_new_tokens=st.integers(1, 12),
        drafter=st.sampled_from(["", "", "same", "other"]),
        adaptive=st.booleans(),
        cancel_after=st.none() | st.integers(0, 2),
    )
    def speculate(self, pair, k, max_new_tokens, drafter, adaptive, cancel_after):
        """The target decides every token, whatever the draft session holds."""
        target_held, draft_held = self._settle(pair, "target"), self._settle(pair, "draft")
        requested = {
            "": "",
            "same": pair.drafter,
            "other": "model" if pair.drafter != "model" else "ngram",
        }[drafter]
        # Each thing wrong with the call is a status it may get (the first check that fails).
        expected = {Code.NOT_FOUND} if draft_held is None or target_held is None else set()
        if draft_held is not None and drafter == "other":
            expected.add(Code.INVALID_ARGUMENT)
        if draft_held is not None and len(draft_held) != len(target_held or []):
            expected.add(Code.FAILED_PRECONDITION)
        expected = expected or {Code.OK}
        base_len = len(draft_held or [])
        request = draft_pb2.SpeculateRequest(
            session_id=pair.draft_id,
            base_len=base_len,
            target=common_pb2.KvHandle(
                worker_address=ADDRESSES["target"],
                session_id=pair.target_id,
                committed_len=len(target_held or []),
            ),
            sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens),
            speculation=common_pb2.SpeculationParams(
                num_speculative_tokens=k, drafter=requested, adaptive=adaptive
            ),
        )
        if cancel_after is not None and expected == {Code.OK}:
            received = _read_then_cancel(
                self.draft.Speculate(request, timeout=TIMEOUT_S),
                cancel_after,
                self.tally,
                "workers draft Speculate",
            )
            pair.dirty |= {"target", "draft"}
        else:
            status, received = self._call(
                "draft Speculate", self.draft.Speculate, request, expected
            )
            if status != Code.OK:
                return
        out = [t for update in received for t in update.token_ids]
        assert out == self.reference(target_held, max_new_tokens)[: len(out)]
        if cancel_after is None:
            assert len(out) == max_new_tokens and received[-1].finished
        target_held += out
        draft_held += out

    @rule(
        pair=pairs,
        draft=st.lists(st.one_of(SMALL_TOKENS, I32), max_size=5),
        distributions=st.lists(
            messages(common_pb2.SparseDistribution.DESCRIPTOR, "target"), max_size=5
        ),
        sampling=st.none() | messages(common_pb2.SamplingParams.DESCRIPTOR, "target"),
        stretch=st.none() | messages(target_pb2.Stretch.DESCRIPTOR, "target"),
    )
    def verify_with_random_fields(self, pair, draft, distributions, sampling, stretch):
        """A proposal at the right length with random tokens, distributions (NaN,
        negative, not summing to 1, outside the vocabulary), sampling or stretch:
        refused with INVALID_ARGUMENT and nothing applied, or served and its verdicts
        are what the session then holds."""
        held = self._settle(pair, "target")
        if held is None:
            return
        proposal = target_pb2.Proposal(
            session_id=pair.target_id,
            base_len=len(held),
            draft=target_pb2.Draft(token_ids=draft, distributions=distributions),
        )
        if sampling is not None:
            proposal.sampling.CopyFrom(sampling)
        if stretch is not None:
            stretch.max_tokens = min(stretch.max_tokens, 8)  # a long stretch would only cost time
            proposal.stretch.CopyFrom(stretch)
        status, verdicts = self._call(
            "target Verify (random fields)",
            self.target.Verify,
            iter([proposal]),
            {Code.OK, Code.INVALID_ARGUMENT},
        )
        for verdict in verdicts or []:
            assert verdict.WhichOneof("kind") == ("decision" if stretch is None else "stretch_pass")
            decision = verdict.decision if stretch is None else verdict.stretch_pass.decision
            accepted = (
                draft[: decision.num_accepted]
                if stretch is None
                else verdict.stretch_pass.accepted_token_ids
            )
            held += list(accepted) + [decision.next_token_id]
            assert decision.committed_len == len(held)

    @rule(
        pair=pairs,
        sampling=messages(common_pb2.SamplingParams.DESCRIPTOR, "draft"),
        speculation=messages(common_pb2.SpeculationParams.DESCRIPTOR, "draft"),
    )
    def speculate_with_random_fields(self, pair, sampling, speculation):
        """Refused, or served: both sessions then hold the tokens it streamed."""
        target_held, draft_held = self._settle(pair, "target"), self._settle(pair, "draft")
        if target_held is None or draft_held is None or len(target_held) != len(draft_held):
            return
        if sampling.max_new_tokens > 12 or sampling.max_new_tokens == 0:
            sampling.max_new_tokens = 12  # a long valid generation would only cost time
        request = draft_pb2.SpeculateRequest(
            session_id=pair.draft_id,
            base_len=len(draft_held),
            sampling=sampling,
            speculation=speculation,
            target=common_pb2.KvHandle(
                worker_address=ADDRESSES["target"],
                session_id=pair.target_id,
                committed_len=len(target_held),
            ),
        )
        status, updates = self._call(
            "draft Speculate (random fields)",
            self.draft.Speculate,
            request,
            {Code.OK, Code.INVALID_ARGUMENT},
        )
        out = [t for update in updates or [] for t in update.token_ids]
        target_held += out
        draft_held += out
        if updates:
            assert updates[-1].committed_len == len(target_held)

    @rule(pair=pairs, side=SIDES)
    def close(self, pair, side):
        self._settle(pair, side)
        self._call(
            f"{side} CloseSession",
            self._stub(side).CloseSession,
            common_pb2.CloseSessionRequest(session_id=self._id(pair, side)),
            {Code.OK},
        )
        pair.tokens[side] = None

    @invariant()
    def processes_alive(self):
        assert_alive(self.system)

    def teardown(self):
        for pair in self.opened:
            for side in ("target", "draft"):
                self._settle(pair, side)
                self._stub(side).CloseSession(
                    common_pb2.CloseSessionRequest(session_id=self._id(pair, side)),
                    timeout=TIMEOUT_S,
                )

    def _settle(self, pair, side):
        """What the side's session holds; after a cancelled call, once that call let go
        of it, truncated back to the tokens the client saw (the protocol's rollback)."""
        held = pair.tokens[side]
        if side not in pair.dirty:
            return held
        pair.dirty.discard(side)
        if held is None:
            return held
        if side == "target":
            _wait_until_idle(self.target)  # the draft-side lock serializes the draft's calls
        self._call(
            f"{side} Truncate",
            self._stub(side).Truncate,
            common_pb2.TruncateRequest(session_id=self._id(pair, side), length=len(held)),
            {Code.OK},
        )
        return held


def _read_then_cancel(stream, after: int, tally, name: str) -> list:
    received = []
    try:
        for message in stream:
            if len(received) >= after:
                break
            received.append(message)
    except grpc.RpcError as error:
        tally.record(name, error.code(), error.details() or "", {Code.CANCELLED})
    stream.cancel()
    tally.record(name, Code.CANCELLED)
    return received


def _wait_until_idle(target_stub) -> None:
    """Until the target runs no call: a cancelled stream's handler has returned."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        load = target_stub.Info(common_pb2.InfoRequest(), timeout=TIMEOUT_S).load
        if load.running_calls == 0 and load.queued_calls == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the target still runs calls {SETTLE_S} s after they were cancelled")


def test_random_call_orders_on_worker_sessions(system, channels, tally, worker_reference):
    WorkerSessions.system, WorkerSessions.tally = system, tally
    WorkerSessions.reference, WorkerSessions.channels = worker_reference, channels
    run_state_machine_as_test(WorkerSessions, settings=fuzz_settings(12, steps=12))


def test_no_session_is_left_on_the_workers(system, channels, tally, reference):
    """Once every session the fuzzing opened is closed (the public ones through the
    orchestrator, the workers' own directly), the workers hold none: nothing leaked,
    cancelled streams included."""
    stubs = {
        "target": target_pb2_grpc.TargetServiceStub(channels["target"]),
        "draft": draft_pb2_grpc.DraftServiceStub(channels["draft"]),
    }
    for session_id in LIVE.all["orchestrator"]:
        tally.call(
            "cleanup Orchestrator.CloseSession",
            system.stub.CloseSession,
            common_pb2.CloseSessionRequest(session_id=session_id),
            timeout=TIMEOUT_S,
            expected={Code.OK, Code.NOT_FOUND},
        )
    for pool, stub in stubs.items():
        for session_id in LIVE.all[pool]:
            stub.CloseSession(
                common_pb2.CloseSessionRequest(session_id=session_id), timeout=TIMEOUT_S
            )
    assert wait_for_no_worker_sessions(channels) == {"target": 0, "draft": 0}
    assert_fresh_session_is_greedy(system, reference)
    assert_alive(system)


# --- what the fuzzing found: each a regression test -------------------------------------


def test_an_extend_of_no_tokens_is_invalid_argument_on_both_workers(channels):
    """The target answered OK (and changed nothing), the draft INVALID_ARGUMENT."""
    for stub, request in (
        (
            target_pb2_grpc.TargetServiceStub(channels["target"]),
            target_pb2.OpenSessionRequest(prompt_token_ids=[5, 6]),
        ),
        (
            draft_pb2_grpc.DraftServiceStub(channels["draft"]),
            draft_pb2.DraftOpenSessionRequest(prompt_token_ids=[5, 6]),
        ),
    ):
        session_id = stub.OpenSession(request, timeout=TIMEOUT_S).handle.session_id
        with pytest.raises(grpc.RpcError) as error:
            stub.Extend(
                common_pb2.ExtendRequest(session_id=session_id, base_len=2), timeout=TIMEOUT_S
            )
        assert (
            error.value.code() == Code.INVALID_ARGUMENT
            and "no token ids given" in error.value.details()
        )
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=TIMEOUT_S)


def test_malformed_requests_hold_no_slot_of_the_server(system, reference):
    """The orchestrator counted a call in when gRPC looked its handler up and out when
    the handler ended; a malformed request's handler never ran, so each one held a slot
    for good and after 128 of them (max_concurrent_calls) every call was refused with
    RESOURCE_EXHAUSTED. Twice that many, then a normal request."""
    generate = raw_method(system.channels[0], "/specdec.v1.Orchestrator/Generate", False, False)
    for _ in range(256):
        with pytest.raises(grpc.RpcError) as error:
            generate(b"\xff", timeout=TIMEOUT_S)
        assert error.value.code() == Code.INVALID_ARGUMENT
    assert_fresh_session_is_greedy(system, reference)


def test_a_call_whose_client_left_before_it_ran_holds_no_slot():
    """The same leak by another path: calls queued behind a busy thread pool whose
    deadline passed before a thread took them never run, and held their slot for good.
    One server thread, held by a slow call; ten quick calls time out in the queue."""
    limits = CallLimits(max_calls=32)
    release_slow = threading.Event()
    slow_running = threading.Event()

    def slow(request, context):
        slow_running.set()
        release_slow.wait(10)
        return request

    handlers = {
        "Slow": grpc.unary_unary_rpc_method_handler(slow),
        "Fast": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=1), interceptors=[ApiGate(None, limits)]
    )
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("fuzz.Test", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            slow_call = channel.unary_unary("/fuzz.Test/Slow").future(b"x", timeout=10)
            assert slow_running.wait(10)  # it holds the only thread: the quick calls queue
            fast = channel.unary_unary("/fuzz.Test/Fast")
            for _ in range(10):
                with pytest.raises(grpc.RpcError) as error:
                    fast(b"x", timeout=0.2)
                assert error.value.code() == Code.DEADLINE_EXCEEDED
            release_slow.set()
            assert slow_call.result() == b"x"
            deadline = time.monotonic() + 10
            while limits.in_flight() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert limits.in_flight() == 0
            assert fast(b"y", timeout=10) == b"y"
    finally:
        server.stop(None)


class _CancelOnSave(InMemorySessionStore):
    """The client cancels while the call saves its session (after the call checked that
    its client was still there)."""

    def __init__(self, context):
        super().__init__(ttl_s=600)
        self.context = context

    def put(self, record, lease=None):
        super().put(record, lease)
        self.context.active = False


class _Context:
    def __init__(self):
        self.active = True

    def is_active(self):
        return self.active

    def time_remaining(self):
        return None

    def add_callback(self, callback):
        return True


class _Target:
    """A target stub: one-token decodes; records the sessions closed."""

    def __init__(self):
        self.closed = []

    def OpenSession(self, request, timeout):
        handle = common_pb2.KvHandle(
            worker_id="t", session_id="s", committed_len=len(request.prompt_token_ids)
        )
        return target_pb2.OpenSessionResponse(handle=handle)

    def Decode(self, request, timeout):
        return _Stream([target_pb2.DecodeToken(token_id=7, committed_len=request.base_len + 1)])

    def Truncate(self, request, timeout):
        return common_pb2.TruncateResponse(committed_len=request.length)

    def CloseSession(self, request, timeout):
        self.closed.append(request.session_id)
        return common_pb2.CloseSessionResponse()


class _Stream(list):
    def cancel(self):
        return True


class _Pool:
    def __init__(self, worker):
        self.worker = worker

    def pick_target(self):
        return self.worker

    def placed(self, worker):
        return contextlib.nullcontext(worker)

    def by_address(self, pool, address):
        return self.worker if pool == "target" and address == self.worker.address else None


class _Tokenizer:
    eos_token_id = None

    def decode(self, token_ids, skip_special_tokens=True):
        return "x" * len(token_ids)


@pytest.mark.parametrize("client_reads_the_last_chunk", [True, False])
def test_a_call_cancelled_while_it_saves_frees_its_new_session(client_reads_the_last_chunk):
    """The soak left sessions behind: a stream cancelled by its client after the call
    had checked that its client was there and while it saved the new session (its
    generation had ended at once: one token) kept that session until its TTL."""
    context, target = _Context(), _Target()
    worker = Worker(
        "target",
        common_pb2.Worker(
            worker_id="t",
            address="t:1",
            model=common_pb2.ModelInfo(context_length=64, vocab_size=TINY_VOCAB_SIZE),
        ),
        target,
    )
    store = _CancelOnSave(context)
    request = _generate_request("", [5, 17, 99], (0, "", False), 1)
    generation = Generation(
        OrchestratorConfig(), _Pool(worker), store, _Tokenizer(), request, context
    )
    chunks = generation.run()
    if client_reads_the_last_chunk:  # a unary Generate: the servicer reads all of it
        assert [t for c in chunks for t in c.token_ids] == [7]
    else:  # a stream: gRPC drops the stream at the last chunk, which cannot be sent
        while not next(chunks).finish_reason:
            pass
        chunks.close()
    assert target.closed == ["s"]
    with pytest.raises(NotFound):
        store.get(generation.session_id)


def test_speculate_against_an_address_that_is_no_target_is_invalid_argument(system, channels):
    """It was UNIMPLEMENTED ("downstream: ... Method not found!"), passed on from the
    draft or orchestrator that the address reached."""
    draft = draft_pb2_grpc.DraftServiceStub(channels["draft"])
    session_id = draft.OpenSession(
        draft_pb2.DraftOpenSessionRequest(prompt_token_ids=[5, 6]), timeout=TIMEOUT_S
    ).handle.session_id
    for pool in ("draft", "orchestrator"):
        request = draft_pb2.SpeculateRequest(
            session_id=session_id,
            base_len=2,
            target=common_pb2.KvHandle(
                worker_address=ADDRESSES[pool], session_id="t", committed_len=2
            ),
        )
        with pytest.raises(grpc.RpcError) as error:
            list(draft.Speculate(request, timeout=TIMEOUT_S))
        assert (
            error.value.code() == Code.INVALID_ARGUMENT
            and "serves no TargetService" in error.value.details()
        )
    draft.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=TIMEOUT_S)


def test_the_step_scheduler_forgets_the_sessions_it_served():
    """Found looking into the soak's memory: the target's step scheduler kept the
    turn-around of every session it ever served (about 300 bytes each) when it served
    one call at a time, the only case in which it never pruned them."""
    turnarounds = _Turnarounds()
    for index in range(10_000):  # one session after another, each served once
        now_ns = index * 10**7
        turnarounds.back(f"session-{index}", now_ns)
        turnarounds.left(f"session-{index}", now_ns + 10**6)
    kept = FORGET_AFTER_NS // 10**7 + 1  # the sessions of the last minute
    assert len(turnarounds._away_since) <= kept and len(turnarounds._mean_ns) <= kept


def test_a_chat_with_no_messages_is_invalid_argument(system):
    """It was INTERNAL: the chat template raised on an empty conversation."""
    with pytest.raises(grpc.RpcError) as error:
        system.stub.Generate(
            orchestrator_pb2.GenerateRequest(chat=orchestrator_pb2.ChatMessages()),
            timeout=TIMEOUT_S,
        )
    assert error.value.code() == Code.INVALID_ARGUMENT
    assert "prompt is empty" in error.value.details()


def test_a_session_continues_with_another_drafter(system, reference):
    """It was INVALID_ARGUMENT from the draft worker ("opened with drafter 'ngram', not
    'model'"): the session's draft session keeps its drafter, so the orchestrator now
    opens another one for a call that asks for another drafter."""
    prompt = [5, 17, 99, 3]
    history = list(prompt)
    session_id = ""
    for drafter in ("ngram", "model", "ngram+model", "", "model"):
        new = prompt if not session_id else [9]
        response = system.stub.Generate(
            _generate_request(session_id, new, (3, drafter, False), 6), timeout=TIMEOUT_S
        )
        history += [] if not session_id else new
        assert list(response.token_ids) == reference(history, 6), drafter
        history += list(response.token_ids)
        session_id = response.session_id
    system.stub.CloseSession(
        common_pb2.CloseSessionRequest(session_id=session_id), timeout=TIMEOUT_S
    )


def test_a_stop_string_completed_by_a_multi_byte_character_is_never_streamed(tiny_target):
    """The text before an unfinished multi-byte character was released without holding
    back the characters that could begin a stop string: with rounds of 3 and 7 tokens,
    "~" went out although the next round completed "~\u0548" (the stop string) and the
    session kept a token of it."""
    tokens = [
        228,
        93,
        145,
        230,
        57,
        64,
        12,
        145,
        149,
        9,
    ]  # "\ufffd~\u0548Za-..." in the tiny byte-level vocabulary
    assert _assembled(tiny_target.tokenizer, tokens, ["~\u0548"], [3, 7]) == ("\ufffd", [228])


@fuzz_settings(300)
@given(
    data=st.one_of(
        st.lists(st.integers(0, TINY_VOCAB_SIZE - 1), min_size=1, max_size=24),
        st.text(min_size=1, max_size=12),
    ),
    start=st.integers(0, 60),
    width=st.integers(1, 4),
    rounds=st.lists(st.integers(1, 9), min_size=40, max_size=40),
)
def test_stop_strings_cut_the_same_text_whatever_the_rounds(
    tiny_target, data, start, width, rounds
):
    """How rounds split the tokens never changes the text, the tokens kept or where a
    stop string cuts them; the text never contains the stop string. Tokens are random,
    or the bytes of random text (one token per byte: multi-byte characters split)."""
    tokens = tiny_target.tokenizer(data).input_ids if isinstance(data, str) else data
    text = tiny_target.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = text[start % max(1, len(text)) :][:width]
    if not stop or "\ufffd" in stop:
        return
    one_at_a_time = _assembled(tiny_target.tokenizer, tokens, [stop], [1] * len(tokens))
    assert _assembled(tiny_target.tokenizer, tokens, [stop], rounds) == one_at_a_time
    assert stop not in one_at_a_time[0]
