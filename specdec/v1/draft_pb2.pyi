from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftOpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "drafter")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafter: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., drafter: _Optional[str] = ...) -> None: ...

class DraftOpenSessionResponse(_message.Message):
    __slots__ = ("handle", "prefill_ns")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.KvHandle
    prefill_ns: int
    def __init__(self, handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., prefill_ns: _Optional[int] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("session_id", "base_len", "target", "sampling", "speculation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_len: int
    target: _common_pb2.KvHandle
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationParams
    def __init__(self, session_id: _Optional[str] = ..., base_len: _Optional[int] = ..., target: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ...) -> None: ...

class SpeculateUpdate(_message.Message):
    __slots__ = ("token_ids", "committed_len", "round", "finished", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_len: int
    round: _common_pb2.RoundStats
    finished: bool
    finish_reason: _common_pb2.FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., committed_len: _Optional[int] = ..., round: _Optional[_Union[_common_pb2.RoundStats, _Mapping]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...
