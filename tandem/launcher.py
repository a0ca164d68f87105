"""``tandem up``'s engine: every service as its own process on this machine.

The launcher starts the pipeline in dependency order (kvstore and tokenizer, then all
workers at once since each spends seconds loading the model, then the gateway that
needs their addresses), learns each address from the service's READY line, and stops
everything in the reverse order so the gateway drains before the workers behind it go.

Children write stdout and stderr to ``<log dir>/<name>.log``; the launcher tails that
file instead of holding a pipe (a pipe nobody reads fills up and blocks the child).
Children never outlive the launcher: each runs in its own process group (a Ctrl-C in
the terminal reaches only the launcher, which then stops them in order), gets SIGTERM
from the kernel if the launcher dies (Linux ``PR_SET_PDEATHSIG``, set by the child itself
through ``tandem.child``), and is stopped at interpreter exit. ``PR_SET_PDEATHSIG`` fires
when the *thread* that forked the child exits, so start a cluster from a thread that
outlives it (the main thread).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.paths import model_folder
from engine.kv_blocks import wire_block_bytes

if TYPE_CHECKING:
    from common.tls import ClientTLS
    from tandem.dev_certs import CertFiles, DevCA

MODES = ("disaggregated", "aggregated")
SERVICE_KINDS = ("kvstore", "tokenizer", "prefill", "decode", "gateway")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# ``NAME READY k=v k=v``: the one line a service prints once it listens (common.service.announce).
READY_RE = re.compile(r"^([A-Z][A-Z0-9_]*) READY((?: +[A-Za-z0-9_]+=\S*)*) *$")
# Wiring the launcher decides for every child; inherited TANDEM_* values would silently
# override it (a stray TANDEM_KVSTORE would turn an aggregated worker into a consumer).
LAUNCHER_OWNED_ENV = (
    "TANDEM_HOST", "TANDEM_PORT", "TANDEM_DATA_PORT", "TANDEM_NODE_ID", "TANDEM_KVSTORE", "TANDEM_TOKENIZER",
    "TANDEM_MODE", "TANDEM_DECODE_WORKERS", "TANDEM_PREFILL_WORKERS", "TANDEM_REDIS_URL", "TANDEM_GATEWAY",
    "TANDEM_METRICS_PORT", "TANDEM_HEALTH_PORT",
    # TLS is the launcher's too: `tandem up --tls` gives every service its certificate, or none has one.
    "TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA", "TANDEM_TLS_CLIENT_CA", "TANDEM_TLS_INTERNAL_CERT",
    "TANDEM_TLS_INTERNAL_KEY", "TANDEM_TLS_SERVER_NAME",
)
LOG_TAIL_LINES = 20


class LaunchError(RuntimeError):
    """A service did not come up (or stay up); the message carries the tail of its log."""


def parse_ready_line(line: str) -> tuple[str, dict[str, str]] | None:
    """``("KVSTORE", {"grpc": "127.0.0.1:5000", ...})`` for a READY line, else None."""
    m = READY_RE.match(line.rstrip("\r\n"))
    if not m:
        return None
    fields = dict(item.split("=", 1) for item in m.group(2).split())
    return m.group(1), fields


def read_model_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def kv_block_bytes(config: dict, dtype: str, block_size: int = 16) -> int:
    """Bytes of one KV block in the wire layout (``engine.kv_blocks``): the kvstore's slot size.

    Read from ``config.json`` as the engine reads it, without loading torch (``tandem up`` stays light).
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
    heads = config["num_attention_heads"]
    dims = _KVDims(config["num_hidden_layers"], config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads)
    return wire_block_bytes(dims, block_size, DTYPE_BYTES[dtype])


