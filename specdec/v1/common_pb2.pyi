from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NextTokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEXT_TOKEN_KIND_UNSPECIFIED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_RECOVERED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_BONUS: _ClassVar[NextTokenKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class WorkerPool(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_POOL_UNSPECIFIED: _ClassVar[WorkerPool]
    WORKER_POOL_DRAFT: _ClassVar[WorkerPool]
    WORKER_POOL_TARGET: _ClassVar[WorkerPool]
NEXT_TOKEN_KIND_UNSPECIFIED: NextTokenKind
NEXT_TOKEN_KIND_RECOVERED: NextTokenKind
NEXT_TOKEN_KIND_BONUS: NextTokenKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CANCELLED: FinishReason
WORKER_POOL_UNSPECIFIED: WorkerPool
WORKER_POOL_DRAFT: WorkerPool
WORKER_POOL_TARGET: WorkerPool

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("num_speculative_tokens", "drafter", "prompt_lookup_min", "prompt_lookup_max", "adaptive", "draft_top_k")
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    num_speculative_tokens: int
    drafter: str
    prompt_lookup_min: int
    prompt_lookup_max: int
    adaptive: bool
    draft_top_k: int
    def __init__(self, num_speculative_tokens: _Optional[int] = ..., drafter: _Optional[str] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., adaptive: _Optional[bool] = ..., draft_top_k: _Optional[int] = ...) -> None: ...

class LookupStop(_message.Message):
    __slots__ = ("min_ngram", "max_ngram")
    MIN_NGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_FIELD_NUMBER: _ClassVar[int]
    min_ngram: int
    max_ngram: int
    def __init__(self, min_ngram: _Optional[int] = ..., max_ngram: _Optional[int] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("worker_id", "worker_address", "session_id", "committed_len")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_address: str
    session_id: str
    committed_len: int
    def __init__(self, worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., session_id: _Optional[str] = ..., committed_len: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("round", "base_len", "num_drafted", "num_accepted", "next_token_kind", "draft_ns", "verify_rtt_ns", "target_compute_ns", "proposal_bytes", "verdict_bytes", "queue_ns", "batch_tokens", "batch_sessions", "stretch")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_RTT_NS_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERDICT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STRETCH_FIELD_NUMBER: _ClassVar[int]
    round: int
    base_len: int
    num_drafted: int
    num_accepted: int
    next_token_kind: NextTokenKind
    draft_ns: int
    verify_rtt_ns: int
    target_compute_ns: int
    proposal_bytes: int
    verdict_bytes: int
    queue_ns: int
    batch_tokens: int
    batch_sessions: int
    stretch: bool
    def __init__(self, round: _Optional[int] = ..., base_len: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., next_token_kind: _Optional[_Union[NextTokenKind, str]] = ..., draft_ns: _Optional[int] = ..., verify_rtt_ns: _Optional[int] = ..., target_compute_ns: _Optional[int] = ..., proposal_bytes: _Optional[int] = ..., verdict_bytes: _Optional[int] = ..., queue_ns: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., batch_sessions: _Optional[int] = ..., stretch: _Optional[bool] = ...) -> None: ...

class StepLoad(_message.Message):
    __slots__ = ("queue_ns", "step_ns", "batch_tokens", "batch_sessions", "waiting_sessions", "cost_base_ns", "cost_per_token_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COST_BASE_NS_FIELD_NUMBER: _ClassVar[int]
    COST_PER_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    step_ns: int
    batch_tokens: int
    batch_sessions: int
    waiting_sessions: int
    cost_base_ns: float
    cost_per_token_ns: float
    def __init__(self, queue_ns: _Optional[int] = ..., step_ns: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., batch_sessions: _Optional[int] = ..., waiting_sessions: _Optional[int] = ..., cost_base_ns: _Optional[float] = ..., cost_per_token_ns: _Optional[float] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("num_generated_tokens", "num_rounds", "num_drafted", "num_accepted", "acceptance_rate", "mean_accepted_per_round", "accepted_per_position", "drafted_per_position", "prefill_ns", "draft_ns", "verify_ns", "target_compute_ns", "network_ns", "orchestrator_ns", "total_ns", "num_prefill_tokens", "num_failovers", "num_streamed_tokens", "queue_ns")
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_NS_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_NS_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    num_generated_tokens: int
    num_rounds: int
    num_drafted: int
    num_accepted: int
    acceptance_rate: float
    mean_accepted_per_round: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    prefill_ns: int
    draft_ns: int
    verify_ns: int
    target_compute_ns: int
    network_ns: int
    orchestrator_ns: int
    total_ns: int
    num_prefill_tokens: int
    num_failovers: int
    num_streamed_tokens: int
    queue_ns: int
    def __init__(self, num_generated_tokens: _Optional[int] = ..., num_rounds: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_per_round: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., prefill_ns: _Optional[int] = ..., draft_ns: _Optional[int] = ..., verify_ns: _Optional[int] = ..., target_compute_ns: _Optional[int] = ..., network_ns: _Optional[int] = ..., orchestrator_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., num_prefill_tokens: _Optional[int] = ..., num_failovers: _Optional[int] = ..., num_streamed_tokens: _Optional[int] = ..., queue_ns: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "tokenizer_fingerprint", "vocab_size", "context_length", "device", "dtype", "step_ms", "row_invariance")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    ROW_INVARIANCE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokenizer_fingerprint: str
    vocab_size: int
    context_length: int
    device: str
    dtype: str
    step_ms: _containers.RepeatedScalarFieldContainer[float]
    row_invariance: str
    def __init__(self, model_id: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., step_ms: _Optional[_Iterable[float]] = ..., row_invariance: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("active_sessions", "max_sessions", "cached_tokens", "max_cached_tokens", "queued_calls", "running_calls", "max_running", "mean_batch_tokens", "max_batch_tokens")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_CALLS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_CALLS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    max_sessions: int
    cached_tokens: int
    max_cached_tokens: int
    queued_calls: int
    running_calls: int
    max_running: int
    mean_batch_tokens: float
    max_batch_tokens: int
    def __init__(self, active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., max_cached_tokens: _Optional[int] = ..., queued_calls: _Optional[int] = ..., running_calls: _Optional[int] = ..., max_running: _Optional[int] = ..., mean_batch_tokens: _Optional[float] = ..., max_batch_tokens: _Optional[int] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("session_id", "base_len", "token_ids", "resumes_stream")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_STREAM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_len: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    resumes_stream: bool
    def __init__(self, session_id: _Optional[str] = ..., base_len: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., resumes_stream: _Optional[bool] = ...) -> None: ...

class ExtendResponse(_message.Message):
    __slots__ = ("committed_len", "prefill_ns")
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    committed_len: int
    prefill_ns: int
    def __init__(self, committed_len: _Optional[int] = ..., prefill_ns: _Optional[int] = ...) -> None: ...

class TruncateRequest(_message.Message):
    __slots__ = ("session_id", "length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class TruncateResponse(_message.Message):
    __slots__ = ("committed_len",)
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    committed_len: int
    def __init__(self, committed_len: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("worker_id", "model", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: ModelInfo
    load: WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("pool", "worker_id", "address", "model", "load", "last_heartbeat_unix_ms")
    POOL_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    pool: WorkerPool
    worker_id: str
    address: str
    model: ModelInfo
    load: WorkerLoad
    last_heartbeat_unix_ms: int
    def __init__(self, pool: _Optional[_Union[WorkerPool, str]] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., last_heartbeat_unix_ms: _Optional[int] = ...) -> None: ...
