"""The request bodies of the OpenAI-compatible API, as clients send them.

Field names and defaults follow OpenAI's API and vLLM's extensions to it (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt``, ``priority``, ...), so a client
written for vLLM works unchanged. Unknown fields are ignored, as vLLM does. Only the *shape* is checked
here; the ranges are checked by the gateway's own validation (``gateway.validation``), the same code and
the same messages as the gRPC API's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16  # n (times the prompts of a batch): choices of one request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False  # a last chunk with ``choices: []`` and the usage
    continuous_usage_stats: bool = False  # with include_usage: the usage so far on every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted; the schema is enforced either way (as vLLM does)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object (its newer name for the ``guided_*`` fields)."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-(2**31), lt=2**31)  # vLLM: -1 or 0 is every token
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    cache_salt: str | None = None
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    request_id: str | None = None  # vLLM's: names the request in traces and logs (choices add ``-<index>``)
    # Structured outputs: OpenAI's response_format, or vLLM's guided_* fields / structured_outputs (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, lt=2**32)  # OpenAI's and vLLM's default for completions
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, lt=2**32)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=0, lt=2**32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


Kind = Literal["completion", "chat"]
