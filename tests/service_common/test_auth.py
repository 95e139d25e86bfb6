"""API keys on the public API, with real processes: the orchestrator started by the
launcher with `--api-keys FILE` (hashes made by `python -m service_common.auth add`).

No key, a malformed one or an unknown one: UNAUTHENTICATED, the same words for all.
Another key's session: NOT_FOUND, the same words as a session that never existed.
Health and reflection answer without a key.
"""

from __future__ import annotations

import io
import time
import uuid
from contextlib import redirect_stdout
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from foundation.errors import InvalidArgument
from service_common import auth
from service_common.server import channel
from specdec.v1 import common_pb2, orchestrator_pb2
from tests.local_system import LocalSystem

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def add_key(name: str, path: Path) -> str:
    """`python -m service_common.auth add NAME FILE`: the key it prints."""
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert auth.main(["add", name, str(path)]) == 0
    return printed.getvalue().strip()


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("keys") / "api-keys"


@pytest.fixture(scope="module")
def keys(keys_file) -> dict[str, str]:
    return {name: add_key(name, keys_file) for name in ("alice", "bob")}


@pytest.fixture(scope="module")
def system(keys, keys_file):
    with LocalSystem(api_keys=str(keys_file), draft_workers=0) as local:
        yield local


def _generate(ids=(5, 17, 99), session_id="") -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(session_id=session_id)
    request.token_ids.ids.extend(ids)
    request.sampling.max_new_tokens = 4
    request.speculation.num_speculative_tokens = 0
    return request


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        result = call()
        if hasattr(result, "__next__"):  # a stream fails on its first message
            next(result)
    return refused.value


def test_the_keys_file_holds_hashes_only(keys, keys_file):
    text = keys_file.read_text()
    assert all(key not in text for key in keys.values())
    assert [line.split()[0] for line in text.splitlines()] == ["alice", "bob"]
    assert keys_file.stat().st_mode & 0o077 == 0  # readable by its owner only


def test_no_key_a_wrong_key_or_a_malformed_one_is_unauthenticated(system, keys):
    stub = system.stub
    calls = {
        "Generate": lambda md: stub.Generate(_generate(), timeout=30, metadata=md),
        "GenerateStream": lambda md: stub.GenerateStream(_generate(), timeout=30, metadata=md),
        "CreateSession": lambda md: stub.CreateSession(
            orchestrator_pb2.CreateSessionRequest(), timeout=30, metadata=md
        ),
        "GetSession": lambda md: stub.GetSession(
            orchestrator_pb2.GetSessionRequest(session_id="x"), timeout=30, metadata=md
        ),
        "CloseSession": lambda md: stub.CloseSession(
            common_pb2.CloseSessionRequest(session_id="x"), timeout=30, metadata=md
        ),
        "ListWorkers": lambda md: stub.ListWorkers(
            orchestrator_pb2.ListWorkersRequest(), timeout=30, metadata=md
        ),
    }
    presented = {
        "no key": None,
        "unknown key": bearer(auth.new_key()),
        "a key's hash": bearer(auth.hash_key(keys["alice"])),
        "another scheme": [("authorization", f"Basic {keys['alice']}")],
        "empty bearer": [("authorization", "Bearer ")],
    }
    for method, call in calls.items():
        for what, metadata in presented.items():
            error = _refusal(lambda call=call, metadata=metadata: call(metadata))
            assert (error.code(), error.details()) == (UNAUTHENTICATED, auth.REFUSAL), (
                method,
                what,
            )
        try:  # with a key the call gets through (to NOT_FOUND for the session "x")
            result = call(bearer(keys["alice"]))
            if hasattr(result, "__next__"):
                list(result)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND, (method, error)


def test_health_and_reflection_answer_without_a_key(system):
    with channel(system.address) as open_channel:
        reply = health_pb2_grpc.HealthStub(open_channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answers = reflection_pb2_grpc.ServerReflectionStub(open_channel).ServerReflectionInfo(
            iter([request]), timeout=10
        )
        services = {s.name for answer in answers for s in answer.list_services_response.service}
    assert "specdec.v1.Orchestrator" in services


def test_another_keys_session_is_not_found_as_if_it_never_existed(system, keys):
    stub, alice, bob = system.stub, bearer(keys["alice"]), bearer(keys["bob"])
    session_id = stub.Generate(_generate(), timeout=60, metadata=alice).session_id
    never = uuid.uuid4().hex

    def refusals(sid: str, metadata) -> list[tuple[grpc.StatusCode, str]]:
        calls = [
            lambda: stub.GetSession(
                orchestrator_pb2.GetSessionRequest(session_id=sid), timeout=30, metadata=metadata
            ),
            lambda: stub.Generate(_generate(session_id=sid), timeout=30, metadata=metadata),
            lambda: stub.GenerateStream(_generate(session_id=sid), timeout=30, metadata=metadata),
            lambda: stub.CloseSession(
                common_pb2.CloseSessionRequest(session_id=sid), timeout=30, metadata=metadata
            ),
        ]
        return [(e.code(), e.details().replace(sid, "ID")) for e in map(_refusal, calls)]

    foreign = refusals(session_id, bob)
    assert foreign == refusals(never, alice)  # word for word what a session that never existed gets
    assert {code for code, _ in foreign} == {grpc.StatusCode.NOT_FOUND}
    # The owner's session is untouched: it continues and closes.
    follow_up = stub.Generate(
        _generate(ids=(8, 9), session_id=session_id), timeout=60, metadata=alice
    )
    assert follow_up.session_id == session_id
    stub.CloseSession(
        common_pb2.CloseSessionRequest(session_id=session_id), timeout=30, metadata=alice
    )


def test_a_key_added_to_the_file_works_without_a_restart(system, keys_file):
    carol = add_key("carol", keys_file)
    deadline = time.monotonic() + 30
    while True:  # the file is re-read when it changes, within seconds
        try:
            system.stub.ListWorkers(
                orchestrator_pb2.ListWorkersRequest(), timeout=10, metadata=bearer(carol)
            )
            break
        except grpc.RpcError as error:
            assert error.code() == UNAUTHENTICATED and time.monotonic() < deadline, error
            time.sleep(0.2)


def test_parse_keys_names_the_bad_line():
    good = f"# team keys\nalice {auth.hash_key('k1')}\n\nalice {auth.hash_key('k2')}  # rotated\n"
    assert sorted(auth.parse_keys(good).values()) == ["alice", "alice"]  # two keys of one caller
    for bad in (
        "alice",
        "alice sha256:00",
        f"al ice {auth.hash_key('k')}",
        f"alice md5:{'0' * 64}",
    ):
        with pytest.raises(InvalidArgument, match="line 2: expected 'NAME sha256:<64 hex digits>'"):
            auth.parse_keys(f"# header\n{bad}\n")


def test_bearer_key_reads_the_first_authorization_entry():
    assert auth.bearer_key([("x-other", "1"), ("authorization", "bearer  sk-abc ")]) == "sk-abc"
    assert auth.bearer_key([("authorization", "Token sk-abc")]) is None
    assert auth.bearer_key(()) is None


def test_the_hash_command_prints_a_keys_file_line(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-secret\n"))
    assert auth.main(["hash", "dave"]) == 0
    assert capsys.readouterr().out.strip() == f"dave {auth.hash_key('sk-secret')}"
