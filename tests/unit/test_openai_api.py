"""The OpenAI-compatible HTTP front's parts, in process: request bodies to plans (``convert``), failures to
OpenAI errors (``errors``), GenerateResponse messages to chunks and responses (``render``, its token names
from a real tokenizer service on loopback) and the HTTP call context (``context``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import pytest
from pydantic import ValidationError

from common.service import channel, start_server
from common.status import BUG_MESSAGE
from gateway.auth import RETRY_AFTER
from gateway.generation import GenerationError
from gateway.openai_api.context import HttpAbort, HttpCallContext
from gateway.openai_api.convert import MAX_LOGPROBS, Plan, chat_plan, completion_plan
from gateway.openai_api.errors import (
    HTTP_OF,
    ApiError,
    bad_request,
    from_exception,
    from_status,
    from_validation,
    too_large,
)
from gateway.openai_api.fanout import SlowReader
from gateway.openai_api.protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from gateway.openai_api.render import Render
from gateway.openai_api.token_names import TokenNames
from gateway.validation import InvalidRequest, UnknownModel
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import tokenizer_pb2_grpc as tpb_grpc
from tokenizer_svc.server import build_service

# -- helpers -----------------------------------------------------------------------------------------


def completion(**fields) -> Plan:
    fields.setdefault("prompt", "hi")
    return completion_plan(CompletionRequest(**fields))


def chat(**fields) -> Plan:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return chat_plan(ChatCompletionRequest(**fields))


def refused(make: Callable[[], Any]) -> ApiError:
    """The ApiError ``make`` raises: a 400 invalid_request_error."""
    with pytest.raises(ApiError) as err:
        make()
    assert err.value.status == 400
    assert err.value.type == "invalid_request_error"
    return err.value


def shape_error(model: type, **fields) -> ValidationError:
    with pytest.raises(ValidationError) as err:
        model(**fields)
    return err.value


def message(text: str, ids: list[int], *, first: bool = False, finish: int = cpb.FINISH_REASON_UNSPECIFIED,
            stop_reason: str = "", prompt_tokens: int = 5, cached_tokens: int = 2, completion_tokens: int = 0,
            logprobs: list[cpb.TokenLogprob] | None = None) -> gpb.GenerateResponse:
    """A GenerateResponse as the gateway sends it: usage on the first and the last message (prompt tokens
    and cached tokens on the first, the totals on the last with finish_reason and timings)."""
    msg = gpb.GenerateResponse(request_id="r", text=text, token_ids=ids, logprobs=logprobs or [])
    done = finish != cpb.FINISH_REASON_UNSPECIFIED
    if first or done:
        msg.usage.CopyFrom(cpb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                     cached_tokens=cached_tokens))
    if done:
        msg.finish_reason = finish
        msg.stop_reason = stop_reason
        msg.timings.CopyFrom(cpb.Timings(ttft_ms=12.34567, e2e_ms=40.0, tokenize_ms=0.5))
        msg.prefill_worker = "prefill:1"
        msg.decode_worker = "decode:2"
    return msg


def three_messages(finish: int = cpb.FINISH_REASON_LENGTH, stop_reason: str = "",
                   last_ids: tuple[int, ...] = (28,)) -> list[gpb.GenerateResponse]:
    return [message("Hello", [19556], first=True), message(" world", [905]),
            message(",", list(last_ids), finish=finish, stop_reason=stop_reason, completion_tokens=3)]


def stream(render: Render, events: list[tuple[int, gpb.GenerateResponse]]) -> list[dict]:
    """The chunks of ``events`` (choice index, message) in that order, as Exchange makes them."""

    async def go() -> list[dict]:
        chunks = []
        for index, msg in events:
            state = await render.absorb(index, msg)
            chunks.append(render.chunk(state, msg))
        return chunks

    return asyncio.run(go())


def whole(render: Render, events: list[tuple[int, gpb.GenerateResponse]], echoes: dict[int, str] | None = None
          ) -> dict:
    """The non-streamed response of ``events``, as Exchange builds it."""

    async def go() -> dict:
        for index, msg in events:
            render.keep(await render.absorb(index, msg), msg)
        return render.response(echoes or {})

    return asyncio.run(go())


def with_names(tok, test: Callable[[TokenNames], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``test`` with a TokenNames on a real tokenizer service (the default model's) on loopback."""

    async def go() -> Any:
        server = await start_server([build_service(tok)], "127.0.0.1", 0)
        try:
            async with channel(f"127.0.0.1:{server.port}") as ch:
                return await test(TokenNames(tpb_grpc.TokenizerStub(ch)))
        finally:
            await server.stop(0)

    return asyncio.run(go())


# -- convert.completion_plan ---------------------------------------------------------------------------


def test_a_string_prompt_is_one_choice_with_the_prompt_text():
    plan = completion(prompt="Once upon a time", request_id="req1")
    assert (plan.id, plan.n, plan.stream, plan.logprobs) == ("req1", 1, False, None)
    [c] = plan.choices
    assert (c.index, c.prompt_index, c.echo) == (0, 0, None)
    assert c.request.WhichOneof("input") == "prompt"
    assert c.request.prompt == "Once upon a time"
    assert c.request.request_id == "req1-0"


