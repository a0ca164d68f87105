"""Fuzz tests (hypothesis) of every public message: no crash, no hang, every rejection InvalidRequest with a
message. ``validate`` + ``check_length`` on arbitrary GenerateRequests, any value of each sampling field, and
random bytes, in process. The strategies here also drive tests/e2e/test_fuzz.py: the same requests and bytes
through a real gateway and tokenizer service, and the atheris harness.

Examples are bounded (``max_examples``) so that the file runs in well under a minute.
"""

from __future__ import annotations

import asyncio
import math

from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.validation import (
    CHAT_ROLES,
    MAX_STOP_STRINGS,
    InvalidRequest,
    ModelLimits,
    check_constraint,
    check_length,
    validate,
)
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import tokenizer_pb2 as tpb
from tests.e2e.inprocess import MODEL, MODEL_LEN

VOCAB = 49152  # SmolLM2's
LIMITS = ModelLimits(model=MODEL, vocab_size=VOCAB, max_model_len=MODEL_LEN, max_request_tokens=MODEL_LEN)
CALL_TIMEOUT_S = 10.0
GRPC = settings(max_examples=120, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PURE = settings(max_examples=300, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- strategies ------------------------------------------------------------------------------------------------

WEIRD = ["", " ", "\x00", "\n", "a\n", "\r\n\t", "\u202e\u200f", "\ufeff", "e\u0301", "\U0010ffff", "🙂" * 40,
         "x" * 300, "東京", "<|im_start|>", "<|endoftext|>", "{{ 7*7 }}", "{% for x in y %}", "\\u0000", "%s%n"]
text = st.one_of(st.text(st.characters(codec="utf-8"), max_size=40), st.sampled_from(WEIRD))
some_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
u32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
i32 = st.one_of(st.integers(-2, 2), st.integers(-(2**31), 2**31 - 1))
u64 = st.integers(0, 2**64 - 1)
# Anything a float field holds: NaN, +-inf, huge, subnormal, -0.0 (the last ones drawn often on purpose).
f32 = st.one_of(st.floats(-3, 3, width=32), st.floats(width=32),
                st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 3.4e38, -3.4e38, 1e-45]))
token_id = st.one_of(st.integers(0, VOCAB - 1), u32)


def mostly(usual: st.SearchStrategy, unusual: st.SearchStrategy) -> st.SearchStrategy:
    """Usual values seven times in eight: many requests get past the first checks to the later ones. (Not
    the ends of the range for the unusual: hypothesis draws them often; shrinking goes to 0, the usual.)"""
    return st.integers(0, 7).flatmap(lambda i: unusual if i == 3 else usual)


# (field, the range the engine takes, anything of the field's type)
SAMPLING_FIELDS = (
    ("max_tokens", st.integers(1, 40), u32),
    ("temperature", st.floats(0, 2, width=32), f32),
    ("top_k", st.integers(-1, 60), i32),
    ("top_p", st.floats(0.125, 1, width=32), f32),
    ("min_p", st.floats(0, 1, width=32), f32),
    ("repetition_penalty", st.floats(0.5, 2, width=32), f32),
    ("presence_penalty", st.floats(-2, 2, width=32), f32),
    ("frequency_penalty", st.floats(-2, 2, width=32), f32),
    ("seed", u64, u64),
    ("logprobs", st.integers(0, 20), u32),
)


# Constraints that compile and ones that do not (an unknown type, a dangling $ref, an empty range, broken syntax).
SCHEMA_TEXTS = ['{"type": "object"}', '{"type": "strin"}', "{", "[]", "true", '{"$ref": "#/$defs/x"}',
                '{"type": "integer", "minimum": 5, "maximum": 1}', '{"type": "array", "items": {"enum": []}}']
REGEXES = ["[a-z]+", "(", "a{2,", r"\d{3}", ".*", "[^\x00]", "(?P<x>a)", "a{99999}"]
GRAMMARS = ['start: "a"', 'root ::= "a" (', "start: x", "%%%", "root ::= [a-z]+", 'start: /a(/']


@st.composite
def structured(draw) -> cpb.StructuredOutput:
    kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "choice", "grammar", None]))
    if kind == "json_schema":
        return cpb.StructuredOutput(json_schema=draw(st.sampled_from(SCHEMA_TEXTS) | text))
    if kind == "json_object":
        return cpb.StructuredOutput(json_object=draw(st.booleans()))
    if kind == "regex":
        return cpb.StructuredOutput(regex=draw(st.sampled_from(REGEXES) | text))
    if kind == "choice":
        return cpb.StructuredOutput(choice=cpb.Choices(choices=draw(st.lists(text, max_size=4))))
    if kind == "grammar":
        return cpb.StructuredOutput(grammar=draw(st.sampled_from(GRAMMARS) | text))
    return cpb.StructuredOutput()


