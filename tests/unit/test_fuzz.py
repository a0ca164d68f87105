"""Fuzz tests (hypothesis) of every public message and of the tokenizer and detokenizer: no crash, no hang,
every rejection INVALID_ARGUMENT with a message.

- ``validate`` + ``check_length`` on arbitrary GenerateRequests raise nothing but InvalidRequest;
- the same requests, and random or corrupted bytes, through a real gateway (real tokenizer service, a real
  aggregated worker running the engine on the default model): OK or INVALID_ARGUMENT only, never INTERNAL or
  UNKNOWN, never past the deadline; and INVALID_ARGUMENT only from the gateway (or the tokenizer), never
  passed on from the worker: a request the gateway lets through and the engine refuses fails the test;
- the tokenizer service over gRPC: arbitrary text and chats, arbitrary Detokenize id streams: OK or
  INVALID_ARGUMENT, and the deltas of valid ids concatenate to the whole decode;
- the atheris harness (tests/fuzz/fuzz_inputs.py, coverage-guided) for a bounded number of runs.

Examples are bounded (``max_examples``) so that the file runs in well under a minute.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.validation import CHAT_ROLES, MAX_STOP_STRINGS, InvalidRequest, ModelLimits, check_length, validate
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc
from tests.e2e.pipeline import gateway_stats, wait_until, worker_stats
from tests.unit.inprocess import MODEL, MODEL_LEN, Stack
from tokenizer_svc.tokenizer import IncrementalDetokenizer

ROOT = Path(__file__).resolve().parents[2]
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


@st.composite
def sampling(draw) -> cpb.SamplingParams:
    p = cpb.SamplingParams()
    for name, usual, anything in SAMPLING_FIELDS:
        value = draw(mostly(st.none() | usual, anything))
        if value is not None:
            setattr(p, name, value)
    p.stop_token_ids.extend(draw(st.lists(token_id, max_size=draw(mostly(st.just(3), st.just(300))))))
    p.ignore_eos = draw(st.booleans())
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


# ---- a real gateway over gRPC ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(default_model, aggregated_worker) -> Iterator[Stack]:
    s = Stack(default_model, aggregated_worker)
    yield s
    s.close()


@pytest.fixture(scope="module")
def gateway(stack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack.gateway) as ch:
        yield ch


ALLOWED = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)
# A stream the engine took is cut (cancelled) after this many messages: the engine checks a request when it
# admits it, before its first token, and an unset max_tokens means the rest of the model length.
CUT_AFTER = 2


def outcome(responses, cut_after: int | None = None) -> tuple[grpc.StatusCode, str, list]:
    """The call's status (OK for a stream cut after ``cut_after`` messages), its details and its messages."""
    messages = []
    try:
        for m in responses:
            messages.append(gpb.GenerateResponse.FromString(m) if isinstance(m, bytes) else m)
            if cut_after is not None and len(messages) >= cut_after and not messages[-1].finish_reason:
                responses.cancel()
                return grpc.StatusCode.OK, "cut", messages
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", messages
    return grpc.StatusCode.OK, "", messages


def check_answer(code: grpc.StatusCode, details: str, messages: list) -> None:
    assert code in ALLOWED, f"{code.name}: {details}"
    if code == grpc.StatusCode.OK:
        assert messages and (details == "cut" or messages[-1].finish_reason != cpb.FINISH_REASON_UNSPECIFIED)
    else:
        assert details and not messages
        assert not details.startswith(("decode worker", "prefill worker")), \
            f"the gateway let through a request the engine refuses: {details}"


def ids_request(ids: list[int], max_tokens: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids), sampling=cpb.SamplingParams(max_tokens=max_tokens))


@GRPC
@given(generate_requests())
@example(ids_request([1, VOCAB - 1], 1))  # at the engine's limits, and just past them: the gateway refuses
@example(ids_request([1, VOCAB], 1))  # these itself, the engine would
@example(ids_request([1] * (MODEL_LEN - 9), 9))
@example(ids_request([1] * (MODEL_LEN - 9), 10))
@example(ids_request([1] * MODEL_LEN, 1))
def test_gateway_answers_any_request_with_ok_or_invalid_argument(gateway, req):
    check_answer(*outcome(gpb_grpc.GatewayStub(gateway).Generate(req, timeout=CALL_TIMEOUT_S), CUT_AFTER))