def test_a_generated_id_is_prefixed_cmpl_and_each_choice_adds_its_index():
    plan = completion(n=2)
    assert plan.id.startswith("cmpl-") and len(plan.id) > len("cmpl-")
    assert [c.request.request_id for c in plan.choices] == [f"{plan.id}-0", f"{plan.id}-1"]
    assert chat().id.startswith("chatcmpl-")


def test_a_list_of_prompts_gets_n_choices_each_numbered_prompt_index_times_n_plus_i():
    plan = completion(prompt=["a", "b", "c"], n=2, request_id="x", seed=7)
    assert [(c.index, c.prompt_index) for c in plan.choices] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2)]
    assert [c.request.prompt for c in plan.choices] == ["a", "a", "b", "b", "c", "c"]
    assert [c.request.request_id for c in plan.choices] == [f"x-{i}" for i in range(6)]
    assert [c.request.sampling.seed for c in plan.choices] == [7, 8, 7, 8, 7, 8]  # seed + i, i within its prompt


def test_the_seed_wraps_at_two_to_the_64():
    plan = completion(n=2, seed=2**64 - 1)
    assert [c.request.sampling.seed for c in plan.choices] == [2**64 - 1, 0]


def test_without_a_seed_no_choice_has_one():
    plan = completion(n=3)
    assert not any(c.request.sampling.HasField("seed") for c in plan.choices)


def test_a_token_id_prompt_is_one_prompt_of_token_ids():
    plan = completion(prompt=[1, 2, 3], n=2)
    assert len(plan.choices) == 2
    for c in plan.choices:
        assert c.prompt_index == 0
        assert c.request.WhichOneof("input") == "token_ids"
        assert list(c.request.token_ids.ids) == [1, 2, 3]


def test_a_list_of_token_id_lists_is_a_batch_of_prompts():
    plan = completion(prompt=[[1, 2], [3]], echo=True)
    assert [list(c.request.token_ids.ids) for c in plan.choices] == [[1, 2], [3]]
    assert [c.prompt_index for c in plan.choices] == [0, 1]
    assert [c.echo for c in plan.choices] == [[1, 2], [3]]  # echo: the prompt, decoded later by the app


def test_echo_keeps_a_text_prompt_for_each_choice():
    plan = completion(prompt=["a", "b"], n=2, echo=True)
    assert [c.echo for c in plan.choices] == ["a", "a", "b", "b"]


@pytest.mark.parametrize("prompt", [[], [[1], []]])
def test_an_empty_prompt_list_or_an_empty_id_list_is_a_400_naming_prompt(prompt):
    assert refused(lambda: completion(prompt=prompt)).param == "prompt"


@pytest.mark.parametrize("prompt", [[-1], [5, 2**32], [[1, 2], [-3]]])
def test_a_negative_or_too_large_token_id_is_a_400_naming_prompt(prompt):
    err = refused(lambda: completion(prompt=prompt))
    assert err.param == "prompt"
    assert "is not a valid id" in err.message


@pytest.mark.parametrize("prompt", [[1, [2]], ["a", 1], ["a", [1]]])
def test_a_prompt_of_mixed_types_is_refused_by_its_shape_naming_prompt(prompt):
    err = from_validation(shape_error(CompletionRequest, prompt=prompt))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "prompt")


