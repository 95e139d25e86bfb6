"""The HTTP API's mapping of the orchestrator's gRPC statuses, with the `openai` package:
http_api started as a process in front of a scripted orchestrator (an in-process gRPC
server), so that every status can be produced on demand: UNAUTHENTICATED (the
orchestrator's API keys, issue 20) -> 401, RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503,
NOT_FOUND -> 404; and the Authorization header reaches the orchestrator unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import openai
import pytest

from launcher.cluster import free_port
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

GOOD_KEY = "sk-good"


class ScriptedOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """Checks `authorization` as issue 20's interceptor will; the prompt says what to do."""

    def __init__(self):
        self.authorizations: list[str | None] = []

    def _check(self, context) -> None:
        authorization = dict(context.invocation_metadata()).get("authorization")
        self.authorizations.append(authorization)
        if authorization != f"Bearer {GOOD_KEY}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")

    def ListWorkers(self, request, context):
        self._check(context)
        return orchestrator_pb2.ListWorkersResponse(
            workers=[
                common_pb2.Worker(
                    pool=common_pb2.WORKER_POOL_TARGET,
                    worker_id="t",
                    address="t:1",
                    model=common_pb2.ModelInfo(model_id="scripted"),
                )
            ]
        )

    def GenerateStream(self, request, context):
        self._check(context)
        prompt = request.text or request.chat.messages[-1].content
        codes = {
            "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
            "down": grpc.StatusCode.UNAVAILABLE,
            "gone": grpc.StatusCode.NOT_FOUND,
            "odd": grpc.StatusCode.INVALID_ARGUMENT,
        }
        if prompt in codes:
            context.abort(codes[prompt], f"scripted {codes[prompt].name}")
        yield orchestrator_pb2.GenerateChunk(
            session_id="s1",
            text_delta="Hello",
            token_ids=[1],
            token_sources=[orchestrator_pb2.TOKEN_SOURCE_TARGET],
            token_texts=["Hello"],
        )
        if prompt == "fails midway":
            context.abort(grpc.StatusCode.UNAVAILABLE, "target lost and no failover left")
        yield orchestrator_pb2.GenerateChunk(
            text_delta=" world",
            token_ids=[2],
            token_sources=[orchestrator_pb2.TOKEN_SOURCE_TARGET],
            token_texts=[" world"],
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            num_prompt_tokens=3,
            stats=common_pb2.GenerationStats(),
        )

    def CloseSession(self, request, context):
        return common_pb2.CloseSessionResponse()


def _start_http_api(orchestrator_address: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "http_api",
            "--address",
            f"127.0.0.1:{port}",
            "--orchestrator-address",
            orchestrator_address,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health/live", timeout=2).close()
            return process, url
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "http_api did not start"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def scripted():
    servicer = ScriptedOrchestrator()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    process, url = _start_http_api(f"127.0.0.1:{port}")
    yield servicer, url
    process.terminate()
    process.wait(timeout=30)
    server.stop(None)


def _client(url: str, key: str = GOOD_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def _chat(client, content: str, **kwargs):
    return client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": content}], **kwargs
    )


def test_the_authorization_header_is_passed_on_unchanged(scripted):
    servicer, url = scripted
    servicer.authorizations.clear()
    response = _chat(_client(url), "hi")
    assert response.choices[0].message.content == "Hello world"
    assert servicer.authorizations and set(servicer.authorizations) == {f"Bearer {GOOD_KEY}"}


@pytest.mark.parametrize("stream", [False, True])
def test_unauthenticated_is_401(scripted, stream):
    _, url = scripted
    with pytest.raises(openai.AuthenticationError) as raised:
        _chat(_client(url, "sk-wrong"), "hi", stream=stream)
    assert raised.value.status_code == 401 and "API key" in raised.value.message
    assert raised.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        _client(url, "sk-wrong").models.list()


@pytest.mark.parametrize(
    ("prompt", "error_class", "status"),
    [
        ("busy", openai.RateLimitError, 429),
        ("down", openai.InternalServerError, 503),
        ("gone", openai.NotFoundError, 404),
        ("odd", openai.BadRequestError, 400),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_statuses_map_to_http_and_openai_classes(scripted, prompt, error_class, status, stream):
    _, url = scripted
    with pytest.raises(error_class) as raised:
        _chat(_client(url), prompt, stream=stream)
    assert raised.value.status_code == status
    assert set(raised.value.body) == {"message", "type", "param", "code"}


def test_an_error_after_the_stream_began_is_an_error_event(scripted):
    _, url = scripted
    stream = _chat(_client(url), "fails midway", stream=True)
    with pytest.raises(openai.APIError, match="target lost"):
        for _ in stream:
            pass


def test_an_unreachable_orchestrator_is_503():
    process, url = _start_http_api(f"127.0.0.1:{free_port()}")  # nothing listens there
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            _chat(_client(url), "hi")
        assert raised.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert (
            health.value.code == 503 and json.loads(health.value.read())["status"] == "unavailable"
        )
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0  # SIGTERM: a clean, graceful stop


def test_unknown_paths_answer_in_openai_error_json(scripted):
    _, url = scripted
    for method, path, status in (("GET", "/v1/engines", 404), ("GET", "/v1/chat/completions", 405)):
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(urllib.request.Request(url + path, method=method), timeout=10)
        assert raised.value.code == status
        assert set(json.loads(raised.value.read())["error"]) == {"message", "type", "param", "code"}
