from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_PREFILLED: _ClassVar[FinishReason]
    FINISH_REASON_MIGRATE: _ClassVar[FinishReason]
    FINISH_REASON_GRAMMAR_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_PREFILLED: FinishReason
FINISH_REASON_MIGRATE: FinishReason
FINISH_REASON_GRAMMAR_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "ignore_eos", "logprobs", "structured", "speculative")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured: StructuredOutput
    speculative: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., speculative: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenOutput(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft_ms", "tokenize_ms", "route_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_push_ms", "first_token_ms", "queue_ms", "prefill_ms", "kv_transfer_ms", "kv_pull_ms", "decode_queue_ms", "e2e_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_MS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tokenize_ms: float
    route_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    kv_push_ms: float
    first_token_ms: float
    queue_ms: float
    prefill_ms: float
    kv_transfer_ms: float
    kv_pull_ms: float
    decode_queue_ms: float
    e2e_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tokenize_ms: _Optional[float] = ..., route_ms: _Optional[float] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_compute_ms: _Optional[float] = ..., kv_push_ms: _Optional[float] = ..., first_token_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., kv_pull_ms: _Optional[float] = ..., decode_queue_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ...) -> None: ...

class KVHandoff(_message.Message):
    __slots__ = ("kvstore_address", "num_tokens", "block_keys", "has_partial", "blocks_failed")
    KVSTORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    HAS_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    kvstore_address: str
    num_tokens: int
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    has_partial: bool
    blocks_failed: int
    def __init__(self, kvstore_address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., has_partial: _Optional[bool] = ..., blocks_failed: _Optional[int] = ...) -> None: ...