def test_more_choices_than_max_choices_is_a_400_naming_n():
    err = refused(lambda: completion(prompt=["a", "b", "c"], n=MAX_CHOICES // 2))
    assert err.param == "n"
    assert str(MAX_CHOICES) in err.message
    assert len(completion(prompt=["a", "b"], n=MAX_CHOICES // 2).choices) == MAX_CHOICES  # exactly the limit
    shape_error(CompletionRequest, prompt="a", n=MAX_CHOICES + 1)  # one prompt: n itself is bounded


@pytest.mark.parametrize("stop_token_ids", [[-1], [2**32]])
def test_an_out_of_range_stop_token_id_is_a_400_naming_stop_token_ids(stop_token_ids):
    assert refused(lambda: completion(stop_token_ids=stop_token_ids)).param == "stop_token_ids"


def test_echo_with_logprobs_is_a_400_naming_echo():
    assert refused(lambda: completion(echo=True, logprobs=0)).param == "echo"


def test_suffix_is_a_400_naming_suffix():
    assert refused(lambda: completion(suffix="the end")).param == "suffix"


def test_best_of_other_than_n_is_a_400_and_equal_to_n_is_served():
    assert refused(lambda: completion(n=1, best_of=2)).param == "best_of"
    assert len(completion(n=2, best_of=2).choices) == 2


def test_logprobs_above_twenty_is_a_400_and_twenty_is_served():
    err = refused(lambda: completion(logprobs=MAX_LOGPROBS + 1))
    assert err.param == "logprobs"
    plan = completion(logprobs=MAX_LOGPROBS)
    assert plan.logprobs == MAX_LOGPROBS
    assert plan.choices[0].request.sampling.logprobs == MAX_LOGPROBS


def test_completions_default_to_sixteen_max_tokens_and_an_explicit_value_wins():
    assert completion().choices[0].request.sampling.max_tokens == 16
    assert completion(max_tokens=3).choices[0].request.sampling.max_tokens == 3
    assert not completion(max_tokens=None).choices[0].request.sampling.HasField("max_tokens")


@pytest.mark.parametrize(("top_k", "sent"), [(0, -1), (-1, -1), (5, 5)])
def test_top_k_zero_means_every_token_as_minus_one(top_k, sent):
    assert completion(top_k=top_k).choices[0].request.sampling.top_k == sent


def test_unset_sampling_fields_stay_unset_and_set_ones_are_passed_on():
    s = completion().choices[0].request.sampling
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "logprobs"):
        assert not s.HasField(name), name
    req = completion(temperature=0.5, top_p=0.75, min_p=0.25, presence_penalty=1.5, frequency_penalty=-0.5,
                     repetition_penalty=1.25, stop=["\n", "END"], stop_token_ids=[2], ignore_eos=True,
                     include_stop_str_in_output=True, skip_special_tokens=False, cache_salt="salt", priority=-3,
                     model="m").choices[0].request
    s = req.sampling
    assert (s.temperature, s.top_p, s.min_p) == (0.5, 0.75, 0.25)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (1.5, -0.5, 1.25)
    assert (list(s.stop_token_ids), s.ignore_eos) == ([2], True)
    assert list(req.stop) == ["\n", "END"]
    assert (req.include_stop_str_in_output, req.keep_special_tokens) == (True, True)
    assert (req.cache_salt, req.priority, req.model) == ("salt", -3, "m")
    assert list(completion(stop="x").choices[0].request.stop) == ["x"]


def test_add_special_tokens_defaults_to_true_for_completions():
    assert completion().choices[0].request.add_special_tokens is True
    assert completion(add_special_tokens=False).choices[0].request.add_special_tokens is False


@pytest.mark.parametrize(("stream", "options", "include", "continuous"), [
    (True, {"include_usage": True, "continuous_usage_stats": True}, True, True),
    (True, {"include_usage": True}, True, False),
    (True, {"continuous_usage_stats": True}, False, False),  # continuous usage only with include_usage
    (True, None, False, False),
    (False, {"include_usage": True, "continuous_usage_stats": True}, False, False),  # not streamed: no chunks
])
def test_usage_flags_only_with_stream(stream, options, include, continuous):
    for plan in (completion(stream=stream, stream_options=options), chat(stream=stream, stream_options=options)):
        assert (plan.stream, plan.include_usage, plan.continuous_usage) == (stream, include, continuous)


# -- convert.chat_plan ---------------------------------------------------------------------------------


def test_chat_messages_become_chat_messages_with_text_parts_joined_by_newlines():
    plan = chat(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None},
    ], continue_final_message=True)
    [c] = plan.choices
    assert c.request.WhichOneof("input") == "chat"
    got = [(m.role, m.content) for m in c.request.chat.messages]
    assert got == [("system", "Be brief."), ("user", "one\ntwo"), ("assistant", "")]
    assert c.request.chat.continue_final_message is True
    assert c.echo is None


def test_an_image_part_is_a_400_naming_the_message_s_content():
    messages = [{"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    err = refused(lambda: chat(messages=messages))
    assert err.param == "messages.1.content"
    assert "image_url" in err.message


def test_a_text_part_without_text_is_a_400():
    assert refused(lambda: chat(messages=[{"role": "user", "content": [{"type": "text"}]}])).param == \
        "messages.0.content"


def test_chat_choices_are_numbered_with_seed_plus_i_and_one_prompt():
    plan = chat(n=3, seed=10, request_id="c")
    assert [(c.index, c.prompt_index) for c in plan.choices] == [(0, 0), (1, 0), (2, 0)]
    assert [c.request.request_id for c in plan.choices] == ["c-0", "c-1", "c-2"]
    assert [c.request.sampling.seed for c in plan.choices] == [10, 11, 12]


def test_max_completion_tokens_is_preferred_over_max_tokens_and_chat_has_no_default():
    assert chat(max_tokens=5, max_completion_tokens=7).choices[0].request.sampling.max_tokens == 7
    assert chat(max_tokens=5).choices[0].request.sampling.max_tokens == 5
    assert chat(max_completion_tokens=0).choices[0].request.sampling.max_tokens == 0
    assert not chat().choices[0].request.sampling.HasField("max_tokens")


@pytest.mark.parametrize(("fields", "plan_logprobs"), [
    ({}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 3}, 3),
    ({"logprobs": True, "top_logprobs": 0}, 0),
])
def test_chat_logprobs_and_top_logprobs_map_to_the_sampling_logprobs(fields, plan_logprobs):
    plan = chat(**fields)
    assert plan.logprobs == plan_logprobs
    s = plan.choices[0].request.sampling
    assert (s.logprobs if s.HasField("logprobs") else None) == plan_logprobs


def test_top_logprobs_without_logprobs_is_a_400():
    assert refused(lambda: chat(top_logprobs=2)).param == "top_logprobs"
    assert refused(lambda: chat(top_logprobs=2, logprobs=False)).param == "top_logprobs"


def test_top_logprobs_above_twenty_is_a_400():
    assert refused(lambda: chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1)).param == "top_logprobs"


def test_add_generation_prompt_false_needs_continue_final_message():
    assert refused(lambda: chat(add_generation_prompt=False)).param == "add_generation_prompt"
    plan = chat(add_generation_prompt=False, continue_final_message=True)
    assert plan.choices[0].request.chat.continue_final_message is True


def test_chat_needs_at_least_one_message():
    assert from_validation(shape_error(ChatCompletionRequest, messages=[])).param == "messages"


# -- structured outputs --------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def structured_of(plan: Plan) -> cpb.StructuredOutput | None:
    sampling = plan.choices[0].request.sampling
    return sampling.structured if sampling.HasField("structured") else None


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     cpb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_object"}}, cpb.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, cpb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_json": '{"type": "string"}'}, cpb.StructuredOutput(json_schema='{"type": "string"}')),
    ({"guided_regex": "[a-z]+"}, cpb.StructuredOutput(regex="[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, cpb.StructuredOutput(choice=cpb.Choices(choices=["yes", "no"]))),
    ({"guided_grammar": 'root ::= "a"'}, cpb.StructuredOutput(grammar='root ::= "a"')),
    ({"structured_outputs": {"json": SCHEMA}}, cpb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"choice": ["x"]}}, cpb.StructuredOutput(choice=cpb.Choices(choices=["x"]))),
    ({"structured_outputs": {"json_object": True}}, cpb.StructuredOutput(json_object=True)),
    ({}, None),
])
def test_each_spelling_of_a_constraint_becomes_the_grpc_structured_field(fields, expected):
    assert structured_of(chat(**fields)) == expected
    assert structured_of(completion(**fields)) == expected
    plan = completion(n=3, **fields)
    assert all(c.request.sampling.structured == plan.choices[0].request.sampling.structured for c in plan.choices)


