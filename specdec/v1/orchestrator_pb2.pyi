from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_SOURCE_UNSPECIFIED: _ClassVar[TokenSource]
    TOKEN_SOURCE_ACCEPTED: _ClassVar[TokenSource]
    TOKEN_SOURCE_RECOVERED: _ClassVar[TokenSource]
    TOKEN_SOURCE_BONUS: _ClassVar[TokenSource]
    TOKEN_SOURCE_TARGET: _ClassVar[TokenSource]
TOKEN_SOURCE_UNSPECIFIED: TokenSource
TOKEN_SOURCE_ACCEPTED: TokenSource
TOKEN_SOURCE_RECOVERED: TokenSource
TOKEN_SOURCE_BONUS: TokenSource
TOKEN_SOURCE_TARGET: TokenSource

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "session_id", "sampling", "speculation", "stop", "include_stats")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STATS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    session_id: str
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stats: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., session_id: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., include_stats: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "finish_reason", "stats", "token_sources", "num_prompt_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SOURCES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.GenerationStats
    token_sources: _containers.RepeatedScalarFieldContainer[TokenSource]
    num_prompt_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.GenerationStats, _Mapping]] = ..., token_sources: _Optional[_Iterable[_Union[TokenSource, str]]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("session_id", "text_delta", "token_ids", "finish_reason", "stats", "token_sources", "token_texts", "num_drafted", "num_prompt_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SOURCES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text_delta: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.GenerationStats
    token_sources: _containers.RepeatedScalarFieldContainer[TokenSource]
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    num_drafted: int
    num_prompt_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., text_delta: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.GenerationStats, _Mapping]] = ..., token_sources: _Optional[_Iterable[_Union[TokenSource, str]]] = ..., token_texts: _Optional[_Iterable[str]] = ..., num_drafted: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("system_prompt", "sampling", "speculation")
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    system_prompt: str
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationParams
    def __init__(self, system_prompt: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "num_committed_tokens", "target", "draft", "created_unix_ms", "last_used_unix_ms", "sampling", "speculation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_committed_tokens: int
    target: _common_pb2.KvHandle
    draft: _common_pb2.KvHandle
    created_unix_ms: int
    last_used_unix_ms: int
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationParams
    def __init__(self, session_id: _Optional[str] = ..., num_committed_tokens: _Optional[int] = ..., target: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., draft: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., created_unix_ms: _Optional[int] = ..., last_used_unix_ms: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.Worker, _Mapping]]] = ...) -> None: ...
