"""The gateway's view of its workers: reachability, load, and which prefixes each one holds.

Routing is least-loaded with prefix awareness. A worker's load is the prompt
tokens it still has to compute plus its running streams; a prompt costs a
worker the tokens that neither its own prefix cache (tracked here from the
prompts it served, an LRU as large as its KV pool) nor the kvstore (the
gateway's Lookup) already holds. A worker that fails a call is taken out of
routing at once and comes back when its health check answers SERVING.

Which workers there are: each entry of ``--prefill-workers`` / ``--decode-workers``
is a static ``host:port``, or ``dns:///HOST:PORT`` (gRPC's target syntax), which
stands for every address HOST resolves to (a Kubernetes headless Service: one A
record per worker pod), resolved again every ``--discovery-interval-s``. A new
address gets a client that is health-checked like the others before it gets
traffic; an address gone from DNS gets no new requests, and its channel is
closed once the calls still open on it have ended. A failed resolution keeps
the last known addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.service import channel
from common.tls import ClientTLS, internal_client
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

log = logging.getLogger("tandem.gateway.workers")

DECODE_STREAM_COST = 32  # prompt tokens a running stream is worth when one worker does both phases
PROBE_TIMEOUT_S = 2.0
DNS_PREFIX = "dns:///"

# host, port -> the addresses it stands for now, as "ip:port"; raises OSError when it cannot say
Resolver = Callable[[str, int], Awaitable[list[str]]]


class PrefixAffinity:
    """Block keys a worker computed recently, LRU-bounded like its KV pool."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the worker probably still holds."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


class Claim:
    """One call's share of a worker's load, held while the call is open: it counts in ``inflight`` and its
    prompt tokens in ``pending_prompt_tokens`` until the worker has computed them (``computed``)."""

    __slots__ = ("pending", "worker")

    def __init__(self, worker: WorkerClient, pending: int) -> None:
        self.worker, self.pending = worker, pending

    def computed(self) -> None:
        """The prompt is done (the first token came back): its tokens no longer load the worker."""
        self.worker.pending_prompt_tokens -= self.pending
        self.pending = 0


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """A ``dns:///HOST:PORT`` entry: every address HOST resolves to, each on PORT."""

    host: str
    port: int

    def __str__(self) -> str:
        return DNS_PREFIX + join_host_port(self.host, self.port)


def parse_dns(entry: str) -> DnsTarget | None:
    """The target of a ``dns:///HOST:PORT`` entry; None for a static ``host:port``. ValueError for a dns
    entry that names a DNS server (``dns://SERVER/...``: the system's resolver is the one used) or no port."""
    if not entry.startswith("dns:"):
        return None
    if not entry.startswith(DNS_PREFIX):
        raise ValueError(f"{entry!r}: write dns:///HOST:PORT (three slashes; the system's resolver is used)")
    host, _, port = entry[len(DNS_PREFIX):].rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r}: write dns:///HOST:PORT, with the workers' port")
    return DnsTarget(host, int(port))


def join_host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC reads it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA records), as ``ip:port``. The system's resolver runs in
    the loop's executor (``loop.getaddrinfo``): a slow DNS server never stalls the streams."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(info[4][0], port) for info in infos})


def tls_checking(name: str | None) -> ClientTLS | None:
    """This process's channel TLS, checking ``name`` in the server's certificate: a worker found through DNS is
    dialled by IP, and its certificate names the DNS name it was found under (``--tls-server-name`` wins)."""
    tls = internal_client()
    if tls is None or name is None or tls.server_name:
        return tls
    return dataclasses.replace(tls, server_name=name)


