"""``GenerateResponse`` messages to OpenAI's response objects: streamed chunks, whole responses, usage.

One ``Render`` per HTTP request. It keeps, per choice, what a whole response needs (text, log
probabilities, finish) and, per prompt, what usage counts: the prompt once, every choice's completion.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.openai_api.convert import Choice, Plan
from gateway.openai_api.token_names import TokenNames
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb

# grammar_error: a structured-output grammar allowed no further token (tandem's; not one of OpenAI's values)
FINISH = {cpb.FINISH_REASON_STOP: "stop", cpb.FINISH_REASON_LENGTH: "length",
          cpb.FINISH_REASON_GRAMMAR_ERROR: "grammar_error"}
TIMINGS = tuple(f.name for f in cpb.Timings.DESCRIPTOR.fields)
# JSON has no -Infinity: a token its structured-output grammar forbids (a top alternative with logprob -inf) is
# shown with vLLM's floor instead.
LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class ChoiceState:
    choice: Choice
    text: list[str] = field(default_factory=list)
    logprobs: list[cpb.TokenLogprob] = field(default_factory=list)
    tokens: int = 0
    text_offset: int = 0  # completions' logprobs.text_offset of the next token
    last: gpb.GenerateResponse | None = None  # the finishing message


@dataclass(slots=True)
class PromptUsage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's first choice: the others follow its prefill


class Render:
    def __init__(self, plan: Plan, kind: str, model: str, fingerprint: str, names: TokenNames | None) -> None:
        self.plan = plan
        self.chat = kind == "chat"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        self.model = model
        self.fingerprint = fingerprint
        self.names = names
        self.created = int(time.time())
        self.states = {c.index: ChoiceState(c) for c in plan.choices}
        self.prompts: dict[int, PromptUsage] = {}

    # -- every message -----------------------------------------------------------------------------

    async def absorb(self, index: int, msg: gpb.GenerateResponse, metadata=()) -> ChoiceState:
        """Take one message of a choice in; learns the names of its tokens when log probabilities are on."""
        state = self.states[index]
        state.tokens += len(msg.token_ids)
        if msg.HasField("usage"):
            usage = self.prompts.setdefault(state.choice.prompt_index, PromptUsage())
            usage.prompt_tokens = msg.usage.prompt_tokens
            if state.choice.index % self.plan.n == 0:
                usage.cached_tokens = msg.usage.cached_tokens
        if msg.finish_reason != cpb.FINISH_REASON_UNSPECIFIED:
            state.last = msg
        if self.plan.logprobs is not None and self.names is not None and msg.logprobs:
            await self.names.learn([i for lp in msg.logprobs for i in (lp.token_id, *(t.token_id for t in lp.top))],
                                   metadata)
        return state

    def usage(self) -> dict:
        prompt = sum(u.prompt_tokens for u in self.prompts.values())
        completion = sum(s.tokens for s in self.states.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in self.prompts.values())}}

    # -- streaming ---------------------------------------------------------------------------------

    def chunk(self, state: ChoiceState, msg: gpb.GenerateResponse, echo: str = "") -> dict:
        """The chunk of one message of one choice."""
        choice: dict = {"index": state.choice.index}
        text = echo + msg.text
        if self.chat:
            delta = {"content": text}
            if state.tokens == len(msg.token_ids):  # the choice's first chunk names the role
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(state, msg.logprobs, len(echo)) if self.plan.logprobs is not None else None
        self._finish_fields(choice, msg)
        out = self._envelope(self.chunk_object, [choice])
        if self.plan.continuous_usage:
            out["usage"] = self.usage()
        return out

    def usage_chunk(self) -> dict:
        out = self._envelope(self.chunk_object, [])
        out["usage"] = self.usage()
        return out

    # -- whole responses ---------------------------------------------------------------------------

    def keep(self, state: ChoiceState, msg: gpb.GenerateResponse) -> None:
        state.text.append(msg.text)
        state.logprobs.extend(msg.logprobs)

    def response(self, echoes: dict[int, str]) -> dict:
        choices = []
        for index in sorted(self.states):
            state = self.states[index]
            echo = echoes.get(index, "")
            text = echo + "".join(state.text)
            choice: dict = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            state.text_offset = 0
            choice["logprobs"] = (self._logprobs(state, state.logprobs, len(echo))
                                  if self.plan.logprobs is not None else None)
            self._finish_fields(choice, state.last)
            choices.append(choice)
        out = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        out["usage"] = self.usage()
        return out

    # -- parts -------------------------------------------------------------------------------------

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.plan.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def _finish_fields(self, choice: dict, msg: gpb.GenerateResponse | None) -> None:
        """finish_reason and vLLM's stop_reason (the stop string, the stop token id, or null for an
        end-of-sequence token); on the last message, tandem's own extension ``tandem``: the choice's timings
        in milliseconds (TTFT and its breakdown), the workers that served it, its cached prompt tokens."""
        finished = msg is not None and msg.finish_reason != cpb.FINISH_REASON_UNSPECIFIED
        choice["finish_reason"] = FINISH.get(msg.finish_reason, "stop") if finished else None
        choice["stop_reason"] = _stop_reason(msg) if finished else None
        if finished:
            choice["tandem"] = {
                "timings_ms": {name.removesuffix("_ms"): round(getattr(msg.timings, name), 3) for name in TIMINGS},
                "prefill_worker": msg.prefill_worker, "decode_worker": msg.decode_worker,
                "cached_tokens": msg.usage.cached_tokens,
            }

    def _logprobs(self, state: ChoiceState, lps, offset: int) -> dict:
        if self.chat:
            return {"content": [self._chat_logprob(lp) for lp in lps]}
        tokens, values, tops, offsets = [], [], [], []
        at = state.text_offset + offset
        for lp in lps:
            text = self.names.text(lp.token_id)
            tokens.append(text)
            values.append(_finite(lp.logprob))
            top = {self.names.text(t.token_id): _finite(t.logprob) for t in lp.top}
            top.setdefault(text, _finite(lp.logprob))  # the chosen token is always named, as vLLM does
            tops.append(top)
            offsets.append(at)
            at += len(text)
        state.text_offset = at - offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprob(self, lp: cpb.TokenLogprob) -> dict:
        entry = self._named(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._named(t.token_id, t.logprob) for t in lp.top]
        return entry

    def _named(self, token_id: int, logprob: float) -> dict:
        return {"token": self.names.text(token_id), "logprob": _finite(logprob),
                "bytes": list(self.names.raw(token_id))}


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (and NaN, never expected) -> the floor


def _stop_reason(msg: gpb.GenerateResponse) -> str | int | None:
    reason = msg.stop_reason
    if not reason:
        return None
    if reason.isascii() and reason.isdigit() and msg.token_ids and msg.token_ids[-1] == int(reason):
        return int(reason)  # a stop token id (a stop string that is the last token's digits reads the same)
    return reason
