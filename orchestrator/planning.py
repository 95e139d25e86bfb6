"""What a Generate call will do, decided from the request and the session before any
worker is touched: sampling and speculation parameters, the tokens to continue from,
the limits they must meet."""

from __future__ import annotations

from dataclasses import dataclass, field

from foundation.errors import InvalidArgument
from foundation.limits import validate_num_speculative_tokens
from foundation.sequence import common_prefix_length
from orchestrator.config import OrchestratorConfig
from orchestrator.limits import check_max_new_tokens, check_prompt_tokens
from orchestrator.store import SessionRecord
from orchestrator.text import render_chat
from service_common.convert import check_speculation_params, sampling_from_proto
from specdec.v1 import common_pb2, orchestrator_pb2
from speculative.types import SamplingParams


@dataclass
class Plan:
    """What a call will do, decided before any worker is touched."""

    record: SessionRecord
    tokens: list[int]  # the full sequence to generate after: history + new input
    keep: int  # committed tokens of the record that stay (the rest is rolled back)
    params: SamplingParams
    k: int
    drafter: str
    adaptive: bool
    speculation: common_pb2.SpeculationParams = field(
        default_factory=common_pb2.SpeculationParams
    )  # to forward


def plan_call(
    config: OrchestratorConfig,
    tokenizer,
    request: orchestrator_pb2.GenerateRequest,
    record: SessionRecord,
) -> Plan:
    """The request's parameters over the session's defaults, and its new input after the
    session's history; raises InvalidArgument where they break a limit."""
    params = _sampling(config, tokenizer, request, record)
    speculation = _speculation(request, record)
    tokens, keep = _tokens(tokenizer, request, record)
    if not tokens:
        raise InvalidArgument("prompt is empty: give text, token ids or chat messages")
    check_prompt_tokens(config, len(tokens))
    check_max_new_tokens(config, params.max_new_tokens)
    k = (
        speculation.num_speculative_tokens
        if speculation.HasField("num_speculative_tokens")
        else config.default_k
    )
    return Plan(
        record,
        tokens,
        keep,
        params,
        validate_num_speculative_tokens(k),
        speculation.drafter,
        speculation.adaptive,
        speculation,
    )


def check_stop_strings(
    config: OrchestratorConfig, request: orchestrator_pb2.GenerateRequest
) -> None:
    stops = request.stop
    if len(stops) > config.max_stop_strings:
        raise InvalidArgument(
            f"at most {config.max_stop_strings} stop strings (max_stop_strings), got {len(stops)}"
        )
    for stop in stops:
        if not stop or len(stop) > config.max_stop_string_chars:
            raise InvalidArgument(
                f"stop strings must have 1 to {config.max_stop_string_chars} characters "
                f"(max_stop_string_chars), got {len(stop)}"
            )


def _sampling(
    config: OrchestratorConfig,
    tokenizer,
    request: orchestrator_pb2.GenerateRequest,
    record: SessionRecord,
) -> SamplingParams:
    message = common_pb2.SamplingParams()
    if record.sampling:
        message.ParseFromString(record.sampling)
    if request.HasField("sampling"):
        message = request.sampling
    params = sampling_from_proto(message, config.default_max_new_tokens)
    # The end-of-text token always ends generation, as users of every server expect.
    eos = tokenizer.eos_token_id
    if eos is not None and eos not in params.stop_token_ids:
        params = params.replace(stop_token_ids=(*params.stop_token_ids, eos))
    return params


def _speculation(
    request: orchestrator_pb2.GenerateRequest, record: SessionRecord
) -> common_pb2.SpeculationParams:
    message = common_pb2.SpeculationParams()
    if record.speculation:
        message.ParseFromString(record.speculation)
    if request.HasField("speculation"):
        message = request.speculation
    check_speculation_params(message)
    return message


def _tokens(
    tokenizer, request: orchestrator_pb2.GenerateRequest, record: SessionRecord
) -> tuple[list[int], int]:
    """The sequence to continue from, and how much of the committed one it keeps."""
    kind = request.WhichOneof("prompt")
    history = record.token_ids
    if kind == "chat":
        messages = [
            *record.messages,
            *({"role": m.role, "content": m.content} for m in request.chat.messages),
        ]
        tokens = render_chat(tokenizer, messages)
        record.messages = messages
        # The whole conversation, rendered: the session equals a fresh one; the common prefix keeps its KV cache.
        return tokens, common_prefix_length(history, tokens)
    if kind == "text":
        new = tokenizer(request.text, add_special_tokens=not history).input_ids
    elif kind == "token_ids":
        new = list(request.token_ids.ids)
    else:
        new = []
    return history + new, len(history)
