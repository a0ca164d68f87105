"""The pipeline as real processes over real gRPC: `tandem up`'s cluster with the default model.

One disaggregated cluster (kvstore, tokenizer, 2 prefill, 2 decode, gateway) serves the
module; the tests that kill workers run last. An aggregated cluster (one worker that does
both phases) checks that both modes give the same greedy text, and admission control.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine import Engine, SamplingParams
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from tests.e2e.pipeline import (
    call,
    chat_request,
    gateway_stats,
    generate,
    start_cluster,
    token_request,
    wait_clean,
    wait_until,
    worker_stats,
)
from tests.hf_reference import hf_greedy, load_hf

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences, using simple words and one example.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def cluster(default_model, tmp_path_factory):
    c = start_cluster(default_model, tmp_path_factory.mktemp("disagg-logs"), num_prefill=2, num_decode=2)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def aggregated(default_model, tmp_path_factory):
    c = start_cluster(default_model, tmp_path_factory.mktemp("agg-logs"), mode="aggregated",
                      gateway_args=["--max-inflight", "4"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine.from_model(str(default_model), kv_cache_gb=0.25)


def engine_greedy(engine: Engine, prompts: list[list[int]], max_tokens: int, **kwargs) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs))


def test_greedy_equals_engine_and_transformers(cluster, tok, engine, default_model):
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = engine_greedy(engine, prompts, 24)
    hf = load_hf(default_model)
    assert expected == [hf_greedy(hf, p, 24) for p in prompts]
    for q, prompt, want in zip(QUESTIONS, prompts, expected, strict=True):
        by_chat = generate(cluster.gateway.address, chat_request(q, 24))
        by_ids = generate(cluster.gateway.address, token_request(prompt, 24))
        assert by_chat.code == by_ids.code == grpc.StatusCode.OK, by_chat.details or by_ids.details
        assert by_chat.tokens == by_ids.tokens == want
        assert by_chat.text == tok.decode(want)
        assert by_chat.last.usage.prompt_tokens == len(prompt)
        assert by_chat.last.usage.completion_tokens == len(want)
    assert "Paris" in tok.decode(expected[0])
    # Raw text goes through the tokenizer without the chat template.
    raw = generate(cluster.gateway.address, gpb.GenerateRequest(
        prompt="The quick brown fox", sampling=cpb.SamplingParams(max_tokens=12, temperature=0)))
    assert raw.tokens == engine_greedy(engine, [tok.encode("The quick brown fox")], 12)[0]


def test_the_last_message_carries_usage_timings_and_workers(cluster, tok):
    prompt = tok.encode_chat([{"role": "user", "content": QUESTIONS[2]}])
    req = token_request(prompt, 16, sampling=cpb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                                logprobs=3))
    reply = generate(cluster.gateway.address, req)
    assert reply.code == grpc.StatusCode.OK, reply.details
    last = reply.last
    assert last.finish_reason == cpb.FINISH_REASON_LENGTH
    assert all(m.finish_reason == cpb.FINISH_REASON_UNSPECIFIED for m in reply.messages[:-1])
    assert len(reply.tokens) == 16 and [len(m.logprobs) for m in reply.messages] == [1] * len(reply.messages)
    for m in reply.messages:
        assert [(lp.token_id, len(lp.top)) for lp in m.logprobs] == [(t, 3) for t in m.token_ids]
    t = last.timings
    assert t.ttft_ms > 0 and t.e2e_ms >= t.ttft_ms and t.prefill_compute_ms > 0 and t.kv_push_ms > 0
    parts = t.tokenize_ms + t.route_ms + t.prefill_queue_ms + t.prefill_compute_ms + t.first_token_ms
    assert parts == pytest.approx(t.ttft_ms, rel=0.01)
    assert t.kv_transfer_ms == pytest.approx(t.kv_push_ms + t.kv_pull_ms)
    assert last.prefill_worker in {w.address for w in cluster.prefill}
    assert last.decode_worker in {w.address for w in cluster.decode}
    assert last.request_id


def test_seeded_sampling_continues_across_the_handoff(cluster, tok, engine):
    prompt = tok.encode_chat([{"role": "user", "content": "Tell me a story about a fox."}])
    sampling = cpb.SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    first = generate(cluster.gateway.address, token_request(prompt, 20, sampling=sampling))
    second = generate(cluster.gateway.address, token_request(prompt, 20, sampling=sampling))
    local = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234,
                                                     ignore_eos=True))[0]
    assert first.tokens == second.tokens == local


def test_stop_strings_end_the_stream_and_are_held_back(cluster, tok, engine):
    prompt = tok.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    full = tok.decode(engine_greedy(engine, [prompt], 24)[0])
    assert "Paris" in full
    reply = generate(cluster.gateway.address, token_request(prompt, 24, stop=["Paris"]))
    assert reply.code == grpc.StatusCode.OK, reply.details
    assert reply.text == full[: full.index("Paris")]
    assert reply.last.finish_reason == cpb.FINISH_REASON_STOP and reply.last.stop_reason == "Paris"
    kept = generate(cluster.gateway.address, token_request(prompt, 24, stop=["Paris"],
                                                           include_stop_str_in_output=True))
    assert kept.text == full[: full.index("Paris") + len("Paris")]
    assert wait_clean(cluster) == []


def test_32_concurrent_streams(cluster, tok, engine):
    prompts = [tok.encode_chat([{"role": "user", "content": f"Count from {i} to {i + 5}."}]) for i in range(32)]
    expected = engine_greedy(engine, prompts, 8, ignore_eos=True)

    async def run_all():
        return await asyncio.gather(*(call(cluster.gateway.address, token_request(
            p, 8, sampling=cpb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))) for p in prompts))

    replies = asyncio.run(run_all())
    assert [r.code for r in replies] == [grpc.StatusCode.OK] * 32, [r.details for r in replies if r.details]
    assert [r.tokens for r in replies] == expected
    used = {r.last.decode_worker for r in replies}
    assert used == {w.address for w in cluster.decode}, "both decode workers serve"
    assert wait_clean(cluster) == []


@pytest.mark.parametrize("when", ["mid-stream", "during-prefill"])
def test_a_cancelled_client_leaves_nothing_behind(cluster, tok, when):
    prompt = tok.encode("Once upon a time " * (60 if when == "during-prefill" else 3))
    sampling = cpb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def cancel_mid_stream():
        return await call(cluster.gateway.address, token_request(prompt, 400, sampling=sampling),
                          on_message=lambda m, r: len(r.messages) >= 3)

    async def cancel_during_prefill():
        task = asyncio.create_task(call(cluster.gateway.address, token_request(prompt, 400, sampling=sampling)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    if when == "mid-stream":
        reply = asyncio.run(cancel_mid_stream())
        assert reply.code == grpc.StatusCode.CANCELLED and len(reply.messages) == 3
    else:
        asyncio.run(cancel_during_prefill())
    assert wait_clean(cluster) == []
    assert gateway_stats(cluster.gateway.address).finished_by_code["CANCELLED"] >= 1


def test_a_deadline_ends_the_call_along_the_whole_chain(cluster, tok):
    prompt = tok.encode_chat([{"role": "user", "content": "Write a very long essay about rivers."}])
    sampling = cpb.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    reply = asyncio.run(call(cluster.gateway.address, token_request(prompt, 500, sampling=sampling), timeout=2.0))
    assert reply.code == grpc.StatusCode.DEADLINE_EXCEEDED and reply.elapsed_s < 5
    assert 0 < len(reply.tokens) < 500
    assert wait_clean(cluster) == [], "the workers stopped working on it too"


BAD_REQUESTS = {
    "no input": gpb.GenerateRequest(),
    "empty prompt": gpb.GenerateRequest(prompt=""),
    "empty token ids": gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[])),
    "token id beyond the vocabulary": gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 10**6])),
    "unknown model": gpb.GenerateRequest(prompt="hi", model="gpt-17"),
    "bad request id": gpb.GenerateRequest(prompt="hi", request_id="has spaces!"),
    "negative temperature": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(temperature=-1)),
    "top_p zero": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(top_p=0)),
    "top_p above one": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(top_p=1.5)),
    "top_k below -1": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(top_k=-2)),
    "top_k zero": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(top_k=0)),
    "min_p above one": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(min_p=2)),
    "max_tokens zero": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(max_tokens=0)),
    "max_tokens past the model": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(max_tokens=10**6)),
    "repetition_penalty zero": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(repetition_penalty=0)),
    "presence_penalty out of range": gpb.GenerateRequest(prompt="hi",
                                                         sampling=cpb.SamplingParams(presence_penalty=3)),
    "frequency_penalty out of range": gpb.GenerateRequest(prompt="hi",
                                                          sampling=cpb.SamplingParams(frequency_penalty=-3)),
    "too many logprobs": gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(logprobs=21)),
    "stop token beyond the vocabulary": gpb.GenerateRequest(prompt="hi",
                                                            sampling=cpb.SamplingParams(stop_token_ids=[10**6])),
    "too many stop strings": gpb.GenerateRequest(prompt="hi", stop=[f"s{i}" for i in range(17)]),
    "empty stop string": gpb.GenerateRequest(prompt="hi", stop=[""]),
    "oversize prompt": gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[100] * 9000)),
    "prompt + max_tokens past the model": gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=[100] * 8000), sampling=cpb.SamplingParams(max_tokens=500)),
    "chat without messages": gpb.GenerateRequest(chat={}),
    "chat with an unknown role": gpb.GenerateRequest(chat={"messages": [{"role": "wizard", "content": "hi"}]}),
}


def test_bad_requests_get_invalid_argument_and_never_reach_a_worker(cluster):
    before = [worker_stats(w.address).requests_total for w in cluster.prefill + cluster.decode]
    for name, req in BAD_REQUESTS.items():
        reply = generate(cluster.gateway.address, req, timeout=30)
        assert reply.code == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {reply.code} {reply.details}"
        assert reply.details and not reply.messages, name
    after = [worker_stats(w.address).requests_total for w in cluster.prefill + cluster.decode]
    assert after == before
    ok = generate(cluster.gateway.address, chat_request("Say hi.", 4))
    assert ok.code == grpc.StatusCode.OK, "a bad request harms no other"


def test_list_models_health_and_reflection_on_every_service(cluster):
    with grpc.insecure_channel(cluster.gateway.address) as ch:
        models = gpb_grpc.GatewayStub(ch).ListModels(gpb.ListModelsRequest(), timeout=10).models
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].max_model_len == 8192 and models[0].mode == "disaggregated"
    named = generate(cluster.gateway.address, gpb.GenerateRequest(
        prompt="hi", model=models[0].id, sampling=cpb.SamplingParams(max_tokens=2)))
    assert named.code == grpc.StatusCode.OK
    for svc in cluster.services:
        with grpc.insecure_channel(svc.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, svc.name
            listed = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
            names = {s.name for s in listed.list_services_response.service}
            assert "grpc.health.v1.Health" in names and any(n.startswith("tandem.v1.") for n in names), svc.name


def test_aggregated_mode_gives_the_same_greedy_text(aggregated, cluster, tok):
    for q in QUESTIONS:
        agg = generate(aggregated.gateway.address, chat_request(q, 24))
        dis = generate(cluster.gateway.address, chat_request(q, 24))
        assert agg.code == dis.code == grpc.StatusCode.OK, agg.details or dis.details
        assert agg.text == dis.text and agg.tokens == dis.tokens
        assert agg.last.decode_worker == aggregated.decode[0].address and agg.last.prefill_worker == ""
    t = agg.last.timings
    assert t.kv_transfer_ms == 0 and t.prefill_compute_ms > 0
    assert t.tokenize_ms + t.route_ms + t.prefill_queue_ms + t.prefill_compute_ms + t.first_token_ms == \
        pytest.approx(t.ttft_ms, rel=0.01)


def test_admission_control_refuses_beyond_the_limit_before_any_token(aggregated, tok):
    prompt = tok.encode_chat([{"role": "user", "content": "Tell me a long story."}])
    sampling = cpb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def burst():
        return await asyncio.gather(*(call(aggregated.gateway.address, token_request(prompt, 24, sampling=sampling))
                                      for _ in range(10)))

    replies = asyncio.run(burst())
    codes = [r.code for r in replies]
    assert codes.count(grpc.StatusCode.OK) >= 4
    refused = [r for r in replies if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused and all(not r.messages for r in refused), "refused requests are never half-served"
    assert all(len(r.tokens) == 24 for r in replies if r.code == grpc.StatusCode.OK)


# -- faults: these kill workers, so they run last ------------------------------------------------


def _busy(workers) -> list:
    return [w for w in workers if w.alive and worker_stats(w.address).num_requests > 0]


def test_a_prefill_worker_killed_before_answering_is_retried(cluster, tok, engine):
    prompt = tok.encode("A long report on the history of the printing press. " * 100)[:1500]
    expected = engine_greedy(engine, [prompt], 8)[0]
    retries = gateway_stats(cluster.gateway.address).prefill_retries

    async def run():
        task = asyncio.create_task(call(cluster.gateway.address, token_request(prompt, 8), timeout=120))
        busy = await asyncio.to_thread(wait_until, lambda: bool(_busy(cluster.prefill)), 30)
        assert busy, "the request never reached a prefill worker"
        victim = _busy(cluster.prefill)[0]
        victim.kill(signal.SIGKILL)
        return victim, await task

    victim, reply = asyncio.run(run())
    assert reply.code == grpc.StatusCode.OK, reply.details
    assert reply.tokens == expected
    assert reply.last.prefill_worker != victim.address
    assert gateway_stats(cluster.gateway.address).prefill_retries == retries + 1


def test_a_decode_worker_killed_mid_stream_is_survived_and_the_last_one_gives_unavailable(cluster, tok, engine):
    """Killed mid-stream, a decode worker's request moves to the survivor (no token lost or repeated);
    with no decode worker left, the client gets UNAVAILABLE within its deadline."""
    prompt = tok.encode_chat([{"role": "user", "content": "Write a long poem about autumn."}])
    sampling = cpb.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = engine_greedy(engine, [prompt], 60, ignore_eos=True)[0]
    killed = []

    def kill_after(n: int):
        def kill(msg, reply):
            if len(reply.messages) == n:
                victim = _busy(cluster.decode)[0]
                victim.kill(signal.SIGKILL)
                killed.append(victim)
            return False
        return kill

    reply = asyncio.run(call(cluster.gateway.address, token_request(prompt, 60, sampling=sampling), timeout=120,
                             on_message=kill_after(4)))
    assert reply.code == grpc.StatusCode.OK, reply.details
    assert reply.tokens == expected
    survivor = next(w for w in cluster.decode if w is not killed[0])
    assert reply.last.decode_worker == survivor.address
    with grpc.insecure_channel(cluster.gateway.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    for q in QUESTIONS[:2]:
        nxt = generate(cluster.gateway.address, chat_request(q, 8))
        assert nxt.code == grpc.StatusCode.OK and nxt.last.decode_worker == survivor.address, nxt.details
    start = time.monotonic()
    last = asyncio.run(call(cluster.gateway.address, token_request(prompt, 60, sampling=sampling), timeout=30,
                            on_message=kill_after(4)))
    assert last.code == grpc.StatusCode.UNAVAILABLE and "no decode worker" in last.details, last.details
    assert time.monotonic() - start < 30 and len(last.messages) >= 4
    assert wait_clean(cluster) == []