@GRPC
@given(st.one_of(st.binary(max_size=256), corrupted()))
def test_gateway_answers_any_bytes_with_ok_or_invalid_argument(gateway, data):
    raw = gateway.unary_stream("/tandem.v1.Gateway/Generate")  # no serializers: the bytes as they are
    check_answer(*outcome(raw(data, timeout=CALL_TIMEOUT_S), CUT_AFTER))
    for method in ("ListModels", "Stats"):
        try:
            gateway.unary_unary(f"/tandem.v1.Gateway/{method}")(data, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {exc.code().name}: {exc.details()}"


def test_gateway_still_serves_after_the_fuzzing(gateway, stack):
    code, _, messages = outcome(gpb_grpc.GatewayStub(gateway).Generate(gpb.GenerateRequest(
        prompt="Hello", sampling=cpb.SamplingParams(max_tokens=2, ignore_eos=True)), timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.OK and messages[-1].usage.completion_tokens == 2
    # Nothing left behind: no call in the gateway, no request in the engine (the cut streams were aborted).
    assert wait_until(lambda: gateway_stats(stack.gateway).inflight == 0, 10)
    assert wait_until(lambda: worker_stats(stack.worker).num_requests == 0 == worker_stats(stack.worker).active_rpcs,
                      10), worker_stats(stack.worker)
    stats = gateway_stats(stack.gateway)
    assert not {"INTERNAL", "UNKNOWN"} & set(stats.finished_by_code), dict(stats.finished_by_code)


# ---- the tokenizer service over gRPC ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_stub(stack) -> Iterator[tpb_grpc.TokenizerStub]:
    with grpc.insecure_channel(stack.tokenizer_address) as ch:
        yield tpb_grpc.TokenizerStub(ch)


@GRPC
@given(st.one_of(text.map(lambda t: tpb.TokenizeRequest(text=t)),
                 chat_messages(max_size=4).map(lambda c: tpb.TokenizeRequest(chat=c)),
                 st.just(tpb.TokenizeRequest())),
       st.booleans())
def test_tokenize_answers_ok_or_invalid_argument(tokenizer_stub, stack, req, add_special):
    req.add_special_tokens = add_special
    try:
        res = tokenizer_stub.Tokenize(req, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.details(), f"{exc.code().name}: {exc.details()}"
        return
    assert all(i < stack.tokenizer.vocab_size for i in res.token_ids)
    if req.WhichOneof("input") == "text":
        assert list(res.token_ids) == stack.tokenizer.encode(req.text, add_special)


id_chunks = st.lists(st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 300),
                                        st.sampled_from([0, 1, 2, VOCAB - 1])), max_size=6), min_size=1, max_size=8)


@GRPC
@given(id_chunks, st.booleans(), st.one_of(st.none(), st.integers(VOCAB, 2**32 - 1)), st.integers(0, 10))
def test_detokenize_stream_concatenates_to_the_whole_decode(tokenizer_stub, stack, chunks, keep, bad, bad_at):
    if bad is not None:  # one id outside the vocabulary, somewhere
        chunks[bad_at % len(chunks)].append(bad)
    requests = [tpb.DetokenizeRequest(token_ids=c, keep_special_tokens=keep, finish=i == len(chunks) - 1)
                for i, c in enumerate(chunks)]
    code, details, responses = outcome(tokenizer_stub.Detokenize(iter(requests), timeout=CALL_TIMEOUT_S))
    if bad is not None:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in details
        return
    assert code == grpc.StatusCode.OK, f"{code.name}: {details}"
    ids = [i for c in chunks for i in c]
    assert "".join(r.text for r in responses) == stack.tokenizer.decode(ids, skip_special_tokens=not keep)


@PURE
@given(id_chunks, st.booleans())
def test_incremental_detokenizer_concatenates_to_the_whole_decode(stack, chunks, skip):
    tok = stack.tokenizer
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.push(c) for c in chunks] + [detok.flush()]
    ids = [i for c in chunks for i in c]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


# ---- atheris: coverage-guided, bounded --------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "runs"), [("request", 50000), ("detokenizer", 30000)])
def test_atheris_harness(default_model, tmp_path, target, runs):
    cmd = [sys.executable, str(ROOT / "tests" / "fuzz" / "fuzz_inputs.py"), target, f"-runs={runs}", "-seed=1",
           "-timeout=10", "-rss_limit_mb=4096", "-max_len=2048", f"-artifact_prefix={tmp_path}/"]
    env = {**os.environ, "TANDEM_FUZZ_MODEL": str(default_model), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"Done {runs} runs" in proc.stderr
