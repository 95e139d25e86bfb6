from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "resumes_stream")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUMES_STREAM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    resumes_stream: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resumes_stream: _Optional[bool] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("handle", "prefill_ns")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.KvHandle
    prefill_ns: int
    def __init__(self, handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., prefill_ns: _Optional[int] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("session_id", "round", "base_len", "expected_last_token_id", "sampling", "draft", "stretch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    STRETCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    base_len: int
    expected_last_token_id: int
    sampling: _common_pb2.SamplingParams
    draft: Draft
    stretch: Stretch
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., base_len: _Optional[int] = ..., expected_last_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ..., stretch: _Optional[_Union[Stretch, _Mapping]] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("token_ids", "distributions", "parents")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class Stretch(_message.Message):
    __slots__ = ("max_tokens", "until_lookup", "lookup_rounds")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    until_lookup: _common_pb2.LookupStop
    lookup_rounds: LookupRounds
    def __init__(self, max_tokens: _Optional[int] = ..., until_lookup: _Optional[_Union[_common_pb2.LookupStop, _Mapping]] = ..., lookup_rounds: _Optional[_Union[LookupRounds, _Mapping]] = ...) -> None: ...

class LookupRounds(_message.Message):
    __slots__ = ("sizes", "max_draft_tokens", "room")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    sizes: _common_pb2.LookupStop
    max_draft_tokens: int
    room: int
    def __init__(self, sizes: _Optional[_Union[_common_pb2.LookupStop, _Mapping]] = ..., max_draft_tokens: _Optional[int] = ..., room: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("session_id", "round", "base_len", "decision", "stretch_pass", "discarded")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    STRETCH_PASS_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    base_len: int
    decision: Decision
    stretch_pass: StretchPass
    discarded: Discarded
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., base_len: _Optional[int] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., stretch_pass: _Optional[_Union[StretchPass, _Mapping]] = ..., discarded: _Optional[_Union[Discarded, _Mapping]] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "next_token_kind", "committed_len", "target_compute_ns", "finish_reason", "step", "path", "target_handled_ns")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_KIND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TARGET_HANDLED_NS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    next_token_kind: _common_pb2.NextTokenKind
    committed_len: int
    target_compute_ns: int
    finish_reason: _common_pb2.FinishReason
    step: _common_pb2.StepLoad
    path: _containers.RepeatedScalarFieldContainer[int]
    target_handled_ns: int
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., next_token_kind: _Optional[_Union[_common_pb2.NextTokenKind, str]] = ..., committed_len: _Optional[int] = ..., target_compute_ns: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., step: _Optional[_Union[_common_pb2.StepLoad, _Mapping]] = ..., path: _Optional[_Iterable[int]] = ..., target_handled_ns: _Optional[int] = ...) -> None: ...

class StretchPass(_message.Message):
    __slots__ = ("decision", "num_looked_up", "accepted_token_ids", "ended")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    num_looked_up: int
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ended: bool
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ..., num_looked_up: _Optional[int] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., ended: _Optional[bool] = ...) -> None: ...

class Discarded(_message.Message):
    __slots__ = ("committed_len",)
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    committed_len: int
    def __init__(self, committed_len: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "base_len", "sampling", "max_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_len: int
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., base_len: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class DecodeToken(_message.Message):
    __slots__ = ("token_id", "committed_len", "compute_ns", "step")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    committed_len: int
    compute_ns: int
    step: _common_pb2.StepLoad
    def __init__(self, token_id: _Optional[int] = ..., committed_len: _Optional[int] = ..., compute_ns: _Optional[int] = ..., step: _Optional[_Union[_common_pb2.StepLoad, _Mapping]] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerResponse(_message.Message):
    __slots__ = ("tokenizer_json_gzip", "chat_template", "special_tokens", "clean_up_tokenization_spaces", "fingerprint", "model_id")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOKENIZER_JSON_GZIP_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLEAN_UP_TOKENIZATION_SPACES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json_gzip: bytes
    chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    clean_up_tokenization_spaces: bool
    fingerprint: str
    model_id: str
    def __init__(self, tokenizer_json_gzip: _Optional[bytes] = ..., chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., clean_up_tokenization_spaces: _Optional[bool] = ..., fingerprint: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...