def test_two_constraints_are_a_400_naming_them():
    err = refused(lambda: chat(guided_regex="a+", response_format={"type": "json_object"}))
    assert "response_format, guided_regex" in err.message and err.param == "guided_regex"
    err = refused(lambda: completion(structured_outputs={"regex": "a", "choice": ["a"]}))
    assert "structured_outputs.regex, structured_outputs.choice" in err.message


def test_a_json_schema_response_format_needs_its_schema():
    err = refused(lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "s"}}))
    assert "json_schema.schema" in err.message and err.param == "response_format.json_schema"


def test_an_unknown_response_format_type_is_a_shape_error():
    assert "response_format" in str(shape_error(ChatCompletionRequest, messages=[{"role": "user", "content": "hi"}],
                                                response_format={"type": "yaml"}))


# -- errors --------------------------------------------------------------------------------------------


EXPECTED_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error", None),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", None),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", None),
}


def test_the_expected_table_covers_every_mapping_of_http_of():
    assert set(EXPECTED_HTTP) == set(HTTP_OF)


@pytest.mark.parametrize("code", list(EXPECTED_HTTP), ids=lambda c: c.name)
def test_each_grpc_status_maps_to_its_http_status_type_and_code(code):
    err = from_status(code, "what went wrong")
    status, kind, short = EXPECTED_HTTP[code]
    assert (err.status, err.type, err.code, err.param) == (status, kind, short, None)
    assert err.body() == {"error": {"message": "what went wrong", "type": kind, "param": None, "code": short}}
    assert str(err) == "what went wrong"


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
                                  grpc.StatusCode.ABORTED, grpc.StatusCode.OK], ids=lambda c: c.name)
def test_any_other_grpc_status_is_a_500_internal_error(code):
    err = from_status(code, "x")
    assert (err.status, err.type, err.code) == (500, "internal_error", None)


def test_an_unknown_model_is_a_404_model_not_found():
    err = from_exception(UnknownModel("unknown model 'gpt-9': this gateway serves 'm'"))
    assert (err.status, err.type, err.param, err.code) == (404, "not_found_error", "model", "model_not_found")
    assert err.message == "unknown model 'gpt-9': this gateway serves 'm'"


def test_an_invalid_request_is_a_400_with_its_message():
    err = from_exception(InvalidRequest("temperature must be >= 0, got -1"))
    assert (err.status, err.type, err.code) == (400, "invalid_request_error", None)
    assert err.message == "temperature must be >= 0, got -1"


def test_a_bug_is_a_500_that_does_not_leak_its_message():
    err = from_exception(RuntimeError("secret: password=hunter2 at /srv/db"))
    assert (err.status, err.type) == (500, "internal_error")
    assert err.message == BUG_MESSAGE
    assert "hunter2" not in str(err.body())


