"""OpenAI request bodies to ``GenerateRequest`` messages: one per choice.

A completions request with a list of prompts is a batch: each prompt gets ``n`` choices, numbered
``prompt_index * n + i`` as OpenAI numbers them. Choice ``i`` of a prompt is request ``<id>-<choice>``
with ``seed + i`` (the same seed for every choice would give ``n`` copies of one answer).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from gateway.openai_api.errors import bad_request
from gateway.openai_api.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from gateway.openai_api.structured import structured_output
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import tokenizer_pb2 as tpb

MAX_LOGPROBS = 20


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int  # choices of one prompt share its KV: the first goes ahead, the rest follow its prefill
    request: gpb.GenerateRequest
    echo: str | list[int] | None = None  # completions with echo: the prompt, put before the text


@dataclass(slots=True)
class Plan:
    """What one HTTP request asks for."""

    id: str  # the response's id: cmpl-... or chatcmpl-...
    choices: list[Choice]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None  # top alternatives asked for per token (0: the chosen token's only); None: no logprobs


def completion_plan(body: CompletionRequest) -> Plan:
    if body.suffix:
        raise bad_request("`suffix` is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("`best_of` other than `n` is not supported", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad_request("`echo` with `logprobs` needs the prompt's log probabilities, which are not served",
                          "echo")
    _check_logprobs(body.logprobs, "logprobs")
    prompts = _prompts(body.prompt)
    if len(prompts) * body.n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts times n={body.n} is more than {MAX_CHOICES} choices", "n")
    rid = _request_id(body, "cmpl")
    choices = []
    for p, prompt in enumerate(prompts):
        base = _request(body, body.max_tokens, body.logprobs)
        base.add_special_tokens = body.add_special_tokens
        if isinstance(prompt, str):
            base.prompt = prompt
        else:
            base.token_ids.ids.extend(prompt)
        for i in range(body.n):
            index = p * body.n + i
            choices.append(Choice(index, p, _choice(base, rid, index, i, body.seed),
                                  prompt if body.echo else None))
    return _plan(rid, choices, body, body.logprobs)


def chat_plan(body: ChatCompletionRequest) -> Plan:
    if not body.add_generation_prompt and not body.continue_final_message:
        raise bad_request("`add_generation_prompt: false` is supported with `continue_final_message: true` only",
                          "add_generation_prompt")
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    _check_logprobs(top, "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    base = _request(body, max_tokens, (top or 0) if body.logprobs else None)
    base.chat.CopyFrom(tpb.ChatMessages(messages=[_message(m, i) for i, m in enumerate(body.messages)],
                                        continue_final_message=body.continue_final_message))
    rid = _request_id(body, "chatcmpl")
    choices = [Choice(i, 0, _choice(base, rid, i, i, body.seed)) for i in range(body.n)]
    return _plan(rid, choices, body, (top or 0) if body.logprobs else None)


def _plan(rid: str, choices: list[Choice], body: SamplingFields, logprobs: int | None) -> Plan:
    options = body.stream_options
    include = bool(body.stream and options and options.include_usage)
    return Plan(rid, choices, body.n, body.stream, include, include and options.continuous_usage_stats, logprobs)


def _request(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> gpb.GenerateRequest:
    _check_ids(body.stop_token_ids or [], "stop_token_ids")
    s = cpb.SamplingParams(ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids or [])
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if body.top_k is not None:
        s.top_k = -1 if body.top_k == 0 else body.top_k  # vLLM: 0 and -1 both mean every token
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if logprobs is not None:
        s.logprobs = logprobs
    structured = structured_output(body)
    if structured is not None:
        s.structured.CopyFrom(structured)
    return gpb.GenerateRequest(
        model=body.model or "", sampling=s, stop=body.stop_list,
        include_stop_str_in_output=body.include_stop_str_in_output, cache_salt=body.cache_salt or "",
        priority=body.priority, keep_special_tokens=not body.skip_special_tokens)


def _choice(base: gpb.GenerateRequest, rid: str, index: int, i: int, seed: int | None) -> gpb.GenerateRequest:
    req = gpb.GenerateRequest()
    req.CopyFrom(base)
    req.request_id = f"{rid}-{index}"
    if seed is not None:
        req.sampling.seed = (seed + i) % 2**64
    return req


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """The prompt field's four shapes as a list of prompts: text, or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("`prompt` is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        _check_ids(prompt, "prompt")
        return [list(prompt)]
    for p in prompt:
        if isinstance(p, list):
            if not p:
                raise bad_request("`prompt` holds an empty list of token ids", "prompt")
            _check_ids(p, "prompt")
    return list(prompt)


def _check_ids(ids: list[int], param: str) -> None:
    bad = next((i for i in ids if not 0 <= i < 2**32), None)
    if bad is not None:
        raise bad_request(f"`{param}`: token id {bad} is not a valid id", param)


def _check_logprobs(value: int | None, param: str) -> None:
    if value is not None and value > MAX_LOGPROBS:
        raise bad_request(f"`{param}` must be at most {MAX_LOGPROBS}, not {value}", param)


def _message(m: ChatMessage, index: int) -> tpb.ChatMessage:
    if m.content is None or isinstance(m.content, str):
        return tpb.ChatMessage(role=m.role, content=m.content or "")
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"`messages[{index}].content`: only text parts are served, not {part.type!r}",
                              f"messages.{index}.content")
        parts.append(part.text)
    return tpb.ChatMessage(role=m.role, content="\n".join(parts))


def _request_id(body: SamplingFields, prefix: str) -> str:
    """The client's id (checked by the gateway's validation, with the choice suffix), or a fresh one."""
    return body.request_id if body.request_id else f"{prefix}-{uuid.uuid4().hex}"