@dataclass(eq=False)
class WorkerClient:
    address: str
    kind: str  # "prefill" or "decode" (decode workers prefill too in aggregated mode)
    server_name: str | None = None  # the DNS name it was found under (its certificate's name under TLS)
    channel: grpc.aio.Channel = field(init=False)
    stub: wpb_grpc.WorkerStub = field(init=False)
    health: health_pb2_grpc.HealthStub = field(init=False)
    info: wpb.WorkerInfoResponse | None = None
    healthy: bool = False
    inflight: int = 0  # this gateway's calls on it now, for routing (a prefill counts until its first token)
    open_calls: int = 0  # calls open on its channel (a prefill until its handoff is read): see ``track``
    pending_prompt_tokens: int = 0  # prompt tokens of those calls still to compute
    polled: wpb.WorkerStatsResponse | None = None
    affinity: PrefixAffinity = field(default_factory=lambda: PrefixAffinity(1))

    def __post_init__(self) -> None:
        self.channel = channel(self.address, tls_checking(self.server_name))
        self.stub = wpb_grpc.WorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def ready(self) -> bool:
        return self.healthy and self.info is not None

    @contextlib.contextmanager
    def claim(self, new_prompt_tokens: int) -> Iterator[Claim]:
        """Count a call on this worker for routing while it is open (the only way its load changes)."""
        self.inflight += 1
        self.pending_prompt_tokens += new_prompt_tokens
        held = Claim(self, new_prompt_tokens)
        try:
            yield held
        finally:
            self.inflight -= 1
            held.computed()

    def remember_prefix(self, keys: list[bytes]) -> None:
        """The worker now caches these blocks: later requests with the same prefix prefer it."""
        self.affinity.insert(keys)

    def load(self, new_prompt_tokens: int, streams_cost: int) -> int:
        queued = max(self.pending_prompt_tokens, self.polled.queued_prompt_tokens if self.polled else 0)
        return queued + new_prompt_tokens + streams_cost * self.inflight

    async def probe(self) -> None:
        """Health, then Info once and Stats each time; any failure marks it down."""
        try:
            res = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
            if res.status != health_pb2.HealthCheckResponse.SERVING:
                self._set_healthy(False, "not serving")
                return
            if self.info is None:
                self.info = await self.stub.Info(wpb.WorkerInfoRequest(), timeout=PROBE_TIMEOUT_S)
                self.affinity = PrefixAffinity(self.info.num_kv_blocks)
            self.polled = await self.stub.Stats(wpb.WorkerStatsRequest(), timeout=PROBE_TIMEOUT_S)
            self._set_healthy(True)
        except grpc.aio.AioRpcError as exc:
            self._set_healthy(False, exc.code().name)

    def track(self, call: grpc.aio.Call) -> grpc.aio.Call:
        """``call``, counted in ``open_calls`` until it ends however it ends: the channel of a worker gone from
        DNS is closed only when none is open, so that streams in flight on it finish."""
        self.open_calls += 1
        call.add_done_callback(self._call_done)
        return call

    def _call_done(self, call: grpc.aio.Call) -> None:
        self.open_calls -= 1

    def mark_down(self, reason: str) -> None:
        self._set_healthy(False, reason)

    def _set_healthy(self, healthy: bool, reason: str = "") -> None:
        if healthy != self.healthy:
            if healthy:
                log.info("%s worker %s is up", self.kind, self.address)
            else:
                log.warning("%s worker %s is down: %s", self.kind, self.address, reason)
        self.healthy = healthy


class Membership:
    """The addresses of one kind of worker: its static entries, and what each dns entry resolved to last."""

    def __init__(self, kind: str, entries: Sequence[str]) -> None:
        self.kind = kind
        self.static = [e for e in entries if parse_dns(e) is None]
        self.targets = list(dict.fromkeys(t for e in entries if (t := parse_dns(e)) is not None))
        self.answers: dict[DnsTarget, list[str]] = {}
        self.problems: dict[DnsTarget, str] = {}  # the failure last warned about, per target

    def addresses(self) -> dict[str, str | None]:
        """Each address once (static entries first), with the DNS name it was found under (None: static)."""
        found: dict[str, str | None] = dict.fromkeys(self.static)
        for t in self.targets:
            for a in self.answers.get(t, []):
                found.setdefault(a, t.host)
        return found

    async def resolve(self, resolver: Resolver) -> None:
        await asyncio.gather(*(self._resolve(t, resolver) for t in self.targets))

    async def _resolve(self, target: DnsTarget, resolver: Resolver) -> None:
        """A new answer replaces the last; a failed or empty one keeps it (NXDOMAIN while scaled to zero, DNS
        down: the workers it named are still probed, so dead ones take no traffic), with one warning per change."""
        try:
            found = sorted(set(await resolver(target.host, target.port)))
        except (OSError, UnicodeError) as exc:
            found, reason = [], str(exc) or type(exc).__name__
        else:
            reason = "no addresses"
        if not found:
            self._failed(target, reason)
            return
        if self.problems.pop(target, None) is not None:
            log.info("%s workers %s resolve again", self.kind, target)
        if found != self.answers.get(target):
            log.info("%s workers %s: %s", self.kind, target, ", ".join(found))
        self.answers[target] = found

    def _failed(self, target: DnsTarget, reason: str) -> None:
        if self.problems.get(target) != reason:
            kept = len(self.answers.get(target, []))
            log.warning("%s workers %s do not resolve (%s): keeping the %d addresses known", self.kind, target,
                        reason, kept)
        self.problems[target] = reason


