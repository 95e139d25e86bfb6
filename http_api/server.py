"""The OpenAI-compatible HTTP API: `python -m http_api --orchestrator-address HOST:PORT`.

    POST /v1/chat/completions, POST /v1/completions   (whole, or streamed as server-sent events)
    GET  /v1/models, GET /health, GET /health/live, GET /   (the playground)

A role of its own in front of the orchestrator's public gRPC API (docs/http.md): it
scales on its own, the gRPC contract stays the one API, and the orchestrator carries no
HTTP dependencies. Calls go through grpc.aio on the server's event loop; a client that
disconnects cancels its gRPC call, which frees the session on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from importlib import resources

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from foundation.errors import InvalidArgument
from http_api.config import HttpApiConfig
from http_api.openai_api import ApiError, Parsed, Responder, Totals, error_of_rpc, parse
from service_common import config as config_flags
from service_common.logs import configure_logging
from service_common.security import aio_channel, tls_of
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)
ENV_PREFIX = "HTTP_API"
# As service_common.server's (not imported: it pulls in the telemetry SDK).
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(data) -> bytes:
    return (
        b"data: "
        + (data if isinstance(data, bytes) else json.dumps(data, ensure_ascii=False).encode())
        + b"\n\n"
    )


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class Conversations:
    """Chat conversations -> the orchestrator session that holds them, so that a client
    sending a conversation again with new messages (what every OpenAI client does)
    continues the session and reuses its KV caches. Keys chain hashes of the messages
    and of the caller's Authorization header; only exact histories match (the
    assistant's replies as generated), which is what keeps the output that of a fresh
    request. A session is taken out while a request uses it; the least recently used
    beyond max_entries are returned to be closed."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        # key -> (session id, the metadata of the caller who owns it: closed with it)
        self.sessions: OrderedDict[bytes, tuple[str, tuple]] = OrderedDict()

    @staticmethod
    def keys(scope: str, model: str, messages: list[dict]) -> list[bytes]:
        """keys[i]: the key of messages[:i + 1]."""
        digest = hashlib.sha256(json.dumps([scope, model]).encode()).digest()
        keys = []
        for message in messages:
            digest = _extend(digest, message)
            keys.append(digest)
        return keys

    def take(self, keys: list[bytes]) -> tuple[str, int]:
        """The session holding the longest proper prefix of the messages, and its length
        in messages; ("", 0) when none."""
        for length in range(len(keys) - 1, 0, -1):
            entry = self.sessions.pop(keys[length - 1], None)
            if entry:
                return entry[0], length
        return "", 0

    def put(self, key: bytes, session_id: str, metadata: tuple) -> list[tuple[str, tuple]]:
        """Remembers a session; returns the (session, metadata) evicted (to close)."""
        self.sessions[key] = (session_id, metadata)
        self.sessions.move_to_end(key)
        evicted = []
        while len(self.sessions) > self.max_entries:
            evicted.append(self.sessions.popitem(last=False)[1])
        return evicted


