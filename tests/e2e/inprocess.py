"""A gateway and the real tokenizer service in this process on port 0, served by one event loop on a background
thread, in front of real aggregated workers: ``decode_svc.server`` processes running the engine on the default
model, started by the launcher (``tandem.launcher.Cluster``) once per test session and shared by the modules.
Tests call them through real channels, and read the in-process gateway's state (``Stack.gateway_core``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prometheus_client import CollectorRegistry

from common.metrics import RequestMetrics
from common.service import RunningServer, Service, start_server
from gateway.server import SERVICE_NAME, Gateway, add_args, add_gateway_servicer
from tandem.launcher import Cluster, ClusterConfig, ServiceProcess, ServiceSpec
from tandem.model_fetch import MODEL_NAME
from tests.e2e.pipeline import WORKER_ARGS
from tests.loop_thread import LoopThread
from tokenizer_svc.server import build_service
from tokenizer_svc.tokenizer import TextTokenizer

# The workers' --max-model-len: short prompts and streams keep a request to a few engine steps.
MODEL_LEN = 256
MODEL = MODEL_NAME  # what the workers' Info calls the default model (its folder's name)


class RealWorkers:
    """Aggregated workers as processes on loopback (``tandem serve decode`` without a kvstore), started when a
    test first asks for them; ``close`` stops them. Start them from the main thread: children die with the
    thread that forked them."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.cluster = Cluster(ClusterConfig(
            mode="aggregated", num_decode=1, gateway_port=0, log_dir=log_dir, startup_timeout=240,
            engine_args=["--model", str(model), *WORKER_ARGS, "--max-model-len", str(MODEL_LEN)]))
        self.processes: list[ServiceProcess] = []

    def addresses(self, n: int) -> list[str]:
        """The gRPC addresses of ``n`` workers, starting the missing ones (together)."""
        missing = n - len(self.processes)
        if missing > 0:
            argv = self.cluster.worker_specs(None)[0].argv
            first = len(self.processes)
            specs = [ServiceSpec(f"worker-{first + i}", "decode", list(argv)) for i in range(missing)]
            self.processes += self.cluster.launch(specs)
            self.cluster.wait_healthy(60)
        dead = [p.name for p in self.processes[:n] if not p.alive]
        assert not dead, f"workers exited: {dead}; see {self.cluster.log_dir}"
        return [p.address for p in self.processes[:n]]

    def close(self) -> None:
        self.cluster.stop()


class Stack:
    """tokenizer_svc + gateway in process, in front of the real worker at ``worker``; ``gateway`` is the
    address clients call."""

    def __init__(self, model: Path, worker: str, gateway_args: list[str] | None = None) -> None:
        self.loop = LoopThread()
        self.tokenizer = TextTokenizer(model)
        self.worker = worker
        self.servers: list[RunningServer] = []
        self.gateway_core: Gateway | None = None
        self.loop.run(self._start(gateway_args or []))

    async def _start(self, gateway_args: list[str]) -> None:
        tok = await start_server([build_service(self.tokenizer)], "127.0.0.1", 0)
        parser = argparse.ArgumentParser()
        add_args(parser)
        args = parser.parse_args(["--mode", "aggregated", "--tokenizer", f"127.0.0.1:{tok.port}",
                                  "--decode-workers", self.worker, "--port", "0", *gateway_args])
        self.gateway_core = Gateway(args, RequestMetrics(CollectorRegistry()))
        gw = await start_server([Service(SERVICE_NAME, add_gateway_servicer, self.gateway_core)], "127.0.0.1", 0,
                                max_receive_bytes=args.max_request_bytes)
        await self.gateway_core.pool.probe_all()
        assert self.gateway_core.limits() is not None, f"the worker at {self.worker} is not ready"
        self.servers = [gw, tok]
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
