"""The tokenizer service as a real process, refereed by transformers through a real gRPC channel."""

from __future__ import annotations

import asyncio
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.service import start_server
from protos import tokenizer_pb2 as pb
from protos import tokenizer_pb2_grpc as pb_grpc
from tokenizer_svc.server import SERVICE_NAME, TokenizerService, build_service
from tokenizer_svc.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "naïve café — 東京は日本の首都です 🙂🚀 done",
    "  leading spaces and\ttabs\nnew lines  \n\n",
    " 👨‍👩‍👧‍👦 family, 한국어, Ελληνικά, עברית, emoji at the end 🎉",
    "def f(x):\n    return x ** 2  # 二乗\n",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Où est 東京? 🙂"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! How can I help?"},
        {"role": "user", "content": "  Tell me a joke.\n"},
    ],
]


class TokenizerNode:
    """``python -m tokenizer_svc.server`` in its own process; its address comes from the READY line."""

    def __init__(self, model: Path, log: Path) -> None:
        cmd = [sys.executable, "-m", "tokenizer_svc.server", "--model", str(model), "--port", "0"]
        self.log = log
        with log.open("w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        self.address = self._read_address(timeout=30)

    def _read_address(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("TOKENIZER READY grpc="):
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"the tokenizer service did not start: {line!r}\n{self.log.read_text()}")
        return line.split("grpc=", 1)[1].split()[0]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(10)


@pytest.fixture(scope="module")
def node(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenizerNode]:
    n = TokenizerNode(default_model, tmp_path_factory.mktemp("tokenizer") / "stderr.log")
    yield n
    n.stop()


@pytest.fixture(scope="module")
def channel(node: TokenizerNode) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(node.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.TokenizerStub:
    return pb_grpc.TokenizerStub(channel)


@pytest.fixture(scope="module")
def hf(default_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


def chat_request(messages: list[dict[str, str]], continue_final_message: bool = False) -> pb.TokenizeRequest:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages],
                           continue_final_message=continue_final_message)
    return pb.TokenizeRequest(chat=chat)


def hf_chat_ids(hf, messages: list[dict[str, str]], **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def detokenize(stub: pb_grpc.TokenizerStub, ids: list[int], rng: random.Random, keep: bool = False) -> list[str]:
    """Stream ``ids`` in chunks of 1..3 (the last one with ``finish``); one delta per chunk."""
    cuts = [0]
    while cuts[-1] < len(ids):
        cuts.append(min(len(ids), cuts[-1] + rng.randint(1, 3)))
    requests = [
        pb.DetokenizeRequest(token_ids=ids[a:b], finish=b == len(ids), keep_special_tokens=keep)
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    deltas = [r.text for r in stub.Detokenize(iter(requests), timeout=10)]
    assert len(deltas) == len(requests)
    return deltas


def assert_clean_deltas(deltas: list[str], full: str) -> None:
    """Concatenation is the whole decode; a delta has U+FFFD only where the whole decode has it."""
    assert "".join(deltas) == full
    offset = 0
    for delta in deltas:
        assert all(full[offset + j] == "\ufffd" for j, ch in enumerate(delta) if ch == "\ufffd")
        offset += len(delta)


def test_tokenize_text_matches_transformers(stub, hf):
    for text in [*TEXTS, "x" * 3 + " long prompt, tokenized off the event loop." * 2000]:
        for add in (True, False):
            got = stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add), timeout=10)
            assert list(got.token_ids) == hf.encode(text, add_special_tokens=add)
            assert got.rendered == ""


@pytest.mark.parametrize("messages", CHATS)
def test_chat_matches_apply_chat_template(stub, hf, messages):
    got = stub.Tokenize(chat_request(messages), timeout=10)
    assert list(got.token_ids) == hf_chat_ids(hf, messages, add_generation_prompt=True)
    assert got.rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_continue_final_message_matches_transformers(stub, hf):
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two, "}]
    got = stub.Tokenize(chat_request(messages, continue_final_message=True), timeout=10)
    assert got.rendered.endswith("<|im_start|>assistant\nOne, two, ")
    assert list(got.token_ids) == hf_chat_ids(hf, messages, continue_final_message=True)


def test_detokenize_random_ids_concatenate_to_decode(stub, hf):
    rng = random.Random(0)
    for _ in range(150):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(1, 48))]
        assert_clean_deltas(detokenize(stub, ids, rng), hf.decode(ids, skip_special_tokens=True))
    for _ in range(30):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(1, 48))]
        assert_clean_deltas(detokenize(stub, ids, rng, keep=True), hf.decode(ids, skip_special_tokens=False))


def test_detokenize_texts_never_emit_broken_characters(stub, hf):
    rng = random.Random(1)
    chat_ids = hf_chat_ids(hf, CHATS[1], add_generation_prompt=True)  # with special tokens inside
    for ids in [*(hf.encode(t) for t in TEXTS), chat_ids] * 4:
        deltas = detokenize(stub, ids, rng)
        assert "".join(deltas) == hf.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in d for d in deltas)
    kept = detokenize(stub, chat_ids, rng, keep=True)
    assert "".join(kept) == hf.decode(chat_ids, skip_special_tokens=False)