class WorkerPool:
    """The workers of both kinds. ``prefill`` and ``decode`` are the routable ones now (lists replaced, never
    changed in place, when DNS answers change); ``resolver`` looks up the ``dns:///`` entries."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], probe_interval_s: float = 1.0,
                 discovery_interval_s: float = 5.0, resolver: Resolver = resolve_dns) -> None:
        self.members = {"prefill": Membership("prefill", prefill), "decode": Membership("decode", decode)}
        self.prefill = [WorkerClient(a, "prefill") for a in self.members["prefill"].static]
        self.decode = [WorkerClient(a, "decode") for a in self.members["decode"].static]
        self.retired: list[WorkerClient] = []  # gone from DNS, with calls still open on them
        self.probe_interval_s = probe_interval_s
        self.discovery_interval_s = discovery_interval_s
        self.resolver = resolver
        self._rr = itertools.count()
        self._tasks: list[asyncio.Task] = []

    @property
    def all(self) -> list[WorkerClient]:
        return self.prefill + self.decode

    @property
    def discovers(self) -> bool:
        return any(m.targets for m in self.members.values())

    async def probe_all(self) -> None:
        await asyncio.gather(*(w.probe() for w in self.all))

    async def discover(self) -> None:
        """Resolve the dns entries once; new addresses are probed before they count as ready, addresses gone
        get no new requests."""
        for kind, members in self.members.items():
            if not members.targets:
                continue
            await members.resolve(self.resolver)
            added = self._sync(kind, members.addresses())
            await asyncio.gather(*(w.probe() for w in added))
        await self._close_idle()

    def _sync(self, kind: str, addresses: dict[str, str | None]) -> list[WorkerClient]:
        """Make the ``kind`` workers those of ``addresses``; the clients that are new."""
        current = {w.address: w for w in getattr(self, kind)}
        for address, w in current.items():
            if address not in addresses:
                log.info("%s worker %s is gone from DNS: no new requests (%d open)", kind, address, w.open_calls)
                self.retired.append(w)
        workers, added = [], []
        for address, name in addresses.items():
            w = current.get(address) or self._revive(kind, address)
            if w is None:
                w = WorkerClient(address, kind, name)
                added.append(w)
            workers.append(w)
        setattr(self, kind, workers)
        return added

    def _revive(self, kind: str, address: str) -> WorkerClient | None:
        """A retired client back in DNS before its channel closed (keeps its prefix affinity)."""
        for w in self.retired:
            if w.kind == kind and w.address == address:
                self.retired.remove(w)
                return w
        return None

    async def _close_idle(self) -> None:
        """Close the channels of retired workers with nothing open on them any more."""
        idle = [w for w in self.retired if w.open_calls == 0]
        self.retired = [w for w in self.retired if w.open_calls > 0]
        for w in idle:
            await w.channel.close()

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._monitor()))
        if self.discovers:
            self._tasks.append(asyncio.create_task(self._discovery()))

    async def _monitor(self) -> None:
        while True:
            await self.probe_all()
            await self._close_idle()
            await asyncio.sleep(self.probe_interval_s)

    async def _discovery(self) -> None:
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            try:
                await self.discover()
            except Exception:  # a resolver's surprise must not end discovery for the gateway's lifetime
                log.exception("worker discovery failed; trying again in %.1f s", self.discovery_interval_s)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for w in self.all + self.retired:
            await w.channel.close()

    def any_info(self) -> wpb.WorkerInfoResponse | None:
        """The model facts, from a prefill worker when there are any (their keys are the ones stored)."""
        for w in self.prefill + self.decode:
            if w.info is not None:
                return w.info
        return None

    def pick(
        self,
        workers: list[WorkerClient],
        keys: Sequence[bytes],
        stored_blocks: int,
        prompt_len: int,
        streams_cost: int,
        exclude: Sequence[WorkerClient] = (),
    ) -> tuple[WorkerClient, int] | None:
        """The ready worker with the least load after this prompt; and the tokens it will compute."""
        ready = [w for w in workers if w.ready and w not in exclude]
        if not ready:
            return None
        start = next(self._rr) % len(ready)  # ties go round-robin
        best, best_cost, best_new = None, None, 0
        for w in ready[start:] + ready[:start]:
            bs = w.info.block_size
            new = 0 if prompt_len == 0 else max(0, prompt_len - max(w.affinity.match(keys), stored_blocks) * bs)
            cost = w.load(new, streams_cost)
            if best_cost is None or cost < best_cost:
                best, best_cost, best_new = w, cost, new
        return best, best_new