def test_an_error_carrying_its_code_keeps_code_message_and_retry_hint():
    err = from_exception(GenerationError(grpc.StatusCode.UNAVAILABLE, "no decode worker is ready"), 2.5)
    assert (err.status, err.type, err.message, err.retry_after) == (503, "service_unavailable_error",
                                                                     "no decode worker is ready", 2.5)
    assert err.headers() == {"Retry-After": "3"}
    slow = from_exception(SlowReader(8))
    assert (slow.status, slow.code) == (429, "rate_limit_exceeded")


def test_a_cancellation_is_499_and_an_api_error_passes_through():
    assert from_exception(asyncio.CancelledError()).status == 499
    mine = bad_request("no", "n")
    assert from_exception(mine) is mine


@pytest.mark.parametrize(("seconds", "header"), [(0.2, "1"), (2.5, "3"), (1.0, "1"), (0.0, "1"), (3.0, "3")])
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(seconds, header):
    err = from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", retry_after=seconds)
    assert err.headers() == {"Retry-After": header}


def test_no_retry_hint_no_retry_after_header():
    assert from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down").headers() == {}


def test_a_body_over_the_limit_is_413_request_too_large():
    err = too_large(20, 10)
    assert (err.status, err.code) == (413, "request_too_large")
    assert "20" in err.message and "10" in err.message


def test_a_field_of_the_wrong_type_is_a_400_naming_it():
    err = from_validation(shape_error(CompletionRequest, prompt="hi", temperature="hot"))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "temperature")
    assert err.message.startswith("`temperature`: ")
    assert from_exception(shape_error(CompletionRequest, prompt="hi", temperature="hot")).param == "temperature"


def test_a_prompt_of_no_allowed_type_names_prompt_and_no_union_member():
    err = from_validation(shape_error(CompletionRequest, prompt=["a", 1]))
    assert err.param == "prompt"
    for member in ("str", "list[str]", "list[int]", "list[list[int]]"):
        assert member not in err.param
    assert "none of the types" in err.message


def test_a_nested_field_is_named_with_its_list_index():
    err = from_validation(shape_error(ChatCompletionRequest, messages=[{"role": "user", "content": "a"},
                                                                       {"role": "user", "content": 5}]))
    assert err.param == "messages.1.content"


def test_two_missing_fields_in_two_messages_are_not_called_a_union_mismatch():
    err = from_validation(shape_error(ChatCompletionRequest, messages=[{"content": "a"}, {"content": "b"}]))
    assert err.param == "messages.0.role"
    assert "none of the types" not in err.message


def test_a_missing_field_and_a_body_that_is_not_json_are_400():
    assert from_validation(shape_error(CompletionRequest)).param == "prompt"
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate_json(b"{not json")
    api = from_validation(err.value)
    assert (api.status, api.param) == (400, None)


# -- render --------------------------------------------------------------------------------------------


def test_a_completions_stream_gives_text_chunks_finished_by_the_last():
    plan = completion(stream=True, request_id="s")
    render = Render(plan, "completion", "smol", "fp_abc", None)
    chunks = stream(render, [(0, m) for m in three_messages()])
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", " world", ","]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert [c["choices"][0]["stop_reason"] for c in chunks] == [None, None, None]
    for c in chunks:
        assert (c["id"], c["object"], c["model"], c["system_fingerprint"]) == ("s", "text_completion", "smol",
                                                                               "fp_abc")
        assert c["choices"][0]["index"] == 0
        assert c["choices"][0]["logprobs"] is None
        assert "usage" not in c
    assert "tandem" not in chunks[0]["choices"][0]
    extension = chunks[-1]["choices"][0]["tandem"]
    timings = extension["timings_ms"]
    assert timings["ttft"] == 12.346 and timings["e2e"] == 40.0 and timings["tokenize"] == 0.5
    assert (extension["prefill_worker"], extension["decode_worker"]) == ("prefill:1", "decode:2")
    assert render.usage() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 2}}


@pytest.mark.parametrize(("stop_reason", "last_ids", "expected"), [
    ("", (28,), None),  # an end-of-sequence token
    ("\n\n", (28,), "\n\n"),  # a stop string
    ("28", (28,), 28),  # a stop token id: the digits of the last token
    ("13", (28,), "13"),  # a stop string of digits that is not the last token
])
def test_stop_reason_is_null_for_eos_the_string_or_the_token_id(stop_reason, last_ids, expected):
    render = Render(completion(stream=True), "completion", "m", "", None)
    msgs = three_messages(cpb.FINISH_REASON_STOP, stop_reason, last_ids)
    chunks = stream(render, [(0, m) for m in msgs])
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop"
    assert last["stop_reason"] == expected
    assert type(last["stop_reason"]) is type(expected)
    assert [c["choices"][0]["stop_reason"] for c in chunks[:-1]] == [None, None]