def test_detokenize_ends_the_stream_at_finish(stub, hf):
    ids = hf.encode("one two three")
    requests = [pb.DetokenizeRequest(token_ids=ids[:1]), pb.DetokenizeRequest(token_ids=ids[1:], finish=True),
                pb.DetokenizeRequest(token_ids=ids)]
    assert "".join(r.text for r in stub.Detokenize(iter(requests), timeout=10)) == "one two three"


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (pb.TokenizeRequest(), "no input"),
        (pb.TokenizeRequest(text=""), "empty"),
        (chat_request([]), "no messages"),
        (chat_request([{"role": "usr", "content": "hi"}]), "role 'usr'"),
        (chat_request([{"role": "user", "content": "hi"}, {"role": "", "content": "x"}]), "message 1"),
    ],
)
def test_bad_tokenize_requests_are_invalid_argument(stub, request_, words):
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(request_, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()


def test_ids_outside_the_vocabulary_are_invalid_argument(stub, hf):
    requests = [pb.DetokenizeRequest(token_ids=[42]), pb.DetokenizeRequest(token_ids=[7, len(hf)], finish=True)]
    responses = stub.Detokenize(iter(requests), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        list(responses)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"token id {len(hf)} is outside the vocabulary" in err.value.details()


def test_info_reports_the_models_facts(stub, hf):
    info = stub.Info(pb.TokenizerInfoRequest(), timeout=10)
    assert info.vocab_size == len(hf)
    assert info.has_chat_template
    assert list(info.eos_token_ids) == [hf.eos_token_id]


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_cancelled_detokenize_stream_is_released(stub, hf):
    before = stub.Stats(pb.TokenizerStatsRequest(), timeout=10)
    hang = threading.Event()

    def requests():
        yield pb.DetokenizeRequest(token_ids=hf.encode("still going"))
        hang.wait(10)

    call = stub.Detokenize(requests(), timeout=10)
    assert next(call).text == "still going"
    open_ = stub.Stats(pb.TokenizerStatsRequest(), timeout=10)
    assert open_.active_detokenize_streams == 1
    assert open_.detokenize_streams == before.detokenize_streams + 1
    call.cancel()
    hang.set()
    deadline = time.monotonic() + 5
    while stub.Stats(pb.TokenizerStatsRequest(), timeout=10).active_detokenize_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = stub.Stats(pb.TokenizerStatsRequest(), timeout=10)
    assert stats.active_detokenize_streams == 0
    assert stats.tokenize_calls >= before.tokenize_calls


def test_a_handler_cancelled_mid_stream_releases_its_stream(default_model):
    """gRPC cancels the handler task at whatever it awaits when the client goes away: the count still drops."""
    service = TokenizerService(TextTokenizer(default_model))

    async def go() -> None:
        gate = asyncio.Event()

        async def requests():
            yield pb.DetokenizeRequest(token_ids=[42])
            await gate.wait()

        stream = service.Detokenize(requests(), context=None)
        await anext(stream)
        assert service.counters.active_detokenize_streams == 1
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending

    asyncio.run(go())
    assert service.counters.active_detokenize_streams == 0


def test_model_without_chat_template_refuses_chat(default_model, tmp_path):
    shutil.copy(default_model / "tokenizer.json", tmp_path / "tokenizer.json")  # no template, no configs

    async def go() -> None:
        running = await start_server([build_service(TextTokenizer(tmp_path))], "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
                stub = pb_grpc.TokenizerStub(ch)
                info = await stub.Info(pb.TokenizerInfoRequest(), timeout=10)
                assert not info.has_chat_template and list(info.eos_token_ids) == []
                assert len((await stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10)).token_ids) == 1
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Tokenize(chat_request(CHATS[0]), timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "no chat template" in err.value.details()
        finally:
            await running.stop(0)

    asyncio.run(go())


def test_sigterm_stops_the_process_cleanly(default_model, tmp_path):
    n = TokenizerNode(default_model, tmp_path / "stderr.log")
    with grpc.insecure_channel(n.address) as ch:
        assert pb_grpc.TokenizerStub(ch).Info(pb.TokenizerInfoRequest(), timeout=10).vocab_size > 0
    start = time.monotonic()
    assert n.stop(signal.SIGTERM) == 0
    assert time.monotonic() - start < 5


def test_tandem_serve_tokenizer_subcommand():
    from tandem.cli import build_parser

    args = build_parser().parse_args(["serve", "tokenizer", "--model", "/m", "--port", "0"])
    assert (args.model, args.host, args.port, args.module) == ("/m", "127.0.0.1", 0, "tokenizer_svc.server")
