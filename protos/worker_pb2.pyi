from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "priority", "num_stored_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    priority: int
    num_stored_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., num_stored_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("output", "finish_reason", "num_cached_tokens", "queue_ms", "compute_ms", "handoff", "kv_push_ms")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_MS_FIELD_NUMBER: _ClassVar[int]
    output: _common_pb2.TokenOutput
    finish_reason: _common_pb2.FinishReason
    num_cached_tokens: int
    queue_ms: float
    compute_ms: float
    handoff: _common_pb2.KVHandoff
    kv_push_ms: float
    def __init__(self, output: _Optional[_Union[_common_pb2.TokenOutput, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., handoff: _Optional[_Union[_common_pb2.KVHandoff, _Mapping]] = ..., kv_push_ms: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "priority", "output_token_ids", "handoff")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    priority: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    handoff: _common_pb2.KVHandoff
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., handoff: _Optional[_Union[_common_pb2.KVHandoff, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("output", "finish_reason", "num_cached_tokens", "queue_ms", "kv_pull_ms", "prefill_ms")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    output: _common_pb2.TokenOutput
    finish_reason: _common_pb2.FinishReason
    num_cached_tokens: int
    queue_ms: float
    kv_pull_ms: float
    prefill_ms: float
    def __init__(self, output: _Optional[_Union[_common_pb2.TokenOutput, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., kv_pull_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("handed_back",)
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    handed_back: int
    def __init__(self, handed_back: _Optional[int] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfoResponse(_message.Message):
    __slots__ = ("role", "model", "model_fingerprint", "block_size", "max_model_len", "vocab_size", "dtype", "kvstore_address", "eos_token_ids", "num_kv_blocks")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    model_fingerprint: bytes
    block_size: int
    max_model_len: int
    vocab_size: int
    dtype: str
    kvstore_address: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_kv_blocks: int
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kvstore_address: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_kv_blocks: _Optional[int] = ...) -> None: ...

class WorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_loading", "num_requests", "active_rpcs", "used_kv_blocks", "total_kv_blocks", "pending_kv_pushes", "pending_kv_pulls", "requests_total", "prompt_tokens_computed", "generation_tokens", "kv_blocks_saved", "kv_blocks_loaded", "kv_load_failures", "prefix_cache_hit_rate", "num_preemptions", "queued_prompt_tokens", "kv_staging_blocks_in_use", "kv_staging_fallbacks")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RPCS_FIELD_NUMBER: _ClassVar[int]
    USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_KV_PUSHES_FIELD_NUMBER: _ClassVar[int]
    PENDING_KV_PULLS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SAVED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STAGING_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    KV_STAGING_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_loading: int
    num_requests: int
    active_rpcs: int
    used_kv_blocks: int
    total_kv_blocks: int
    pending_kv_pushes: int
    pending_kv_pulls: int
    requests_total: int
    prompt_tokens_computed: int
    generation_tokens: int
    kv_blocks_saved: int
    kv_blocks_loaded: int
    kv_load_failures: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    queued_prompt_tokens: int
    kv_staging_blocks_in_use: int
    kv_staging_fallbacks: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_loading: _Optional[int] = ..., num_requests: _Optional[int] = ..., active_rpcs: _Optional[int] = ..., used_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., pending_kv_pushes: _Optional[int] = ..., pending_kv_pulls: _Optional[int] = ..., requests_total: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., kv_blocks_saved: _Optional[int] = ..., kv_blocks_loaded: _Optional[int] = ..., kv_load_failures: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., kv_staging_blocks_in_use: _Optional[int] = ..., kv_staging_fallbacks: _Optional[int] = ...) -> None: ...
