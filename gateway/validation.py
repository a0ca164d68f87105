"""Everything a client sends is checked here, before any worker sees it.

Each check raises ``InvalidRequest`` with a message that names the field and
the allowed range, which the servicer returns as INVALID_ARGUMENT. Checks that
need the prompt's length (max_tokens against the model length) run after
tokenization, in ``check_length``.
"""

from __future__ import annotations

import asyncio
import math
import re
import uuid
from dataclasses import dataclass, field

from common.pb_convert import sampling_from_pb, sampling_to_pb
from engine.sampling_params import SamplingParams
from engine.structured import check_structured
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # fullmatch: `$` would let a trailing newline through
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_CHAT_MESSAGES = 1024
MAX_PROMPT_CHARS = 4 * 2**20  # a prompt, or all of a chat's messages together
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_MODEL_CHARS = 256
# The public port's largest message (a 4M-character prompt of 4-byte characters fits); internal ports take
# common.service.MAX_MESSAGE_BYTES. Larger messages are refused by gRPC itself with RESOURCE_EXHAUSTED.
MAX_REQUEST_BYTES = 16 * 2**20
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class InvalidRequest(ValueError):
    """The client's request is wrong; the message says how."""


class UnknownModel(InvalidRequest):
    """A model this gateway does not serve: INVALID_ARGUMENT on gRPC, 404 on the OpenAI-compatible front."""


@dataclass(slots=True)
class ModelLimits:
    """What the workers serve, learned from their Info."""

    model: str
    vocab_size: int
    max_model_len: int
    max_request_tokens: int  # what one request's KV may take in the smallest worker's pool
    max_prompt_tokens: int = 0  # the gateway's own limit (--max-prompt-tokens); 0: the model's

    @property
    def prompt_token_limit(self) -> int:
        cap = min(self.max_model_len, self.max_request_tokens) - 1
        return min(cap, self.max_prompt_tokens) if self.max_prompt_tokens > 0 else cap


@dataclass(slots=True)
class ValidRequest:
    request_id: str  # the client's id (or a generated one)
    params: SamplingParams  # max_tokens resolved once the prompt length is known
    max_tokens_set: bool
    stop: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None  # given as ids: no tokenizer hop
    # ``params`` as every worker gets it, every field set (a worker never falls back to a default the gateway
    # did not check): made once per request, by ``check_length``, and sent as is on every attempt and migration
    sampling: cpb.SamplingParams | None = None


def validate(req: gpb.GenerateRequest, limits: ModelLimits) -> ValidRequest:
    request_id = _request_id(req.request_id)
    if req.model and req.model != limits.model:
        shown = repr(req.model) if len(req.model) <= MAX_MODEL_CHARS else f"of {len(req.model)} characters"
        raise UnknownModel(f"unknown model {shown}: this gateway serves {limits.model!r}")
    token_ids = _input(req, limits)
    _check_sampling(req.sampling)
    try:
        params = sampling_from_pb(req.sampling, 1)
    except ValueError as exc:
        raise InvalidRequest(f"sampling: {exc}") from exc
    if req.sampling.HasField("max_tokens") and req.sampling.max_tokens >= limits.max_model_len:
        raise InvalidRequest(f"sampling: max_tokens must be < the model length {limits.max_model_len}, "
                             f"got {req.sampling.max_tokens}")
    if any(t >= limits.vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"sampling: stop_token_ids must be < the vocabulary size {limits.vocab_size}")
    _check_stop(req.stop)
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt is at most {MAX_CACHE_SALT_CHARS} characters")
    if not req.cache_salt.isprintable():  # tenant salts (gateway.auth) hold a NUL no client salt can
        raise InvalidRequest("cache_salt must be printable characters (no control characters)")
    return ValidRequest(request_id, params, req.sampling.HasField("max_tokens"), list(req.stop), token_ids)


async def check_constraint(valid: ValidRequest) -> None:
    """Refuse a structured-output constraint that does not compile, before any worker is busy with it. In a
    thread: a large schema takes tens of milliseconds to check (outside the GIL), and this event loop serves
    every other stream meanwhile."""
    spec = valid.params.structured
    if spec is None:
        return
    try:
        await asyncio.to_thread(check_structured, spec)
    except ValueError as exc:
        raise InvalidRequest(f"sampling: {exc}") from exc


def check_length(valid: ValidRequest, prompt_len: int, limits: ModelLimits) -> None:
    """Resolve an unset max_tokens to the rest of the model length; refuse prompts that cannot fit. The
    parameters are complete only now, so this is where their wire form (``valid.sampling``) is made."""
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty after tokenization")
    if prompt_len > limits.prompt_token_limit:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; this {'gateway' if limits.max_prompt_tokens > 0 else 'model'} "
            f"takes at most {limits.prompt_token_limit} prompt tokens"
        )
    room = min(limits.max_model_len, limits.max_request_tokens) - prompt_len
    if not valid.max_tokens_set:
        valid.params.max_tokens = room
    elif valid.params.max_tokens > room:
        raise InvalidRequest(
            f"prompt ({prompt_len} tokens) + max_tokens ({valid.params.max_tokens}) exceeds the model length "
            f"{min(limits.max_model_len, limits.max_request_tokens)}"
        )
    valid.sampling = sampling_to_pb(valid.params)


def _request_id(given: str) -> str:
    if not given:
        return uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(given):
        raise InvalidRequest("request_id must be 1-128 characters of A-Z a-z 0-9 . _ : -")
    return given


def _input(req: gpb.GenerateRequest, limits: ModelLimits) -> list[int] | None:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("give one of prompt, chat or token_ids")
    if kind == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt is empty")
        if len(req.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"prompt is longer than {MAX_PROMPT_CHARS} characters")
        return None
    if kind == "chat":
        _check_chat(req)
        return None
    ids = list(req.token_ids.ids)
    if not ids:
        raise InvalidRequest("token_ids is empty")
    if len(ids) > limits.prompt_token_limit:
        raise InvalidRequest(f"token_ids has {len(ids)} ids; at most {limits.prompt_token_limit} prompt tokens")
    if max(ids) >= limits.vocab_size:
        raise InvalidRequest(f"token_ids must be < the vocabulary size {limits.vocab_size}, got {max(ids)}")
    return ids


def _check_chat(req: gpb.GenerateRequest) -> None:
    messages = req.chat.messages
    if not messages:
        raise InvalidRequest("chat has no messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"chat has more than {MAX_CHAT_MESSAGES} messages")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"chat.messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                 f"got {m.role!r:.40}")
    if sum(len(m.content) for m in messages) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"chat is longer than {MAX_PROMPT_CHARS} characters")


def _check_sampling(p: cpb.SamplingParams) -> None:
    """A non-finite number is named as such (the engine's range checks refuse it too, as out of range), and
    the ids list, which the engine leaves unbounded, is bounded."""
    for name in FLOAT_PARAMS:
        if p.HasField(name) and not math.isfinite(getattr(p, name)):
            raise InvalidRequest(f"sampling: {name} must be a finite number, got {getattr(p, name)}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"sampling: at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(p.stop_token_ids)}")


def _check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop strings must be 1-{MAX_STOP_CHARS} characters, got {s!r:.40}")
