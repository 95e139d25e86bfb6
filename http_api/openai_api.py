"""OpenAI's request and response shapes <-> the orchestrator's GenerateRequest and GenerateChunk.

Only translation and validation: no I/O. Errors are ApiError, written as OpenAI's error
JSON ({"error": {"message", "type", "param", "code"}}) with the matching HTTP status.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import grpc

from specdec.v1 import common_pb2, orchestrator_pb2

MAX_SEED = 2**63  # SamplingParams.seed is in [0, 2^63)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Sources of generated tokens (orchestrator.proto TokenSource), as the API names them.
SOURCE_NAMES = {
    orchestrator_pb2.TOKEN_SOURCE_ACCEPTED: "accepted",
    orchestrator_pb2.TOKEN_SOURCE_RECOVERED: "recovered",
    orchestrator_pb2.TOKEN_SOURCE_BONUS: "bonus",
    orchestrator_pb2.TOKEN_SOURCE_TARGET: "target",
}

FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
}

# Fields OpenAI defines that this server does not implement: refused when set to
# anything but their neutral value, rather than silently ignored.
UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "audio": (None,),
    "prediction": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


class ApiError(Exception):
    """An error response: HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# gRPC status of the orchestrator -> HTTP status, OpenAI error type, code.
STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}


def error_of_rpc(error: grpc.RpcError) -> ApiError:
    status, type_, code = STATUS_OF_CODE.get(error.code(), (500, "internal_error", None))
    return ApiError(status, error.details() or error.code().name, type_, None, code)


@dataclass
class Parsed:
    """A validated request: what to send to the orchestrator, and how to answer."""

    kind: str  # "chat" or "completion"
    model: str | None
    request: orchestrator_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    token_sources: bool = False  # per-chunk provenance (the playground's extension)
    messages: list[dict] = field(default_factory=list)  # chat: normalized {"role", "content"}
    speculation: dict = field(default_factory=dict)  # the settings used, echoed in the response


def _number(
    body: dict, name: str, low: float, high: float, *, integer: bool = False, low_open: bool = False
):
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad_request(
            f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name
        )
    if value < low or value > high or (low_open and value == low):
        # 2147483647, not 2.14748e+09
        bounds = (f"{bound:d}" if integer else f"{bound:g}" for bound in (low, high))
        interval = f"{'(' if low_open else '['}{', '.join(bounds)}]"
        raise bad_request(f"'{name}' must be in {interval}, got {value!r}", name, "invalid_value")
    return value


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f"messages[{index}].content: only text parts are supported",
                    f"messages[{index}].content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(
        f"messages[{index}].content must be a string or a list of text parts",
        f"messages[{index}].content",
    )


def normalize_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content}", "messages")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{index}] must be an object", f"messages[{index}]")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"messages[{index}].role must be one of {sorted(ROLES)}, got {role!r}",
                f"messages[{index}].role",
            )
        normalized.append({"role": ROLES[role], "content": _content(message, index)})
    return normalized


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    return [s for s in stop if s]


