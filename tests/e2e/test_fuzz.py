"""Fuzz tests (hypothesis) through real services, with the strategies of tests/unit/test_fuzz.py (which fuzzes
the gateway's validation in process): no crash, no hang, every rejection INVALID_ARGUMENT with a message.

- arbitrary GenerateRequests, and random or corrupted bytes, through a real gateway (real tokenizer service, a
  real aggregated worker running the engine on the default model): OK or INVALID_ARGUMENT only, never INTERNAL
  or UNKNOWN, never past the deadline; and INVALID_ARGUMENT only from the gateway (or the tokenizer), never
  passed on from the worker: a request the gateway lets through and the engine refuses fails the test;
- the tokenizer service over gRPC: arbitrary text and chats, arbitrary Detokenize id streams: OK or
  INVALID_ARGUMENT, and the deltas of valid ids concatenate to the whole decode;
- the atheris harness (tests/fuzz/fuzz_inputs.py, coverage-guided) for a bounded number of runs.

Examples are bounded (``max_examples``) so that the file runs in well under a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc
from tests.e2e.inprocess import MODEL_LEN, Stack
from tests.e2e.pipeline import gateway_stats, wait_until, worker_stats
from tests.unit.test_fuzz import (
    CALL_TIMEOUT_S,
    GRPC,
    PURE,
    VOCAB,
    chat_messages,
    corrupted,
    generate_requests,
    text,
)
from tokenizer_svc.tokenizer import IncrementalDetokenizer

ROOT = Path(__file__).resolve().parents[2]

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