class Api:
    """The routes, over one gRPC channel to the orchestrator (opened on startup)."""

    def __init__(self, config: HttpApiConfig):
        self.config = config
        self.conversations = Conversations(config.max_conversations)
        self.channel: grpc.aio.Channel | None = None
        self.stub: orchestrator_pb2_grpc.OrchestratorStub | None = None
        # Served model names by the caller's Authorization (each caller's own ListWorkers
        # answer, so a cached list never answers a caller the orchestrator would refuse).
        self._models: dict[str, tuple[float, list[str]]] = {}
        self._background: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # TLS with the front's own certificate when its config names the files (docs/security.md).
        self.channel = aio_channel(
            self.config.orchestrator_address, tls_of(self.config), CHANNEL_OPTIONS
        )
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        log.info(
            "http api serving",
            extra={
                "fields": {
                    "address": self.config.address,
                    "orchestrator": self.config.orchestrator_address,
                }
            },
        )
        try:
            yield
        finally:
            if self._background:
                await asyncio.wait(self._background, timeout=5)
            await self.channel.close()

    def routes(self) -> list[Route]:
        return [
            Route("/", self.playground, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health/live", self.live, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]

    # ------------------------------------------------------------ small routes

    async def playground(self, request: Request) -> Response:
        return HTMLResponse(
            resources.files("http_api").joinpath("playground.html").read_text(encoding="utf-8")
        )

    async def live(self, request: Request) -> Response:
        """Liveness: the server answers (the orchestrator may be down)."""
        return JSONResponse({"status": "ok"})

    async def health(self, request: Request) -> Response:
        """Readiness: 200 when the orchestrator reports SERVING, else 503."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0
            )
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as error:
            status = error.code().name
        code = 200 if status == "SERVING" else 503
        return JSONResponse(
            {"status": "ok" if code == 200 else "unavailable", "orchestrator": status},
            status_code=code,
        )

    async def models(self, request: Request) -> Response:
        try:
            names = await self._served_models(_metadata(request))
        except ApiError as error:
            return error_response(error)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "specdec"}
                    for name in names
                ],
            }
        )

    async def _served_models(self, metadata) -> list[str]:
        if self.config.model_name:
            return [self.config.model_name]
        caller = dict(metadata).get("authorization", "")
        fetched, names = self._models.get(caller, (0.0, []))
        if names and time.monotonic() - fetched < self.config.models_cache_s:
            return names
        try:
            reply = await self.stub.ListWorkers(
                orchestrator_pb2.ListWorkersRequest(), timeout=10.0, metadata=metadata
            )
        except grpc.RpcError as error:
            raise error_of_rpc(error) from None
        names = sorted(
            {w.model.model_id for w in reply.workers if w.pool == common_pb2.WORKER_POOL_TARGET}
        )
        if not names:
            raise ApiError(
                503,
                "no target worker is serving a model yet",
                "service_unavailable_error",
                None,
                "unavailable",
            )
        if len(self._models) >= 1024:
            self._models.clear()
        self._models[caller] = (time.monotonic(), names)
        return names

    async def _model(self, parsed: Parsed, metadata) -> str:
        names = await self._served_models(metadata)
        if parsed.model is None or parsed.model in names:
            return parsed.model or names[0]
        raise ApiError(
            404,
            f"The model '{parsed.model}' does not exist; this server serves {names}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )

    # ------------------------------------------------------------ completions

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: str) -> Response:
        metadata = _metadata(request)
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ApiError(
                    400, f"the request body is not valid JSON: {error}", "invalid_request_error"
                ) from None
            parsed = parse(body, kind, self.config)
            model = await self._model(parsed, metadata)
            generation = Generation(self, parsed, model, metadata)
            first = await generation.start()
        except ApiError as error:
            return error_response(error)
        responder = Responder(parsed, model)
        if parsed.stream:
            return StreamingResponse(
                self._stream(request, generation, responder, first),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        totals = Totals()
        try:
            async for chunk in _watch_disconnect(request, generation, generation.chunks(first)):
                totals.add(chunk)
        except ApiError as error:
            return error_response(error)
        generation.finished(totals)
        return JSONResponse(responder.whole(totals))

    async def _stream(
        self,
        request: Request,
        generation: Generation,
        responder: Responder,
        first: orchestrator_pb2.GenerateChunk,
    ) -> AsyncIterator[bytes]:
        totals = Totals()
        opening = responder.first()
        if opening:
            yield _sse(opening)
        try:
            async for chunk in _watch_disconnect(request, generation, generation.chunks(first)):
                totals.add(chunk)
                delta = responder.delta(chunk)
                if delta:
                    yield _sse(delta)
        except ApiError as error:  # after the 200 went out: an error event, as OpenAI sends
            yield _sse(error.body())
            yield _sse(b"[DONE]")
            return
        generation.finished(totals)
        yield _sse(responder.last(totals))
        if responder.parsed.include_usage:
            yield _sse(responder.usage(totals))
        yield _sse(b"[DONE]")

    def close_sessions(self, sessions: list[tuple[str, tuple]]) -> None:
        """Closes (session id, its caller's metadata) on the orchestrator in the
        background (frees their KV caches)."""

        async def close() -> None:
            for session_id, metadata in sessions:
                with contextlib.suppress(grpc.RpcError):
                    await self.stub.CloseSession(
                        common_pb2.CloseSessionRequest(session_id=session_id),
                        timeout=10.0,
                        metadata=metadata,
                    )

        if sessions:
            task = asyncio.get_running_loop().create_task(close())
            self._background.add(task)
            task.add_done_callback(self._background.discard)


class Generation:
    """One GenerateStream call on the orchestrator, continuing a remembered chat session
    where there is one."""

    def __init__(self, api: Api, parsed: Parsed, model: str, metadata):
        self.api, self.parsed, self.model, self.metadata = api, parsed, model, metadata
        self.call = None
        self.keys: list[bytes] = []
        if parsed.kind == "chat":
            scope = dict(metadata).get("authorization", "")
            self.keys = Conversations.keys(
                hashlib.sha256(scope.encode()).hexdigest(), model, parsed.messages
            )

    def _request(self, session_id: str, skip: int) -> orchestrator_pb2.GenerateRequest:
        request = orchestrator_pb2.GenerateRequest()
        request.CopyFrom(self.parsed.request)
        if self.parsed.kind == "chat":
            request.session_id = session_id
            for message in self.parsed.messages[skip:]:
                request.chat.messages.add(role=message["role"], content=message["content"])
        return request

    async def start(self) -> orchestrator_pb2.GenerateChunk:
        """Starts the call; returns its first chunk, so that errors before any output
        get their own HTTP status. A remembered session that is gone (expired, or the
        orchestrator restarted) is forgotten and the conversation sent whole."""
        session_id, skip = self.api.conversations.take(self.keys) if self.keys else ("", 0)
        try:
            return await self._open(session_id, skip)
        except grpc.RpcError as error:
            if session_id and error.code() == grpc.StatusCode.NOT_FOUND:
                try:
                    return await self._open("", 0)
                except grpc.RpcError as retry_error:
                    error = retry_error
            raise error_of_rpc(error) from None

    async def _open(self, session_id: str, skip: int) -> orchestrator_pb2.GenerateChunk:
        self.call = self.api.stub.GenerateStream(
            self._request(session_id, skip),
            timeout=self.api.config.timeout_s,
            metadata=self.metadata,
        )
        chunk = await self.call.read()
        if chunk is grpc.aio.EOF:
            raise ApiError(
                502, "the orchestrator ended the stream without a chunk", "internal_error"
            )
        return chunk

    async def chunks(
        self, first: orchestrator_pb2.GenerateChunk
    ) -> AsyncIterator[orchestrator_pb2.GenerateChunk]:
        try:
            yield first
            while (chunk := await self.call.read()) is not grpc.aio.EOF:
                yield chunk
        except grpc.RpcError as error:
            raise error_of_rpc(error) from None
        finally:
            self.call.cancel()  # a no-op once the call ended; else it ends it on the orchestrator

    def finished(self, totals: Totals) -> None:
        """A chat is remembered with its reply, to be continued; other sessions are closed."""
        if not totals.session_id:
            return
        if self.parsed.kind != "chat":
            self.api.close_sessions([(totals.session_id, self.metadata)])
            return
        key = _extend(self.keys[-1], {"role": "assistant", "content": totals.text})
        self.api.close_sessions(self.api.conversations.put(key, totals.session_id, self.metadata))


def _extend(key: bytes, message: dict) -> bytes:
    return hashlib.sha256(key + json.dumps([message["role"], message["content"]]).encode()).digest()


async def _watch_disconnect(request: Request, generation: Generation, chunks: AsyncIterator):
    """The chunks, with the gRPC call cancelled as soon as the HTTP client disconnects
    (not only when the next write fails: the next chunk may be long in coming)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if generation.call is not None:
                    generation.call.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        watcher.cancel()
        await chunks.aclose()


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's credentials, passed on unchanged (the orchestrator checks them)."""
    authorization = request.headers.get("authorization")
    return (("authorization", authorization),) if authorization else ()


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Starlette's own errors (unknown path, wrong method) in OpenAI's error JSON."""
    type_ = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return error_response(
        ApiError(error.status_code, f"{error.detail}: {request.method} {request.url.path}", type_)
    )


async def _internal_error(request: Request, error: Exception) -> Response:
    log.exception("unexpected error in %s %s", request.method, request.url.path)
    return error_response(
        ApiError(500, "internal error in the HTTP API; see its log", "internal_error")
    )


def create_app(config: HttpApiConfig) -> Starlette:
    api = Api(config)
    app = Starlette(
        routes=api.routes(),
        lifespan=api.lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.api = api
    return app


def main(argv=None) -> int:
    config = config_flags.parse(
        HttpApiConfig, ENV_PREFIX, argv, description=__doc__.splitlines()[0]
    )
    configure_logging("http_api", config.log_level)
    host, _, port = config.address.rpartition(":")
    if not port.isdigit():
        log.error("cannot start: --address must be HOST:PORT, got %r", config.address)
        return 2
    try:
        tls_of(config)  # all three TLS files or none, readable: refused before serving
    except InvalidArgument as error:
        log.error("cannot start: %s", error)
        return 2
    # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal again for the
    # handler it found: this one, so that the process exits 0 as the other roles do.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=host.strip("[]") or "0.0.0.0",
            port=int(port),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(config.grace_s),
            lifespan="on",
        )
    )
    server.run()
    return 0 if server.started else 2