def test_a_stop_string_of_unicode_digits_is_the_string():
    render = Render(completion(stream=True), "completion", "m", "", None)
    chunks = stream(render, [(0, m) for m in three_messages(cpb.FINISH_REASON_STOP, "²", (28,))])
    assert chunks[-1]["choices"][0]["stop_reason"] == "²"


def test_usage_counts_each_prompt_once_and_every_choice_s_completion():
    plan = completion(prompt=["a", "bb"], n=2, stream=True)
    render = Render(plan, "completion", "m", "", None)
    events = []
    # prompt 0 (choices 0, 1): 3 tokens, 2 cached for its first choice; its follower hit the cache fully
    events += [(0, message("x", [1, 2], first=True, prompt_tokens=3, cached_tokens=2)),
               (1, message("y", [3], first=True, prompt_tokens=3, cached_tokens=3))]
    # prompt 1 (choices 2, 3): 4 tokens, nothing cached
    events += [(2, message("z", [4], first=True, prompt_tokens=4, cached_tokens=0)),
               (3, message("w", [5, 6, 7], first=True, prompt_tokens=4, cached_tokens=4))]
    events += [(i, message(".", [9], finish=cpb.FINISH_REASON_LENGTH, prompt_tokens=p, cached_tokens=c))
               for i, p, c in ((0, 3, 2), (1, 3, 3), (2, 4, 0), (3, 4, 4))]
    stream(render, events)
    assert render.usage() == {"prompt_tokens": 7, "completion_tokens": 2 + 1 + 1 + 3 + 4, "total_tokens": 18,
                              "prompt_tokens_details": {"cached_tokens": 2}}
    last = render.usage_chunk()
    assert last["choices"] == [] and last["usage"] == render.usage()
    assert last["object"] == "text_completion"


def test_chat_chunks_name_the_assistant_role_on_each_choice_s_first_chunk_only():
    plan = chat(n=2, stream=True, request_id="c")
    render = Render(plan, "chat", "m", "", None)
    a, b = three_messages(), three_messages(cpb.FINISH_REASON_STOP)
    chunks = stream(render, [(0, a[0]), (1, b[0]), (1, b[1]), (0, a[1]), (0, a[2]), (1, b[2])])
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks]
    assert deltas == [(0, {"role": "assistant", "content": "Hello"}), (1, {"role": "assistant", "content": "Hello"}),
                      (1, {"content": " world"}), (0, {"content": " world"}), (0, {"content": ","}),
                      (1, {"content": ","})]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, None, "length", "stop"]
    assert render.usage_chunk()["object"] == "chat.completion.chunk"


def test_continuous_usage_puts_the_usage_so_far_on_every_chunk():
    plan = completion(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = stream(Render(plan, "completion", "m", "", None), [(0, m) for m in three_messages()])
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks)
    assert chunks[0]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert chunks[-1]["usage"]["total_tokens"] == 8


def test_a_chunk_puts_the_echo_before_the_text():
    plan = completion(stream=True, echo=True, prompt="Say:")
    render = Render(plan, "completion", "m", "", None)

    async def go() -> dict:
        msg = three_messages()[0]
        return render.chunk(await render.absorb(0, msg), msg, echo="Say:")

    assert asyncio.run(go())["choices"][0]["text"] == "Say:Hello"


def test_a_whole_chat_response_with_n_2_has_both_messages_and_the_usage():
    plan = chat(n=2, request_id="w")
    render = Render(plan, "chat", "smol", "fp_1", None)
    a, b = three_messages(), three_messages(cpb.FINISH_REASON_STOP, "28")
    out = whole(render, [(1, b[0]), (0, a[0]), (0, a[1]), (1, b[1]), (1, b[2]), (0, a[2])])
    assert (out["id"], out["object"], out["model"], out["system_fingerprint"]) == ("w", "chat.completion", "smol",
                                                                                 "fp_1")
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c in out["choices"]:
        assert c["message"] == {"role": "assistant", "content": "Hello world,"}
        assert c["logprobs"] is None
        assert c["tandem"]["decode_worker"] == "decode:2"
    assert [(c["finish_reason"], c["stop_reason"]) for c in out["choices"]] == [("length", None), ("stop", 28)]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                            "prompt_tokens_details": {"cached_tokens": 2}}


def test_a_whole_completions_response_with_n_2_puts_the_echo_first():
    plan = completion(prompt="Say:", n=2, echo=True)
    render = Render(plan, "completion", "m", "", None)
    a, b = three_messages(), three_messages()
    out = whole(render, [(0, a[0]), (1, b[0]), (0, a[1]), (1, b[1]), (0, a[2]), (1, b[2])],
                {0: "Say:", 1: "Say:"})
    assert out["object"] == "text_completion"
    assert [c["text"] for c in out["choices"]] == ["Say:Hello world,", "Say:Hello world,"]
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 6


def lp(token_id: int, logprob: float, rank: int, *top: tuple[int, float]) -> cpb.TokenLogprob:
    return cpb.TokenLogprob(token_id=token_id, logprob=logprob, rank=rank,
                            top=[cpb.TopLogprob(token_id=t, logprob=v) for t, v in top])


