"""Limits wherever input enters: every one a clear INVALID_ARGUMENT (the gRPC size limit, RESOURCE_EXHAUSTED,
is gRPC's own; the public port is checked on a gateway in front of a real worker in tests/e2e/test_input_limits.py);
chat templates render in a sandbox that cannot read files, import or run code, nor run away."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest

from common.service import start_server
from gateway.validation import (
    MAX_CHAT_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidRequest,
    ModelLimits,
    check_constraint,
    check_length,
    validate,
)
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc
from tests.loop_thread import LoopThread
from tokenizer_svc import tokenizer as tokenizer_module
from tokenizer_svc.server import build_service
from tokenizer_svc.tokenizer import ChatTemplateError, TextTokenizer

LIMITS = ModelLimits(model="m", vocab_size=1000, max_model_len=512, max_request_tokens=4096)


def request(**fields) -> gpb.GenerateRequest:
    fields.setdefault("prompt", "hi")
    return gpb.GenerateRequest(**fields)


def chat(*contents: str, role: str = "user") -> tpb.ChatMessages:
    return tpb.ChatMessages(messages=[tpb.ChatMessage(role=role, content=c) for c in contents])


@pytest.mark.parametrize(("req", "match"), [
    (request(request_id="abc\n"), "request_id must be 1-128 characters"),
    (request(request_id="a" * 129), "request_id must be 1-128 characters"),
    (request(request_id="a b"), "request_id must be 1-128 characters"),
    (request(request_id="ａ"), "request_id must be 1-128 characters"),  # a fullwidth letter is not [A-Za-z]
    (request(model="x" * 100_000), r"unknown model of 100000 characters: this gateway serves 'm'$"),
    (request(prompt=""), "prompt is empty"),
    (request(prompt="x" * (MAX_PROMPT_CHARS + 1)), f"prompt is longer than {MAX_PROMPT_CHARS} characters"),
    (request(prompt=None, chat=chat()), "chat has no messages"),
    (request(prompt=None, chat=chat(*["x"] * (MAX_CHAT_MESSAGES + 1))), f"more than {MAX_CHAT_MESSAGES} messages"),
    (request(prompt=None, chat=chat("x" * MAX_PROMPT_CHARS, "y")), f"chat is longer than {MAX_PROMPT_CHARS}"),
    (request(prompt=None, chat=chat("x", role="root" * 100)), r"role must be one of .*, got 'rootrootroot"),
    (request(prompt=None, token_ids=gpb.TokenIds(ids=[1] * 512)), "token_ids has 512 ids; at most 511 prompt"),
    (request(prompt=None, token_ids=gpb.TokenIds(ids=[1, 1000])), "token_ids must be < the vocabulary size 1000"),
    (request(sampling=cpb.SamplingParams(temperature=float("nan"))), "temperature must be a finite number, got nan"),
    (request(sampling=cpb.SamplingParams(repetition_penalty=float("inf"))), "repetition_penalty must be a finite"),
    (request(sampling=cpb.SamplingParams(top_p=float("nan"))), "top_p must be a finite number"),
    (request(sampling=cpb.SamplingParams(logprobs=21)), r"logprobs must be in \[0, 20\], got 21"),
    (request(sampling=cpb.SamplingParams(max_tokens=512)), "max_tokens must be < the model length 512"),
    (request(sampling=cpb.SamplingParams(max_tokens=0)), "max_tokens must be an integer >= 1"),
    (request(sampling=cpb.SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))),
     f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"),
    (request(sampling=cpb.SamplingParams(stop_token_ids=[1000])), "stop_token_ids must be < the vocabulary"),
    (request(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS} stop strings, got 17"),
    (request(stop=["x" * (MAX_STOP_CHARS + 1)]), f"stop strings must be 1-{MAX_STOP_CHARS} characters"),
    (request(stop=[""]), "stop strings must be 1-256 characters, got ''"),
    (request(cache_salt="s" * 257), "cache_salt is at most 256 characters"),
    (request(cache_salt="tenant\x00a"), "cache_salt must be printable"),
    (gpb.GenerateRequest(), "give one of prompt, chat or token_ids"),
    (request(sampling=cpb.SamplingParams(structured=cpb.StructuredOutput())), "structured: set one of json_schema"),
    (request(sampling=cpb.SamplingParams(structured=cpb.StructuredOutput(regex="x" * 70_000))),
     "structured output regex is 70000 bytes; at most 65536"),
    (request(sampling=cpb.SamplingParams(structured=cpb.StructuredOutput(json_schema="{"))), "is not valid JSON"),
    (request(sampling=cpb.SamplingParams(structured=cpb.StructuredOutput(choice=cpb.Choices()))),
     "choice needs at least one string"),
    (request(sampling=cpb.SamplingParams(structured=cpb.StructuredOutput(json_object=False))),
     "json_object must be true when set"),
])
def test_every_limit_is_a_clear_invalid_request(req, match):
    with pytest.raises(InvalidRequest, match=match) as err:
        validate(req, LIMITS)
    assert len(str(err.value)) < 300


@pytest.mark.parametrize(("structured", "match"), [
    (cpb.StructuredOutput(regex="(a"), "(?s)sampling: structured output regex does not compile: .*unclosed group"),
    (cpb.StructuredOutput(json_schema='{"type": "strin"}'),
     "structured output json_schema does not compile: Invalid type: strin"),
    (cpb.StructuredOutput(grammar="start: " + "x " * 500),  # llguidance's long message, cut
     r"(?s)structured output grammar does not compile: .*\.\.\.$"),
])
def test_a_constraint_that_does_not_compile_is_a_clear_invalid_request(structured, match):
    valid = validate(request(sampling=cpb.SamplingParams(structured=structured)), LIMITS)
    with pytest.raises(InvalidRequest, match=match) as err:
        asyncio.run(check_constraint(valid))
    assert len(str(err.value)) < 300


def test_a_constraint_that_compiles_travels_to_the_workers():
    structured = cpb.StructuredOutput(json_schema='{"type": "object"}')
    valid = validate(request(sampling=cpb.SamplingParams(structured=structured)), LIMITS)
    asyncio.run(check_constraint(valid))
    check_length(valid, 10, LIMITS)
    assert valid.sampling.structured == structured


def test_prompt_token_limits():
    valid = validate(request(), LIMITS)
    with pytest.raises(InvalidRequest, match="the prompt has 512 tokens; this model takes at most 511 prompt tokens"):
        check_length(valid, 512, LIMITS)
    own = ModelLimits(model="m", vocab_size=1000, max_model_len=512, max_request_tokens=4096, max_prompt_tokens=100)
    with pytest.raises(InvalidRequest, match="the prompt has 101 tokens; this gateway takes at most 100 prompt"):
        check_length(validate(request(), own), 101, own)
    check_length(valid, 100, own)
    assert valid.params.max_tokens == 412  # the rest of the model length
    with pytest.raises(InvalidRequest, match="token_ids has 101 ids; at most 100"):
        validate(request(prompt=None, token_ids=gpb.TokenIds(ids=[1] * 101)), own)


# ---- the chat template sandbox ------------------------------------------------------------------------------------

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",  # plain jinja2 renders an unsafe attribute as nothing; here it fails
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__['os'] }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ namespace.__init__.__globals__.__builtins__.open('/etc/passwd').read() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ messages[0].content.__class__ }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ messages.append({'role': 'system', 'content': 'x'}) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os }}",
    "{% extends '/etc/hostname' %}",
    "{% from 'os' import system %}{{ system('id') }}",
    "{{ 'x' * 1000000000 }}",
    "{{ 10 ** 1000000000 }}",
    "{{ (9 ** 999) ** 999 }}",  # jinja2's ** is left-associative
    "{{ range(10 ** 9) | list }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
]


@pytest.fixture(scope="module")
def model_copy(default_model, tmp_path_factory) -> Path:
    """The default model's tokenizer files in a folder of our own, to give it other chat templates."""
    path = tmp_path_factory.mktemp("model")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        if (default_model / name).is_file():
            shutil.copy(default_model / name, path / name)
    return path