@st.composite
def sampling(draw) -> cpb.SamplingParams:
    p = cpb.SamplingParams()
    for name, usual, anything in SAMPLING_FIELDS:
        value = draw(mostly(st.none() | usual, anything))
        if value is not None:
            setattr(p, name, value)
    p.stop_token_ids.extend(draw(st.lists(token_id, max_size=draw(mostly(st.just(3), st.just(300))))))
    p.ignore_eos = draw(st.booleans())
    if draw(mostly(st.just(False), st.just(True))):
        p.structured.CopyFrom(draw(structured()))
    return p


@st.composite
def chat_messages(draw, max_size: int = 5) -> tpb.ChatMessages:
    chat = tpb.ChatMessages(continue_final_message=draw(st.booleans()))
    roles = mostly(st.sampled_from(CHAT_ROLES), text)
    for _ in range(draw(mostly(st.integers(1, max_size), st.just(0)))):
        chat.messages.add(role=draw(roles), content=draw(mostly(some_text, text)))
    return chat


@st.composite
def generate_requests(draw) -> gpb.GenerateRequest:
    req = gpb.GenerateRequest(
        request_id=draw(mostly(st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._:-]{1,130}", fullmatch=True)),
                               text)),
        model=draw(mostly(st.sampled_from(["", MODEL]), text)),
        sampling=draw(sampling()),
        stop=draw(st.lists(mostly(some_text, text), max_size=draw(mostly(st.just(2), st.just(MAX_STOP_STRINGS + 2))))),
        include_stop_str_in_output=draw(st.booleans()),
        cache_salt=draw(mostly(st.just(""), text)),
        priority=draw(i32),
        keep_special_tokens=draw(st.booleans()),
        add_special_tokens=draw(st.booleans()),
    )
    kind = draw(mostly(st.sampled_from(["prompt", "chat", "token_ids"]), st.none()))
    if kind == "prompt":
        req.prompt = draw(mostly(some_text, text))
    elif kind == "chat":
        req.chat.CopyFrom(draw(chat_messages()))
    elif kind == "token_ids":
        req.token_ids.SetInParent()
        size = draw(mostly(st.just(40), st.just(MODEL_LEN + 1)))
        req.token_ids.ids.extend(draw(st.lists(mostly(st.integers(0, VOCAB - 1), u32), min_size=draw(mostly(
            st.just(1), st.just(0))), max_size=size)))
    return req


@st.composite
def corrupted(draw) -> bytes:
    """A valid request's bytes with some bytes replaced, cut or extended: deep into the parser."""
    data = bytearray(draw(generate_requests()).SerializeToString())
    for at, value in draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4)):
        if data:
            data[at % len(data)] = value
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut]) + draw(st.binary(max_size=8))


# ---- the gateway's validation, in-process ---------------------------------------------------------------------


@PURE
@given(generate_requests(), st.integers(0, MODEL_LEN + 10))
def test_validation_raises_only_invalid_request(req, prompt_len):
    try:
        valid = validate(req, LIMITS)
        asyncio.run(check_constraint(valid))
        check_length(valid, prompt_len, LIMITS)
    except InvalidRequest as exc:
        assert 0 < len(str(exc)) < 600, "a rejection says why, briefly"
        return
    p = valid.params  # what passed is what the engine accepts and the model fits
    assert all(math.isfinite(getattr(p, f)) for f in ("temperature", "top_p", "min_p", "repetition_penalty"))
    assert 1 <= prompt_len and prompt_len + p.max_tokens <= MODEL_LEN
    assert len(valid.stop) <= MAX_STOP_STRINGS and "\n" not in valid.request_id


@PURE
@given(st.data())
def test_any_one_sampling_field_passes_only_as_the_engine_takes_it(data):
    """Every field alone, with any value of its type: refused, or what the engine accepts (finite floats)."""
    name, usual, anything = data.draw(st.sampled_from(SAMPLING_FIELDS))
    req = gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(**{name: data.draw(anything | usual)}))
    try:
        valid = validate(req, LIMITS)
    except InvalidRequest as exc:
        assert name in str(exc)
        return
    value = getattr(valid.params, name)
    assert not isinstance(value, float) or math.isfinite(value)


@PURE
@given(st.binary(max_size=512))
def test_random_bytes_parse_or_raise_decode_error(data):
    try:
        req = gpb.GenerateRequest.FromString(data)
    except DecodeError:
        return
    try:
        validate(req, LIMITS)
    except InvalidRequest:
        pass
