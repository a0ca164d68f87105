"""The asyncio front: streams, concurrent requests, validation errors, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from engine import Engine, SamplingParams
from engine.async_engine import AsyncEngine


@pytest.fixture()
def async_engine(tiny_llama):
    engine = AsyncEngine(Engine.from_model(str(tiny_llama), num_kv_blocks=64))
    yield engine
    engine.shutdown()
    assert engine.engine.num_free_blocks == engine.engine.num_total_blocks


async def collect(engine: AsyncEngine, prompt, params, rid) -> list[int]:
    return [t async for out in engine.generate(prompt, params, rid) for t in out.new_token_ids]


def test_concurrent_streams_equal_the_batch_helper(async_engine, tiny_llama):
    prompts = [[1, 2, 3], [4] * 30, [7, 8]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(async_engine, p, params, f"r{i}") for i, p in enumerate(prompts)))

    outs = asyncio.run(main())
    reference = Engine.from_model(str(tiny_llama), num_kv_blocks=64).generate(prompts, params)
    assert outs == reference


def test_bad_request_raises_and_others_continue(async_engine):
    async def main():
        good = asyncio.create_task(collect(async_engine, [1, 2], SamplingParams(max_tokens=8), "good"))
        with pytest.raises(ValueError, match="empty"):
            await collect(async_engine, [], SamplingParams(), "bad")
        return await good

    assert len(asyncio.run(main())) <= 8


def test_cancelled_stream_frees_its_blocks(async_engine):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        stream = async_engine.generate([1, 2, 3], params, "long")
        await stream.__anext__()
        await stream.aclose()  # what a cancelled gRPC handler does
        for _ in range(200):
            if async_engine.engine.num_free_blocks == async_engine.engine.num_total_blocks:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_load_is_published_by_the_engine_thread(async_engine):
    """What Stats, /metrics and admission read: a snapshot the engine thread replaces whole, never the
    scheduler's queues themselves."""

    async def main():
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        stream = async_engine.generate([1, 2, 3] * 10, params, "busy")
        await stream.__anext__()
        for _ in range(200):  # the engine thread publishes after the step that sent the first token
            busy = async_engine.load
            if busy.num_running:
                break
            await asyncio.sleep(0.01)
        await stream.aclose()
        for _ in range(200):
            if async_engine.load.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        return busy, async_engine.load

    busy, idle = asyncio.run(main())
    assert (busy.num_running, busy.num_unfinished, busy.total_blocks) == (1, 1, 64)
    assert busy.used_blocks >= 2 and busy.queued_prompt_tokens == 0
    assert (idle.num_running, idle.num_waiting, idle.num_unfinished, idle.used_blocks) == (0, 0, 0, 0)