@pytest.fixture
def budget(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "RENDER_BUDGET_S", 0.5)
    monkeypatch.setattr(tokenizer_module, "MAX_RENDERED_CHARS", 1_000_000)


@pytest.mark.parametrize("template", ESCAPES)
def test_escaping_templates_fail_as_template_errors(model_copy, template, budget):
    (model_copy / "chat_template.jinja").write_text(template)
    tok = TextTokenizer(model_copy)
    with pytest.raises(ChatTemplateError, match="chat template failed on these messages"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_a_malicious_template_is_invalid_argument_through_the_service(model_copy, budget):
    (model_copy / "chat_template.jinja").write_text(ESCAPES[4])
    loop = LoopThread()
    server = loop.run(start_server([build_service(TextTokenizer(model_copy))], "127.0.0.1", 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = tpb_grpc.TokenizerStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Tokenize(tpb.TokenizeRequest(chat=chat("hi")), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not allowed" in err.value.details()
            assert stub.Tokenize(tpb.TokenizeRequest(text="still serving"), timeout=10).token_ids
    finally:
        loop.run(server.stop(0))
        loop.close()


def test_the_sandbox_still_renders_ordinary_templates(model_copy, default_model):
    (model_copy / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] | upper }}:{{ m.content.strip() | replace('a', 'A') }}"
        "{{ ', '.join(['x', 'y']) }}{{ '%d' % loop.index }}{{ 2 ** 10 }}{{ '-' * 3 }}{% endfor %}")
    tok = TextTokenizer(model_copy)
    assert tok.render_chat([{"role": "user", "content": " a b "}]) == "USER:A bx, y11024---"
    default = TextTokenizer(default_model)
    assert default.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")