class _KVDims(NamedTuple):
    """The fields of ``engine.config.ModelConfig`` that size a KV block (that module loads torch)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def default_log_dir() -> Path:
    """A fresh folder per launch under ``$TANDEM_HOME/logs`` (a temp dir if that is not writable)."""
    from common.paths import tandem_home

    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        path = tandem_home() / "logs" / f"up-{stamp}-{os.getpid()}"
        path.mkdir(parents=True, exist_ok=False)
        return path
    except OSError:
        return Path(tempfile.mkdtemp(prefix=f"tandem-up-{stamp}-"))


def tail_lines(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``n`` lines of a log file (only its end is read, logs can be long)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


@dataclass(slots=True)
class ServiceSpec:
    """What to run: ``sys.executable`` followed by ``argv`` (e.g. ``["-m", "kvstore.server", ...]``)."""

    name: str  # unique in the cluster: "kvstore", "prefill-0", ...
    kind: str  # "kvstore", "tokenizer", "prefill", "decode", "gateway", or anything else
    argv: list[str]


@dataclass(eq=False)
class ServiceProcess:
    """One running child: its process, its log, and what its READY line said."""

    name: str
    kind: str
    proc: subprocess.Popen
    log_path: Path
    ready: dict[str, str] = field(default_factory=dict)
    ready_name: str | None = None
    spec: ServiceSpec | None = None  # how it was started (``Cluster.restart`` starts it again)
    _offset: int = field(default=0, repr=False)  # how far the log has been read for the READY line
    _partial: bytes = field(default=b"", repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        """The gRPC address from the READY line."""
        if "grpc" not in self.ready:
            raise LaunchError(f"{self.name} has not reported its address (no READY line yet)")
        return self.ready["grpc"]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def kill(self, sig: int = signal.SIGTERM) -> None:
        """Signal the child's process group (the child and anything it started), if it still runs."""
        if not self.alive:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        """True once the child has exited (and is reaped), False if it still runs after ``timeout``."""
        try:
            self.proc.wait(max(0.0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if the child is still there after ``timeout`` seconds; the exit code."""
        self.kill(signal.SIGTERM)
        if not self.wait(timeout):
            self.kill(signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode

    def log_tail(self, n: int = LOG_TAIL_LINES) -> list[str]:
        return tail_lines(self.log_path, n)

    def poll_ready(self) -> bool:
        """Read what the child logged since the last call; True once its READY line is there."""
        if self.ready_name is not None:
            return True
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return False
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for raw in lines:
            parsed = parse_ready_line(raw.decode("utf-8", "replace"))
            if parsed:
                self.ready_name, self.ready = parsed
                return True
        return False

    def failure(self, reason: str) -> LaunchError:
        """An error naming this service, why it failed, and the end of its log."""
        tail = "\n".join("  | " + line for line in self.log_tail()) or "  | (the log is empty)"
        return LaunchError(f"{self.name} {reason} (log: {self.log_path}); its last lines:\n{tail}")


@dataclass(slots=True)
class ClusterConfig:
    """What ``tandem up`` runs; ``engine_args`` are engine flags (``--model``, ``--dtype``, ...) for workers."""

    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    gateway_port: int = 50051  # 0: a free port
    http_port: int = 0  # the gateway's OpenAI-compatible API (0: a free port, -1: off); `tandem up`: 8000
    engine_args: list[str] = field(default_factory=list)
    kv_capacity_gb: float = 1.0
    redis_url: str | None = None
    # Extra flags per service kind ("kvstore", "tokenizer", "prefill", "decode", "gateway").
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    log_dir: Path | None = None  # default: a fresh folder under $TANDEM_HOME/logs
    env: dict[str, str] = field(default_factory=dict)  # added to every child's environment
    startup_timeout: float = 180.0  # seconds per start stage
    # Cores per service kind ("prefill": [0], "decode": [1]); a pinned worker's --num-threads
    # defaults to its number of cores. Unnamed kinds run wherever the kernel puts them.
    cpu_affinity: dict[str, list[int]] = field(default_factory=dict)
    # Mutual TLS between the services and TLS on the gateway, with a throwaway CA and a certificate per
    # service generated into <log dir>/tls (tandem.dev_certs); health checks go to each plaintext health port.
    tls: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.num_decode < 1:
            raise ValueError("at least one decode worker is needed")
        if self.mode == "disaggregated" and self.num_prefill < 1:
            raise ValueError("disaggregated mode needs at least one prefill worker")
        if self.kv_capacity_gb <= 0:
            raise ValueError("kv_capacity_gb must be > 0")
        for what, per_kind in (("extra_args", self.extra_args), ("cpu_affinity", self.cpu_affinity)):
            unknown = set(per_kind) - set(SERVICE_KINDS)
            if unknown:
                raise ValueError(f"{what} for unknown services: {', '.join(sorted(unknown))}")
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        for kind, cpus in self.cpu_affinity.items():
            if not cpus or not set(cpus) <= usable:
                raise ValueError(f"cpu_affinity[{kind!r}] = {cpus!r}: name cores this process may use "
                                 f"({', '.join(map(str, sorted(usable))) or 'none: no sched_setaffinity here'})")

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"

    @property
    def num_workers(self) -> int:
        return self.num_decode + (self.num_prefill if self.disaggregated else 0)


def parse_engine_args(engine_args: Sequence[str]) -> argparse.Namespace:
    """The engine flags as the workers will read them (same parser, same TANDEM_* defaults)."""
    from common.engine_args import add_engine_args

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    ns, _ = parser.parse_known_args(list(engine_args))
    return ns


class Cluster:
    """The whole pipeline as local processes; ``with Cluster(config) as c:`` starts and stops it."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.log_dir = Path(config.log_dir) if config.log_dir else default_log_dir()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.gateway: ServiceProcess | None = None
        self.tokenizer: ServiceProcess | None = None
        self.kvstore: ServiceProcess | None = None
        self.prefill: list[ServiceProcess] = []
        self.decode: list[ServiceProcess] = []
        self._tiers: list[list[ServiceProcess]] = []  # in start order; stopped in reverse
        self._engine = parse_engine_args(config.engine_args)
        self._atexit = False
        self.ca: DevCA | None = None  # the throwaway CA, with config.tls
        self._certs: dict[str, CertFiles] = {}  # by service name
        if config.tls:
            from tandem.dev_certs import DevCA

            self.ca = DevCA(self.log_dir / "tls", hosts=[config.host])

    # -- what to run ---------------------------------------------------------------------------

    @property
    def services(self) -> list[ServiceProcess]:
        return [svc for tier in self._tiers for svc in tier]

    @property
    def model(self) -> Path:
        """The model as the user named it: a folder, or a .gguf file in one."""
        from common.engine_args import resolve_model

        return resolve_model(self._engine.model)

    @property
    def model_dir(self) -> Path:
        """The model's folder: config.json and the tokenizer."""
        return model_folder(self.model)

    def block_bytes(self) -> int:
        return kv_block_bytes(read_model_config(self.model_dir), self._engine.dtype, self._engine.block_size)

    def _extra(self, kind: str) -> list[str]:
        return list(self.config.extra_args.get(kind, []))

    def _listen(self, port: int = 0) -> list[str]:
        return ["--host", self.config.host, "--port", str(port)]

    def tls_flags(self, name: str) -> list[str]:
        """``--tls-cert/--tls-key/--tls-ca`` of service ``name`` (its certificate is issued on first use);
        none without ``config.tls``."""
        if self.ca is None:
            return []
        if name not in self._certs:
            self._certs[name] = self.ca.issue(name)
        return self._certs[name].flags()

    @property
    def ca_path(self) -> Path | None:
        """The CA a client of this cluster's gateway trusts (``tandem generate --tls-ca``); None without TLS."""
        return self.ca.ca_path if self.ca else None

    @property
    def http_url(self) -> str:
        """The base URL of the gateway's OpenAI-compatible API (``.../v1``)."""
        if self.gateway is None or "http" not in self.gateway.ready:
            raise LaunchError("the gateway serves no HTTP API (not started, or --http-port -1)")
        scheme = "https" if self.ca is not None else "http"
        return f"{scheme}://{self.gateway.ready['http']}/v1"

    def client_tls(self) -> ClientTLS | None:
        """How a client reaches the gateway's public port: TLS trusting the cluster's CA (None without TLS)."""
        if self.ca is None:
            return None
        from common.tls import ClientTLS

        return ClientTLS(ca=self.ca.ca_path.read_bytes())

    def kvstore_spec(self) -> ServiceSpec:
        argv = ["-m", "kvstore.server", *self._listen(), "--capacity-gb", repr(self.config.kv_capacity_gb),
                "--block-bytes", str(self.block_bytes())]
        if self.config.redis_url:
            argv += ["--redis-url", self.config.redis_url]
        return ServiceSpec("kvstore", "kvstore", argv + self.tls_flags("kvstore") + self._extra("kvstore"))

    def tokenizer_spec(self) -> ServiceSpec:
        argv = ["-m", "tokenizer_svc.server", "--model", str(self.model_dir), *self._listen()]
        return ServiceSpec("tokenizer", "tokenizer", argv + self.tls_flags("tokenizer") + self._extra("tokenizer"))

    def worker_engine_args(self, kind: str = "decode") -> list[str]:
        """The user's engine flags, with the model pinned and the CPU threads shared out among workers
        (a worker pinned to cores gets one thread per core)."""
        args = [*self.config.engine_args, "--model", str(self.model)]
        if self._engine.num_threads is None:
            pinned = self.config.cpu_affinity.get(kind)
            threads = len(pinned) // self._ranks(kind) if pinned else (os.cpu_count() or 1) // self._all_ranks()
            args += ["--num-threads", str(max(1, threads))]
        return args

    def _ranks(self, kind: str) -> int:
        """Processes one worker of ``kind`` runs: its tensor-parallel degree (``--{kind}-args`` may set it)."""
        return parse_engine_args([*self.config.engine_args, *self._extra(kind)]).tensor_parallel_size

    def _all_ranks(self) -> int:
        kinds = [("prefill", self.config.num_prefill)] if self.config.disaggregated else []
        return sum(n * self._ranks(kind) for kind, n in [*kinds, ("decode", self.config.num_decode)])

    def worker_specs(self, kvstore: str | None) -> list[ServiceSpec]:
        """Prefill workers (disaggregated only) and decode workers; ``kvstore`` is the store's gRPC address."""
        store = ["--kvstore", kvstore] if self.config.disaggregated and kvstore else []
        kinds = [("prefill", self.config.num_prefill)] if self.config.disaggregated else []
        kinds.append(("decode", self.config.num_decode))
        return [ServiceSpec(f"{kind}-{i}", kind, ["-m", f"{kind}_svc.server", *self.worker_engine_args(kind), *store,
                                                  *self._listen(), *self.tls_flags(f"{kind}-{i}"), *self._extra(kind)])
                for kind, count in kinds for i in range(count)]

    def gateway_spec(self) -> ServiceSpec:
        assert self.tokenizer is not None and self.decode, "the gateway starts after the tokenizer and workers"
        argv = ["-m", "gateway.server", *self._listen(self.config.gateway_port), "--tokenizer", self.tokenizer.address,
                "--mode", self.config.mode, "--decode-workers", ",".join(s.address for s in self.decode),
                "--http-port", str(self.config.http_port)]
        if self.config.disaggregated:
            assert self.kvstore is not None
            argv += ["--prefill-workers", ",".join(s.address for s in self.prefill), "--kvstore", self.kvstore.address]
        # One certificate for both sides: the public port's, and the gateway's towards the other services.
        return ServiceSpec("gateway", "gateway", argv + self.tls_flags("gateway") + self._extra("gateway"))

    # -- starting --------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start every service in order; on any failure stop what runs and raise ``LaunchError``."""
        first = [self.tokenizer_spec()]
        if self.config.disaggregated:
            first.insert(0, self.kvstore_spec())
        self.launch(first)
        self.launch(self.worker_specs(self.kvstore.address if self.kvstore else None))
        self.launch([self.gateway_spec()])
        return self

    def launch(self, specs: Sequence[ServiceSpec], timeout: float | None = None) -> list[ServiceProcess]:
        """Start ``specs`` together and wait for all their READY lines (one start stage)."""
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        tier: list[ServiceProcess] = []
        self._tiers.append(tier)
        try:
            for spec in specs:
                tier.append(self._spawn(spec))
            self._wait_ready(tier, self.config.startup_timeout if timeout is None else timeout)
        except BaseException:
            self.stop()
            raise
        for svc in tier:
            self._register(svc)
        return tier

    def _child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_OWNED_ENV}
        env.update(self.config.env)
        env["PYTHONUNBUFFERED"] = "1"  # log lines reach the file as they happen
        from common.telemetry import OTLP_ENDPOINT_ENVS, TRACE_FILE_ENV, default_trace_file

        if not any(env.get(k) for k in (*OTLP_ENDPOINT_ENVS, TRACE_FILE_ENV)):
            env[TRACE_FILE_ENV] = str(default_trace_file())  # no collector: spans for `tandem trace`
        return env

    def _spawn(self, spec: ServiceSpec) -> ServiceProcess:
        log_path = self.log_dir / f"{spec.name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0  # a restart appends to its log
        with open(log_path, "ab") as log:
            env = self._child_env()
            env["TANDEM_PARENT_PID"] = str(os.getpid())  # tandem.child: die with the launcher
            env["TANDEM_CPUS"] = ",".join(map(str, self.config.cpu_affinity.get(spec.kind, [])))
            # A process group of its own (set before exec, no Python in between): Ctrl-C on the
            # launcher's terminal does not reach it; the launcher stops it in order.
            proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.child", *spec.argv], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env, process_group=0, close_fds=True,
            )
        return ServiceProcess(spec.name, spec.kind, proc, log_path, spec=spec, _offset=offset)

    @staticmethod
    def _wait_ready(pending: Sequence[ServiceProcess], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(pending)
        while waiting:
            for svc in list(waiting):
                exited = not svc.alive  # checked before reading, so a READY line written just before exit counts
                if svc.poll_ready():
                    waiting.remove(svc)
                elif exited:
                    raise svc.failure(f"exited with code {svc.returncode} before it was ready")
            if waiting and time.monotonic() > deadline:
                raise waiting[0].failure(f"printed no READY line within {timeout:.0f} s")
            if waiting:
                time.sleep(0.05)

    def restart(self, *services: ServiceProcess, timeout: float | None = None) -> list[ServiceProcess]:
        """Start services again on their gRPC addresses (stopping those that run): the gateway's
        health checks find them there, as they would pods that Kubernetes restarted. Call it from
        the thread that started the cluster (children die with the thread that forked them)."""
        fresh = []
        for svc in services:
            if svc.alive:
                svc.stop()
            argv = list(svc.spec.argv)
            argv[argv.index("--port") + 1] = svc.address.rsplit(":", 1)[1]
            if "http" in svc.ready:  # the gateway's HTTP port too: clients know it
                argv[argv.index("--http-port") + 1] = svc.ready["http"].rsplit(":", 1)[1]
            fresh.append(self._spawn(ServiceSpec(svc.name, svc.kind, argv)))
        try:
            self._wait_ready(fresh, self.config.startup_timeout if timeout is None else timeout)
        except BaseException:
            for f in fresh:
                f.stop()
            raise
        for old, new in zip(services, fresh, strict=True):
            self._replace(old, new)
        return fresh

    def _replace(self, old: ServiceProcess, new: ServiceProcess) -> None:
        for group in (*self._tiers, self.prefill, self.decode):
            if old in group:
                group[group.index(old)] = new
        for kind in ("kvstore", "tokenizer", "gateway"):
            if getattr(self, kind) is old:
                setattr(self, kind, new)

    def _register(self, svc: ServiceProcess) -> None:
        if svc.kind in ("prefill", "decode"):
            getattr(self, svc.kind).append(svc)
        elif svc.kind in ("kvstore", "tokenizer", "gateway"):
            setattr(self, svc.kind, svc)

    # -- watching and stopping -------------------------------------------------------------------

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Block until every service answers the gRPC health check with SERVING; ``LaunchError`` if not."""
        deadline = time.monotonic() + timeout
        for svc in self.services:
            if not _serving(svc, deadline):
                reason = "exited" if not svc.alive else f"is not SERVING after {timeout:.0f} s"
                raise svc.failure(reason)

    def dead(self) -> list[ServiceProcess]:
        """Services that have exited."""
        return [svc for svc in self.services if not svc.alive]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM tier by tier in reverse start order (the gateway first), SIGKILL what outlives ``timeout``."""
        for tier in reversed(self._tiers):
            for svc in tier:
                svc.kill(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for svc in tier:
                if not svc.wait(deadline - time.monotonic()):
                    svc.kill(signal.SIGKILL)
                    svc.proc.wait()
        if self._atexit:  # only once all are down: an interrupted stop is finished at exit
            atexit.unregister(self.stop)
            self._atexit = False

    def __enter__(self) -> Cluster:
        if not self._tiers:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serving(svc: ServiceProcess, deadline: float) -> bool:
    """Poll one service's overall health status until SERVING, its exit, or ``deadline`` (on its plaintext
    health port when it announced one: a service with TLS does)."""
    with grpc.insecure_channel(svc.ready.get("health") or svc.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            remaining = deadline - time.monotonic()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=max(0.2, min(2.0, remaining)))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline or not svc.alive:
                return False
            time.sleep(0.1)


def format_table(cluster: Cluster) -> str:
    """One row per service: name, address, pid, its /metrics, log file."""
    rows = [("SERVICE", "ADDRESS", "PID", "METRICS", "LOG")]
    rows += [(s.name, s.ready.get("grpc", "-"), str(s.pid), s.ready.get("metrics", "-"), str(s.log_path))
             for s in cluster.services]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
                     for row in rows)


def serve_until_signal(cluster: Cluster, err: TextIO, poll_s: float = 0.5) -> int:
    """Wait for SIGINT / SIGTERM, reporting any service that dies meanwhile (the rest keep running)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    reported: set[str] = set()
    try:
        while not stop.wait(poll_s):
            for svc in cluster.dead():
                if svc.name not in reported:
                    reported.add(svc.name)
                    print(f"tandem up: {svc.failure(f'exited with code {svc.returncode}')}", file=err, flush=True)
        print("tandem up: stopping", file=err, flush=True)
        cluster.stop()  # still under our handlers: a second Ctrl-C does not interrupt the stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