@pytest.fixture(scope="module")
def ids(tok) -> list[int]:
    """Real ids: "Hello", " world", ",", " café" (logprobs chosen to be exact in float32)."""
    ids = tok.encode("Hello world, café")
    assert [tok.token_text(i) for i in ids] == ["Hello", " world", ",", " café"]
    return ids


def logprob_messages(ids: list[int]) -> list[gpb.GenerateResponse]:
    hello, world, comma, cafe = ids
    return [
        message("Hello world", [hello, world], first=True,
                logprobs=[lp(hello, -0.25, 1, (hello, -0.25), (world, -2.0)),
                          lp(world, -3.0, 3, (comma, -0.5), (cafe, -1.5))]),  # the chosen token is not in top
        message(",", [comma], logprobs=[lp(comma, -0.5, 1, (comma, -0.5), (hello, -4.0))]),
        message(" café", [cafe], finish=cpb.FINISH_REASON_LENGTH, completion_tokens=4,
                logprobs=[lp(cafe, -1.0, 2, (world, -0.75), (cafe, -1.0))]),
    ]


def test_completions_logprobs_name_tokens_and_offsets_accumulate_across_messages(tok, ids):
    plan = completion(stream=True, logprobs=2)

    async def test(names: TokenNames) -> tuple[list[dict], dict]:
        render = Render(plan, "completion", "m", "", names)
        chunks = []
        for msg in logprob_messages(ids):
            state = await render.absorb(0, msg)
            render.keep(state, msg)
            chunks.append(render.chunk(state, msg))
        return chunks, render.response({})

    chunks, out = with_names(tok, test)
    got = [c["choices"][0]["logprobs"] for c in chunks]
    assert got[0] == {"tokens": ["Hello", " world"], "token_logprobs": [-0.25, -3.0],
                      "top_logprobs": [{"Hello": -0.25, " world": -2.0},
                                       {",": -0.5, " café": -1.5, " world": -3.0}],  # with the chosen token
                      "text_offset": [0, 5]}
    assert got[1] == {"tokens": [","], "token_logprobs": [-0.5], "top_logprobs": [{",": -0.5, "Hello": -4.0}],
                      "text_offset": [11]}
    assert got[2] == {"tokens": [" café"], "token_logprobs": [-1.0],
                      "top_logprobs": [{" world": -0.75, " café": -1.0}], "text_offset": [12]}
    whole_lp = out["choices"][0]["logprobs"]  # a whole response counts offsets from its own start
    assert whole_lp["tokens"] == ["Hello", " world", ",", " café"]
    assert whole_lp["text_offset"] == [0, 5, 11, 12]
    assert whole_lp["token_logprobs"] == [-0.25, -3.0, -0.5, -1.0]
    assert out["choices"][0]["text"] == "Hello world, café"


def test_a_forbidden_alternative_shows_as_vllms_floor_not_as_infinity(tok, ids):
    """Under a structured-output constraint the top alternatives can include tokens the grammar forbids
    (logprob -inf on the wire): JSON has no -Infinity, so they show as -9999.0, as in vLLM."""
    hello, world, _, _ = ids
    msg = message("Hello", [hello], first=True, finish=cpb.FINISH_REASON_STOP, completion_tokens=1,
                  logprobs=[lp(hello, 0.0, 1, (hello, 0.0), (world, float("-inf")))])

    async def test(names: TokenNames) -> tuple[dict, dict]:
        completion_render = Render(completion(logprobs=2), "completion", "m", "", names)
        chat_render = Render(chat(logprobs=True, top_logprobs=2), "chat", "m", "", names)
        for render in (completion_render, chat_render):
            render.keep(await render.absorb(0, msg), msg)
        return completion_render.response({}), chat_render.response({})

    text, chat_out = with_names(tok, test)
    assert text["choices"][0]["logprobs"]["top_logprobs"] == [{"Hello": 0.0, " world": -9999.0}]
    top = chat_out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in top] == [0.0, -9999.0]
    json.dumps(text, allow_nan=False), json.dumps(chat_out, allow_nan=False)


