"""Speculative decoding through `tandem up` with real processes, on the default model: greedy and seeded
streams equal the engine's output without speculation, token for token, with prompt lookup on
disaggregated decode workers and with a draft model (the model itself) aggregated; a stream whose decode
worker dies continues, speculating, on another, from pulled blocks that hold only accepted tokens; the
workers count drafts and acceptances in vLLM's metric names.
"""

from __future__ import annotations

import asyncio
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, SamplingParams
from protos import common_pb2 as cpb
from tandem.launcher import Cluster, ClusterConfig
from tests.e2e.pipeline import WORKER_ARGS, Reply, call, token_request, wait_clean, worker_stats

MAX_TOKENS = 96
TEXT = ("The committee met on Tuesday to review the budget for the new library, the repairs to the old "
        "bridge, and the plan to plant two hundred trees along the river path before the spring festival.")


@pytest.fixture(scope="module")
def workload(default_model, tok) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    """Input-grounded prompts (the answer copies the prompt) and an open one; greedy and seeded; and what
    the engine in this process makes of them without speculation."""
    asks = [f"Repeat this sentence word for word: {TEXT}", f"Copy this text exactly, twice: {TEXT}",
            "Write a short story about a lighthouse keeper.", f"Repeat after me: {TEXT}"]
    prompts = [tok.encode_chat([{"role": "user", "content": a}]) for a in asks]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True)]
    engine = Engine.from_model(str(default_model), kv_cache_gb=0.25)
    return prompts, params, engine.generate(prompts, params)


def launch(model: Path, tmp: Path, mode: str, num_decode: int, speculative: list[str]) -> Cluster:
    config = ClusterConfig(mode=mode, num_prefill=1, num_decode=num_decode, gateway_port=0,
                           engine_args=["--model", str(model), *WORKER_ARGS], kv_capacity_gb=0.5,
                           extra_args={"decode": speculative}, log_dir=tmp, startup_timeout=240)
    cluster = Cluster(config).start()
    cluster.wait_healthy(60)
    return cluster


@pytest.fixture(scope="module")
def ngram(default_model, tmp_path_factory) -> Iterator[Cluster]:
    c = launch(default_model, tmp_path_factory.mktemp("spec-ngram"), "disaggregated", 2,
               ["--speculative-method", "ngram", "--num-speculative-tokens", "4"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def draft(default_model, tmp_path_factory) -> Iterator[Cluster]:
    c = launch(default_model, tmp_path_factory.mktemp("spec-draft"), "aggregated", 1,
               ["--speculative-method", "draft", "--speculative-model", str(default_model)])
    yield c
    c.stop()


def request_of(prompt: list[int], p: SamplingParams):
    sampling = cpb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, ignore_eos=True)
    if p.seed is not None:
        sampling.seed = p.seed
    return token_request(prompt, p.max_tokens, sampling=sampling)


def run_all(cluster: Cluster, workload) -> list[Reply]:
    prompts, params, _ = workload

    async def go() -> list[Reply]:
        return await asyncio.gather(*(call(cluster.gateway.address, request_of(p, sp), timeout=300)
                                      for p, sp in zip(prompts, params, strict=True)))

    return asyncio.run(go())


def spec_counters(cluster: Cluster) -> tuple[float, float]:
    """(draft tokens, accepted tokens) over the cluster's decode workers, from their /metrics."""
    drafted = accepted = 0.0
    for w in cluster.decode:
        text = urllib.request.urlopen(f"http://{w.ready['metrics']}/metrics", timeout=10).read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "tandem_spec_decode_num_draft_tokens_total":
                    drafted += s.value
                elif s.name == "tandem_spec_decode_num_accepted_tokens_total":
                    accepted += s.value
    return drafted, accepted


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_streams_equal_the_output_without_speculation(request, name, workload):
    cluster = request.getfixturevalue(name)
    before = spec_counters(cluster)
    replies = run_all(cluster, workload)
    assert [r.code for r in replies] == [grpc.StatusCode.OK] * len(replies), [r.details for r in replies]
    assert [r.tokens for r in replies] == workload[2]
    drafted, accepted = (a - b for a, b in zip(spec_counters(cluster), before, strict=True))
    assert drafted > 0 and accepted > 0, "the decode workers speculated, and some guesses were right"
    assert any(len(m.token_ids) > 1 for r in replies for m in r.messages[1:]), "a step streamed several tokens"
    assert wait_clean(cluster) == []


def test_a_speculating_stream_continues_on_another_worker_after_a_kill(ngram, workload):
    """The new worker pulls the generated blocks the dead one pushed (accepted tokens only: a rejected
    draft's KV in them would change what follows) and goes on speculating."""
    prompts, params, expected = workload
    killed = []
    loaded = {w.address: worker_stats(w.address).kv_blocks_loaded for w in ngram.decode}

    def kill_its_worker(msg, reply):
        if len(reply.tokens) >= 40 and not killed:
            victim = next(w for w in ngram.decode if w.alive and worker_stats(w.address).num_requests)
            victim.kill(signal.SIGKILL)
            killed.append(victim)
        return False

    req = request_of(prompts[0], params[0])
    req.cache_salt = "kill-test"  # no worker has its blocks cached from the other tests: the survivor pulls them
    reply = asyncio.run(call(ngram.gateway.address, req, timeout=300, on_message=kill_its_worker))
    assert killed and reply.code == grpc.StatusCode.OK, reply.details
    assert reply.tokens == expected[0]
    survivor = next(w for w in ngram.decode if w.alive)
    pulled = worker_stats(survivor.address).kv_blocks_loaded - loaded[survivor.address]
    assert pulled >= len(prompts[0]) // 16 + 2, "it pulled the prompt's and the generated blocks"
    ngram.restart(*killed)
    # A push the dead worker had in flight holds a reservation until its TTL (30 s) expires it.
    assert wait_clean(ngram, timeout=45) == []


def test_a_stop_string_inside_an_accepted_draft_ends_the_stream_there(ngram, workload, tok):
    """Several tokens arrive in one message; the gateway still cuts the text at the stop string."""
    prompts, params, expected = workload
    text = tok.decode(expected[0])
    stop = "bridge"
    assert stop in text
    req = request_of(prompts[0], params[0])
    req.stop.append(stop)
    reply = asyncio.run(call(ngram.gateway.address, req, timeout=300))
    assert reply.code == grpc.StatusCode.OK, reply.details
    assert reply.text == text[: text.index(stop)] and reply.last.stop_reason == stop
    assert reply.last.finish_reason == cpb.FINISH_REASON_STOP
    assert wait_clean(ngram) == []
