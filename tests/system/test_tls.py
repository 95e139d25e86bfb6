"""Mutual TLS between every pair of roles, with real processes and real certificates.

The system: a target, a draft and an orchestrator as processes started with `tls=True`
(the launcher's `--tls`: a throwaway CA and a certificate per role), workers registered
in a real redis-server. Its greedy output equals target-only decoding; a client or a
worker whose certificate the cluster CA did not sign is refused at the handshake, and a
worker registered in Redis without such a certificate never joins a pool. Redis over
TLS (`rediss://`) is checked with a redis-server of its own on a TLS port.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.__main__ import main as client_main
from foundation.errors import InvalidArgument
from launcher.cluster import free_port, tls_files
from orchestrator.redis_store import RedisSessionStore
from orchestrator.store import SessionRecord
from service_common.registry import WorkerRegistry
from service_common.security import Tls, write_throwaway_pki
from service_common.server import channel
from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2_grpc
from speculative.generator import SpeculativeGenerator
from speculative.sampling import SamplingParams
from tests import polling
from tests.local_system import LocalSystem
from tests.redis_server import RedisServer

MAX_NEW_TOKENS = 16
HEARTBEAT_S, HEARTBEAT_TTL_S = 0.5, 2.0
WAIT_S = 60.0


def wait_until(condition, what: str, timeout_s: float = WAIT_S):
    return polling.wait_until(condition, what, timeout_s, interval_s=0.1)


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def system(redis_server):
    with LocalSystem(
        tls=True,
        redis_url=redis_server.url,
        heartbeat_s=HEARTBEAT_S,
        heartbeat_ttl_s=HEARTBEAT_TTL_S,
    ) as local:
        wait_until(lambda: len(_workers(local.stub)) == 2, "the target and the draft in the pools")
        yield local


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> Path:
    """Certificates of another CA: what an attacker who can reach the ports may hold."""
    directory = tmp_path_factory.mktemp("rogue-pki")
    write_throwaway_pki(directory, ca_name="rogue CA")
    return directory


def _workers(stub) -> list[common_pb2.Worker]:
    return list(stub.ListWorkers(orchestrator_pb2.ListWorkersRequest(), timeout=10).workers)


def _request(ids, k=4, drafter="model") -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest()
    request.token_ids.ids.extend(ids)
    request.sampling.max_new_tokens = MAX_NEW_TOKENS
    request.speculation.CopyFrom(
        common_pb2.SpeculationParams(num_speculative_tokens=k, drafter=drafter)
    )
    return request


def _reference(tiny_target, ids):
    params = SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(tiny_target.eos_token_id,)
    )
    return SpeculativeGenerator(tiny_target).generate(ids, params, k=0).token_ids


def _address(system, pool: str) -> str:
    return next(r.address for r in system.roles if r.pool == pool)


def _info_error(address: str, tls: Tls | None = None, credentials=None) -> grpc.StatusCode | None:
    """The status of a target Info call over the given channel; None when it answers."""
    with channel(address, tls, credentials) as open_channel:
        try:
            target_pb2_grpc.TargetServiceStub(open_channel).Info(
                common_pb2.InfoRequest(), timeout=5
            )
        except grpc.RpcError as error:
            return error.code()
    return None


def test_greedy_output_over_mutual_tls_equals_target_only(system, tiny_target, prompt_ids):
    mismatches = []
    for index, ids in enumerate(prompt_ids[:4]):
        reference = _reference(tiny_target, ids)
        for k, drafter in ((4, "model"), (4, "ngram"), (0, "")):
            tokens = list(system.stub.Generate(_request(ids, k, drafter), timeout=60).token_ids)
            if tokens != reference:
                mismatches.append((index, k, drafter))
    assert not mismatches, f"(prompt, k, drafter) differing from target-only: {mismatches}"
    # Every role really spoke TLS: the workers refuse a plaintext caller.
    assert _info_error(_address(system, "target")) == grpc.StatusCode.UNAVAILABLE


def test_the_client_command_connects_with_the_ca(system, capsys):
    ca = tls_files(system.args)["client"].ca
    assert (
        client_main(
            ["Hello", "--raw", "--address", system.address, "--tls-ca", ca, "--max-new-tokens", "4"]
        )
        == 0
    )
    assert "finish:" in capsys.readouterr().err
    # Without the CA the orchestrator's certificate is not trusted.
    assert client_main(["Hello", "--raw", "--address", system.address, "--timeout", "5"]) == 2


def test_a_caller_without_a_ca_signed_certificate_cannot_call_a_worker(system, rogue):
    real = tls_files(system.args)["client"]
    target = _address(system, "target")
    assert _info_error(target, real.load()) is None  # the cluster's own certificate passes
    # A certificate of another CA, presented to a worker that trusts only the cluster's.
    impostor = Tls(
        cert=(rogue / "client.pem").read_bytes(),
        key=(rogue / "client-key.pem").read_bytes(),
        ca=Path(real.ca).read_bytes(),
    )
    assert _info_error(target, impostor) == grpc.StatusCode.UNAVAILABLE
    # TLS without any client certificate.
    anonymous = grpc.ssl_channel_credentials(root_certificates=Path(real.ca).read_bytes())
    assert _info_error(target, credentials=anonymous) == grpc.StatusCode.UNAVAILABLE
    # The health service of a worker is no way in either.
    with channel(target) as plaintext:
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_worker_without_a_ca_signed_certificate_never_joins_a_pool(system, redis_server, rogue):
    """Two impostors register in the same Redis: a target with a certificate of another
    CA, and a plaintext draft. Both are in the registry; the orchestrator leaves them out
    and places every session on the real workers."""
    registry = [
        "--redis-url",
        redis_server.url,
        "--heartbeat-s",
        str(HEARTBEAT_S),
        "--heartbeat-ttl-s",
        str(HEARTBEAT_TTL_S),
        "--threads",
        "1",
    ]
    impostors = {
        "rogue-target": [
            "--model",
            "tiny-random:1",
            "--worker-id",
            "rogue-target",
            "--tls-cert",
            str(rogue / "target.pem"),
            "--tls-key",
            str(rogue / "target-key.pem"),
            "--tls-ca",
            str(rogue / "ca.pem"),
        ],
        "rogue-draft": ["--worker-id", "rogue-draft"],
    }
    for name, flags in impostors.items():
        module = "target_service" if name == "rogue-target" else "draft_service"
        system.cluster.start(
            name, module, [*flags, "--address", f"127.0.0.1:{free_port()}", *registry]
        )
    registered = WorkerRegistry(redis_server.url)
    wait_until(
        lambda: set(impostors) <= {w.worker_id for w in registered.workers()},
        "both impostors registered",
    )
    log = Path(system.args.log_dir) / "orchestrator.log"
    for name in impostors:
        wait_until(
            lambda name=name: (
                f"worker {name} at" in log.read_text() and "left out of the pool" in log.read_text()
            ),
            f"the orchestrator refusing {name}",
        )
    assert {w.worker_id for w in _workers(system.stub)}.isdisjoint(impostors)
    real_target = _address(system, "target")
    for _ in range(6):
        response = system.stub.Generate(_request([5, 17, 99, 3]), timeout=60)
        session = system.stub.GetSession(
            orchestrator_pb2.GetSessionRequest(session_id=response.session_id), timeout=10
        )
        assert session.target.worker_address == real_target
        assert session.draft.worker_id not in impostors


def test_half_a_tls_configuration_is_refused_and_a_missing_file_named(tmp_path):
    """Refused at start-up (each role's main turns InvalidArgument into exit status 2),
    never silently served in plaintext."""
    from draft_service.config import DraftConfig
    from service_common.security import tls_of

    files = write_throwaway_pki(tmp_path, roles=("draft",))["draft"]
    with pytest.raises(
        InvalidArgument, match="TLS needs tls_cert, tls_key and tls_ca together; missing tls_ca"
    ):
        tls_of(DraftConfig(tls_cert=files.cert, tls_key=files.key))
    with pytest.raises(InvalidArgument, match="tls_key: cannot read '/nonexistent/key.pem'"):
        tls_of(DraftConfig(tls_cert=files.cert, tls_key="/nonexistent/key.pem", tls_ca=files.ca))
    assert tls_of(DraftConfig()) is None
    assert tls_of(
        DraftConfig(tls_cert=files.cert, tls_key=files.key, tls_ca=files.ca)
    ).cert.startswith(b"-----BEGIN")


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server that speaks only TLS and asks clients for a certificate the CA signed."""
    binary = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin:/usr/bin")
    if binary is None:
        pytest.fail(
            "redis-server is not installed: `apt-get install redis-server` (make setup does it)"
        )
    pki = write_throwaway_pki(tmp_path / "pki", roles=("redis", "target", "orchestrator"))
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(tmp_path),
            "--tls-cert-file",
            pki["redis"].cert,
            "--tls-key-file",
            pki["redis"].key,
            "--tls-ca-cert-file",
            pki["redis"].ca,
            "--tls-auth-clients",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"rediss://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(
        url,
        ssl_ca_certs=pki["redis"].ca,
        ssl_certfile=pki["target"].cert,
        ssl_keyfile=pki["target"].key,
    )

    def up():
        try:
            return client.ping()
        except redis.ConnectionError:
            assert process.poll() is None, "redis-server with TLS exited"
            return False

    wait_until(up, "redis-server answering on its TLS port", timeout_s=10)
    yield url, pki
    process.terminate()
    process.wait(timeout=10)


def test_registry_and_sessions_over_rediss(tls_redis):
    url, pki = tls_redis
    worker = common_pb2.Worker(
        pool=common_pb2.WORKER_POOL_TARGET,
        worker_id="target-1",
        address="127.0.0.1:1",
        last_heartbeat_unix_ms=int(time.time() * 1000),
    )
    WorkerRegistry(url, pki["target"].load()).announce(worker, ttl_s=10)
    assert [w.worker_id for w in WorkerRegistry(url, pki["orchestrator"].load()).workers()] == [
        "target-1"
    ]
    store = RedisSessionStore(url, ttl_s=60, lease_ttl_s=5, tls=pki["orchestrator"].load())
    store.put(SessionRecord("s1", [1, 2, 3], owner="alice"))
    assert store.get("s1").token_ids == [1, 2, 3] and store.count_owned("alice") == 1
    store.close()
    # A client that does not present a certificate the CA signed is turned away.
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, ssl_ca_certs=pki["redis"].ca, socket_connect_timeout=2).ping()