def _prompt(body: dict, request: orchestrator_pb2.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        request.text = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        request.token_ids.ids.extend(prompt)
    else:
        raise bad_request(
            "'prompt' must be a non-empty string or list of token ids (one prompt per request)",
            "prompt",
        )


def parse(body, kind: str, defaults) -> Parsed:
    """Validates an OpenAI request body (chat or completion); defaults: HttpApiConfig."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise bad_request(
                f"'{name}' is not supported by this server", name, "unsupported_parameter"
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    n = _number(body, "n", 1, 1_000_000, integer=True)
    if n not in (None, 1):
        raise bad_request(
            f"only n=1 is supported (one choice per request), got n={n}", "n", "unsupported_value"
        )
    request = orchestrator_pb2.GenerateRequest(include_stats=True, stop=_stop(body))
    parsed = Parsed(kind, model, request)
    if kind == "chat":
        parsed.messages = normalize_messages(body)
    else:
        _prompt(body, request)
    sampling = request.sampling
    max_tokens = _number(body, "max_completion_tokens", 1, 2**31 - 1, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, 2**31 - 1, integer=True)
    sampling.max_new_tokens = max_tokens or defaults.default_max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    sampling.temperature = 1.0 if temperature is None else temperature  # OpenAI's default is 1
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    sampling.top_p = 1.0 if top_p is None else top_p
    top_k = _number(body, "top_k", 0, 2**31 - 1, integer=True)  # an extension, as in vLLM
    sampling.top_k = top_k or 0
    seed = _number(body, "seed", 0, MAX_SEED - 1, integer=True)
    if seed is not None:
        sampling.seed = seed
    speculation = request.speculation
    k = _number(body, "num_speculative_tokens", 0, 2**31 - 1, integer=True)
    if k is None and defaults.default_num_speculative_tokens >= 0:
        k = defaults.default_num_speculative_tokens
    if k is not None:
        speculation.num_speculative_tokens = k
    drafter = body.get("drafter", defaults.default_drafter)
    if not isinstance(drafter, str):
        raise bad_request("'drafter' must be a string", "drafter")
    speculation.drafter = drafter
    adaptive = body.get("adaptive", defaults.default_adaptive)
    if not isinstance(adaptive, bool):
        raise bad_request("'adaptive' must be true or false", "adaptive")
    speculation.adaptive = adaptive
    parsed.speculation = {
        "num_speculative_tokens": k,
        "drafter": drafter or None,
        "adaptive": adaptive,
    }
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad_request("'stream' must be true or false", "stream")
    parsed.stream = bool(stream)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if options and not parsed.stream:
        raise bad_request("'stream_options' is only allowed with stream=true", "stream_options")
    parsed.include_usage = bool(options.get("include_usage"))
    parsed.token_sources = bool(body.get("return_token_sources"))
    return parsed


# ---------------------------------------------------------------- responses


@dataclass
class Totals:
    """What a generation produced, accumulated over its chunks."""

    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    sources: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCE_NAMES.values(), 0))
    finish_reason: str | None = None
    stats: common_pb2.GenerationStats | None = None
    session_id: str = ""

    def add(self, chunk: orchestrator_pb2.GenerateChunk) -> None:
        self.text += chunk.text_delta
        self.completion_tokens += len(chunk.token_ids)
        for source in chunk.token_sources:
            name = SOURCE_NAMES.get(source)
            if name:
                self.sources[name] += 1
        if chunk.session_id:
            self.session_id = chunk.session_id
        if chunk.finish_reason:
            self.finish_reason = FINISH_REASONS.get(chunk.finish_reason, "stop")
            self.prompt_tokens = chunk.num_prompt_tokens
        if chunk.HasField("stats"):
            self.stats = chunk.stats

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def speculation(self, settings: dict) -> dict:
        """The extension field: the settings used and what speculation did."""
        s = self.stats or common_pb2.GenerationStats()
        seconds = s.total_ns * 1e-9
        return {
            **settings,
            "rounds": s.num_rounds,
            "drafted_tokens": s.num_drafted,
            "accepted_tokens": s.num_accepted,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_per_round": s.mean_accepted_per_round,
            "token_sources": dict(self.sources),
            "prefill_tokens": s.num_prefill_tokens,
            "failovers": s.num_failovers,
            "time_s": seconds,
            "tokens_per_s": self.completion_tokens / seconds if seconds else 0.0,
        }


def chunk_sources(chunk: orchestrator_pb2.GenerateChunk) -> list[dict]:
    """Each token of a chunk with its text and how it was produced (the playground's extension)."""
    return [
        {"text": text, "source": SOURCE_NAMES.get(source, "unknown")}
        for text, source in zip(chunk.token_texts, chunk.token_sources)
    ]


class Responder:
    """Builds the response objects of one request (chat or completion, whole or streamed)."""

    def __init__(self, parsed: Parsed, model: str):
        self.parsed, self.model = parsed, model
        self.chat = parsed.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _base(self, suffix: str = "") -> dict:
        return {
            "id": self.id,
            "object": self.object + suffix,
            "created": self.created,
            "model": self.model,
        }

    def whole(self, totals: Totals) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": totals.text},
                "logprobs": None,
                "finish_reason": totals.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": totals.text,
                "logprobs": None,
                "finish_reason": totals.finish_reason,
            }
        return {
            **self._base(),
            "choices": [choice],
            "usage": totals.usage(),
            "speculation": totals.speculation(self.parsed.speculation),
        }

    def _chunk(self, choice: dict, **extra) -> dict:
        chunk = {**self._base(".chunk" if self.chat else ""), "choices": [choice], **extra}
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def first(self) -> dict | None:
        """The chat stream's opening chunk (the assistant role), None for completions."""
        if not self.chat:
            return None
        return self._chunk(
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def delta(self, chunk: orchestrator_pb2.GenerateChunk) -> dict | None:
        if not chunk.text_delta and not (self.parsed.token_sources and chunk.token_ids):
            return None
        if self.chat:
            choice = {
                "index": 0,
                "delta": {"content": chunk.text_delta},
                "logprobs": None,
                "finish_reason": None,
            }
        else:
            choice = {"index": 0, "text": chunk.text_delta, "logprobs": None, "finish_reason": None}
        extra = {}
        if self.parsed.token_sources:
            extra = {"token_sources": chunk_sources(chunk), "drafted_tokens": chunk.num_drafted}
        return self._chunk(choice, **extra)

    def last(self, totals: Totals) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": totals.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": totals.finish_reason,
            }
        return self._chunk(choice, speculation=totals.speculation(self.parsed.speculation))

    def usage(self, totals: Totals) -> dict:
        return {**self._base(".chunk" if self.chat else ""), "choices": [], "usage": totals.usage()}
