"""A request's life inside one engine, counted in tokens (computed against total)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.spec_decode.control import SpecState
    from engine.structured.compiler import CompiledGrammar, GrammarState


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > RUNNING`` means finished."""

    WAITING = 0
    WAITING_FOR_KV = 1  # blocks allocated, its KV is being loaded from outside (consumer role)
    PREEMPTED = 2
    RUNNING = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_PREFILLED = 7  # producer role: first token sampled, the KV handed out for decode elsewhere
    FINISHED_GRAMMAR = 8  # its structured-output grammar allows no further token: the output is cut short

    @property
    def finished(self) -> bool:
        return self > RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_PREFILLED: "prefilled",
    RequestStatus.FINISHED_GRAMMAR: "grammar_error",
}


class RequestHandedBack(Exception):
    """The engine gave a running request up (its worker is draining): the caller continues it elsewhere."""


@dataclass(slots=True)
class TokenLogprobs:
    """The chosen token's logprob and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True, frozen=True)
class RequestOptions:
    """Everything about a request beyond its prompt and sampling, as one value instead of loose keywords.

    ``cache_salt``: the tenant's prefix-cache namespace; ``""`` is normalised to ``None`` here, once, because
    protobuf strings cannot be absent and both mean "no salt".
    ``output_token_ids``: tokens already generated elsewhere (a producer's first token, a migrated
    request's outputs); they are not streamed again.
    ``num_external_tokens``: how many leading tokens of prompt + outputs have their KV loaded through the
    connector instead of computed here.
    ``block_hashes``: the keys of leading full blocks of prompt + outputs (``engine.block_hash``, this
    engine's fingerprint and ``cache_salt``), when the caller already had to compute them; the engine then
    hashes only the blocks beyond. The engine checks their count and size, not their content (that would
    mean hashing again): a wrong key files blocks under another prefix, so pass only keys computed over
    exactly these tokens. With a load that ends in a partial block, they stop before it: the connector
    finds that block by request, not by key.
    ``grammar``: the request's structured-output constraint, compiled already (``AsyncEngine`` compiles it
    off the step loop); without it, the engine compiles ``params.structured`` itself, blocking.

    Sequences are copied into tuples so that the value really is immutable. The values are validated by
    the engine that takes them (``Engine.add_request``), where the limits they depend on are known.
    """

    priority: int = 0  # lower is served first
    cache_salt: str | None = None
    output_token_ids: Sequence[int] = ()
    num_external_tokens: int = 0
    block_hashes: Sequence[bytes] | None = None
    grammar: CompiledGrammar | None = None

    def __post_init__(self) -> None:
        if self.cache_salt == "":
            object.__setattr__(self, "cache_salt", None)
        object.__setattr__(self, "output_token_ids", tuple(self.output_token_ids or ()))
        if self.block_hashes is not None:
            object.__setattr__(self, "block_hashes", tuple(self.block_hashes))


@dataclass(slots=True, eq=False)  # identity: list membership must not compare token lists
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0  # set by the scheduler: breaks ties between equal priorities, by arrival
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    scheduled_time: float | None = None  # first admitted (blocks allocated): the end of its queueing
    loaded_time: float | None = None  # its external KV arrived (consumer role)
    first_token_time: float | None = None  # the first token this engine sampled for it
    block_hashes: list[bytes] = field(default_factory=list)  # keys of its full blocks, in order
    num_cached_blocks: int = 0  # leading blocks registered in (or taken from) the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_external_tokens: int = 0  # leading tokens whose KV is loaded from outside (consumer role)
    num_saved_blocks: int = 0  # leading blocks handed to the KV connector (producer role)
    grammar: GrammarState | None = None  # structured output: the matcher, advanced over every output token
    spec: SpecState | None = None  # speculative decoding: its drafts so far, and whether it is pausing

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(slots=True, frozen=True)
class RequestTimes:
    """Where a request's time went inside one engine before its first token, in seconds."""

    queue: float  # arrival -> admitted
    kv_load: float  # admitted -> external KV loaded (0 without a load)
    prefill: float  # the end of those -> first token sampled
    arrival: float = 0.0  # time.monotonic() at add_request: the others are offsets from here, in order

    @classmethod
    def of(cls, r: Request) -> RequestTimes:
        scheduled = r.scheduled_time if r.scheduled_time is not None else r.arrival_time
        loaded = r.loaded_time if r.loaded_time is not None else scheduled
        first = r.first_token_time if r.first_token_time is not None else loaded
        return cls(scheduled - r.arrival_time, loaded - scheduled, first - loaded, r.arrival_time)

    @property
    def scheduled(self) -> float:
        return self.arrival + self.queue

    @property
    def loaded(self) -> float:
        return self.scheduled + self.kv_load

    @property
    def first_token(self) -> float:
        return self.loaded + self.prefill


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: the delta, not the whole text."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens not computed here: cached in the engine or loaded from outside
    times: RequestTimes | None = None  # on the first output this engine produced for the request
    num_draft_tokens: int = 0  # speculative decoding, so far in this engine: tokens proposed for it
    num_accepted_tokens: int = 0  # and those the target accepted