def test_chat_logprobs_are_content_entries_with_token_logprob_bytes_and_top(tok, ids):
    plan = chat(stream=True, logprobs=True, top_logprobs=2)
    hello, world, comma, cafe = ids

    async def test(names: TokenNames) -> tuple[list[dict], dict]:
        render = Render(plan, "chat", "m", "", names)
        chunks = []
        for msg in logprob_messages(ids):
            state = await render.absorb(0, msg)
            render.keep(state, msg)
            chunks.append(render.chunk(state, msg))
        return chunks, render.response({})

    chunks, out = with_names(tok, test)
    first = chunks[0]["choices"][0]["logprobs"]
    assert first == {"content": [
        {"token": "Hello", "logprob": -0.25, "bytes": list(b"Hello"),
         "top_logprobs": [{"token": "Hello", "logprob": -0.25, "bytes": list(b"Hello")},
                          {"token": " world", "logprob": -2.0, "bytes": list(b" world")}]},
        {"token": " world", "logprob": -3.0, "bytes": list(b" world"),
         "top_logprobs": [{"token": ",", "logprob": -0.5, "bytes": [44]},
                          {"token": " café", "logprob": -1.5, "bytes": list(" café".encode())}]},
    ]}
    assert chunks[2]["choices"][0]["logprobs"]["content"][0]["bytes"] == [32, 99, 97, 102, 0xC3, 0xA9]
    content = out["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["Hello", " world", ",", " café"]
    assert [len(e["top_logprobs"]) for e in content] == [2, 2, 2, 2]


def test_chat_logprobs_without_top_logprobs_have_empty_top_lists(tok, ids):
    plan = chat(logprobs=True)
    hello = ids[0]

    async def test(names: TokenNames) -> dict:
        render = Render(plan, "chat", "m", "", names)
        msg = message("Hello", [hello], first=True, finish=cpb.FINISH_REASON_LENGTH, logprobs=[lp(hello, -0.5, 1)])
        render.keep(await render.absorb(0, msg), msg)
        return render.response({})

    out = with_names(tok, test)
    assert out["choices"][0]["logprobs"] == {"content": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": []}]}


def test_a_piece_of_a_utf8_character_is_named_by_its_own_bytes(tok):
    rocket = tok.encode("Hi 🚀")[1:]  # " 🚀" over three tokens: each a piece of the character
    plan = chat(logprobs=True, top_logprobs=1)

    async def test(names: TokenNames) -> dict:
        render = Render(plan, "chat", "m", "", names)
        msg = message(" 🚀", rocket, first=True, finish=cpb.FINISH_REASON_LENGTH,
                      logprobs=[lp(i, -1.0, 1, (i, -1.0)) for i in rocket])
        render.keep(await render.absorb(0, msg), msg)
        return render.response({})

    content = with_names(tok, test)["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == " 🚀".encode()
    assert all("\ufffd" in e["token"] for e in content)


def test_token_names_asks_the_tokenizer_once_per_id(tok, ids):
    async def go() -> None:
        server = await start_server([build_service(tok)], "127.0.0.1", 0)
        async with channel(f"127.0.0.1:{server.port}") as ch:
            names = TokenNames(tpb_grpc.TokenizerStub(ch))
            try:
                await names.learn(ids)
            finally:
                await server.stop(0)
            await names.learn([ids[0], ids[2], ids[0]])  # known ids: no call (the tokenizer is gone)
            assert [(names.text(i), names.raw(i)) for i in ids] == [
                ("Hello", b"Hello"), (" world", b" world"), (",", b","), (" café", " café".encode())]
            with pytest.raises(GenerationError) as err:  # a new id needs the tokenizer
                await names.learn([ids[0], 7])
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert err.value.message.startswith("tokenizer: ")

    asyncio.run(go())


# -- context -------------------------------------------------------------------------------------------


def test_http_headers_are_the_call_s_metadata_with_lower_case_names():
    ctx = HttpCallContext([("Authorization", "Bearer K"), ("TraceParent", "00-ab-cd-01"), ("x-Other", "V")])
    assert ctx.invocation_metadata() == (("authorization", "Bearer K"), ("traceparent", "00-ab-cd-01"),
                                         ("x-other", "V"))


def test_abort_raises_http_abort_and_the_context_reports_its_status():
    ctx = HttpCallContext([])
    assert (ctx.code(), ctx.details(), ctx.retry_after) == (None, "", None)
    with pytest.raises(HttpAbort) as err:
        asyncio.run(ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit", ((RETRY_AFTER, "2.5"),)))
    assert isinstance(err.value, grpc.aio.AbortError)
    assert (err.value.code, err.value.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit")
    assert (ctx.code(), ctx.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit")
    assert ctx.retry_after == 2.5


def test_retry_after_is_read_from_trailing_metadata_only():
    ctx = HttpCallContext([("retry-after", "9")])  # a request header is not the refusal's hint
    assert ctx.retry_after is None
    ctx.set_trailing_metadata([("other", "x"), ("retry-after", "0.2")])
    assert ctx.retry_after == 0.2


def test_abort_without_trailing_metadata_has_no_retry_hint():
    ctx = HttpCallContext([])
    with pytest.raises(HttpAbort):
        asyncio.run(ctx.abort(grpc.StatusCode.UNAVAILABLE, "no workers"))
    assert (ctx.code(), ctx.details(), ctx.retry_after) == (grpc.StatusCode.UNAVAILABLE, "no workers", None)


def test_time_remaining_is_none_without_timeout_and_counts_down_with_one():
    assert HttpCallContext([]).time_remaining() is None
    remaining = HttpCallContext([], timeout_s=30).time_remaining()
    assert remaining is not None and 29 < remaining <= 30
    assert HttpCallContext([], timeout_s=-1).time_remaining() == 0.0
