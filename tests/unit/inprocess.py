"""A gateway, the real tokenizer service and a fake aggregated worker, all in this process on port 0,
served by one event loop on a background thread; tests call them through real channels.

The fake worker answers ``Decode`` with one token and checks what a real engine would refuse, so a request
the gateway lets through with parameters the engine rejects shows up as INTERNAL in the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from gateway.server import SERVICE_NAME, Gateway, add_args, add_gateway_servicer
from protos import common_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tandem.metrics import RequestMetrics
from tandem.pb_convert import sampling_from_pb
from tandem.service import RunningServer, Service, start_server
from tokenizer_svc.server import build_service
from tokenizer_svc.tokenizer import TextTokenizer

FAKE_MODEL_LEN = 2048
FAKE_TOKEN = 28  # what the fake worker generates


class LoopThread:
    """An event loop on a daemon thread: servers live there, tests hand it coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeWorker(wpb_grpc.WorkerServicer):
    """An aggregated worker without an engine: one token per request, finished at once."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.salts: list[str] = []  # the cache_salt of every Decode call, in order

    async def Info(self, request: wpb.WorkerInfoRequest, context) -> wpb.WorkerInfoResponse:
        return wpb.WorkerInfoResponse(role="aggregated", model="fake", model_fingerprint=bytes(32), block_size=16,
                                      max_model_len=FAKE_MODEL_LEN, vocab_size=self.vocab_size, dtype="float32",
                                      num_kv_blocks=FAKE_MODEL_LEN // 16)

    async def Stats(self, request: wpb.WorkerStatsRequest, context) -> wpb.WorkerStatsResponse:
        return wpb.WorkerStatsResponse()

    async def Decode(self, request: wpb.DecodeRequest, context):
        self.salts.append(request.cache_salt)
        try:  # what the engine would check at add_request
            params = sampling_from_pb(request.sampling, 1)
            assert request.prompt_token_ids and max(request.prompt_token_ids) < self.vocab_size
            assert len(request.prompt_token_ids) + params.max_tokens <= FAKE_MODEL_LEN
            floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
            assert all(math.isfinite(getattr(params, f)) for f in floats), "NaN or inf would poison the logits"
        except (ValueError, AssertionError) as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"the gateway let through a request the engine "
                                f"refuses: {exc!r}")
        yield wpb.DecodeResponse(output=cpb.TokenOutput(token_ids=[FAKE_TOKEN]),
                                 finish_reason=cpb.FINISH_REASON_LENGTH)


class Stack:
    """tokenizer_svc + fake worker + gateway; ``gateway`` is the address clients call."""

    def __init__(self, model: Path, gateway_args: list[str] | None = None) -> None:
        self.loop = LoopThread()
        self.tokenizer = TextTokenizer(model)
        self.worker = FakeWorker(self.tokenizer.vocab_size)
        self.servers: list[RunningServer] = []
        self.gateway_core: Gateway | None = None
        self.loop.run(self._start(gateway_args or []))

    async def _start(self, gateway_args: list[str]) -> None:
        tok = await start_server([build_service(self.tokenizer)], "127.0.0.1", 0)
        worker = await start_server([Service("tandem.v1.Worker", wpb_grpc.add_WorkerServicer_to_server,
                                             self.worker)], "127.0.0.1", 0)
        parser = argparse.ArgumentParser()
        add_args(parser)
        args = parser.parse_args(["--mode", "aggregated", "--tokenizer", f"127.0.0.1:{tok.port}",
                                  "--decode-workers", f"127.0.0.1:{worker.port}", "--port", "0", *gateway_args])
        self.gateway_core = Gateway(args, RequestMetrics(CollectorRegistry()))
        gw = await start_server([Service(SERVICE_NAME, add_gateway_servicer, self.gateway_core)], "127.0.0.1", 0,
                                max_receive_bytes=args.max_request_bytes)
        await self.gateway_core.pool.probe_all()
        assert self.gateway_core.limits() is not None, "the fake worker is not ready"
        self.servers = [gw, worker, tok]
        self.gateway = f"127.0.0.1:{gw.port}"
        self.tokenizer_address = f"127.0.0.1:{tok.port}"

    def close(self) -> None:
        async def stop() -> None:
            for s in self.servers:
                await s.stop(0)
            if self.gateway_core is not None:
                await self.gateway_core.close()

        self.loop.run(stop())
        self.loop.close()
