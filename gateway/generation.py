"""One Generate call, end to end: tokenize -> route -> prefill -> first token -> decode -> stream.

Disaggregated: a prefill worker answers with the first token (streamed to the
client at once) and then the handoff naming the prompt's blocks in the kvstore;
a decode worker pulls them and streams the rest. Aggregated: one decode worker
does both. A prefill worker that dies before answering is replaced by another
(the request is re-sent under a fresh attempt id). A decode worker that dies or
hands the request back (draining) is replaced too, at any point of the stream:
the request moves on with the tokens streamed so far, up to --migration-limit
times, then ends with UNAVAILABLE. However the call ends, downstream calls are
cancelled (aborting the request in the workers) and request-scoped blocks are
dropped from the store.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from engine.block_hash import chain_hashes, root_hash
from gateway.detokenizer import RemoteDetokenizer
from gateway.observe import RequestRecord, Reroutes
from gateway.stop_strings import StopMatcher
from gateway.validation import ValidRequest
from gateway.workers import DECODE_STREAM_COST, WorkerClient, WorkerPool
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import worker_pb2 as wpb

MAX_ATTEMPTS = 3  # prefill workers a request tries at most (decode: ``migration_limit``)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

# block keys, the call's tracing metadata -> how many leading blocks the kvstore holds (0: it cannot say)
StoredBlocks = Callable[[list[bytes], list[tuple[str, str]]], Awaitable[int]]


class GenerationError(Exception):
    """Ends the call with ``code``; raised for downstream failures the client should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def downstream_error(hop: str, exc: grpc.aio.AioRpcError) -> GenerationError:
    """A downstream status passed on, with the hop that gave it."""
    code = exc.code()
    if code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.FAILED_PRECONDITION):
        code = grpc.StatusCode.INTERNAL
    return GenerationError(code, f"{hop}: {exc.details()}")


@dataclass(slots=True)
class Clock:
    """Marks on the gateway's clock, in seconds since the call arrived."""

    start: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic() - self.start

    def ms(self, name: str, since: str | None = None) -> float:
        end = self.marks.get(name, 0.0)
        return 1000.0 * (end - (self.marks.get(since, 0.0) if since else 0.0))


@dataclass(frozen=True, slots=True)
class Backends:
    """What a Generation may use of its gateway, and no more: the workers to route to, the kvstore's prefix
    lookup, the counts of re-sent requests (changed only through their owner's methods), and fixed settings.
    One per gateway, shared by its calls."""

    pool: WorkerPool
    stored_blocks: StoredBlocks
    reroutes: Reroutes
    aggregated: bool
    migration_limit: int  # times a request may move to another decode worker
    kvstore_address: str  # named in the handoffs of migrations ("" when aggregated)


@dataclass(slots=True)
class Plan:
    """What the gateway knows of a request once it is tokenized and routed."""

    valid: ValidRequest
    prompt: list[int]
    keys: list[bytes]  # of the prompt's full blocks, hashed once per request
    stored_blocks: int
    cache_salt: str
    priority: int
    block_size: int  # the model facts ``keys`` were hashed for: a migration's keys extend them
    fingerprint: bytes
    base_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def sampling(self) -> cpb.SamplingParams:
        """What every attempt and migration sends, as is: validated and filled in once per request, in
        ``gateway.validation``, so no hop converts it again."""
        if self.valid.sampling is None:
            raise RuntimeError("gateway.validation.check_length resolves the sampling parameters before a plan")
        return self.valid.sampling


class Output:
    """Turns workers' tokens into client messages: text deltas, stop strings, usage and timings."""

    def __init__(self, request_id: str, detok: RemoteDetokenizer, stop: StopMatcher, prompt_len: int,
                 stop_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.stop_token_ids = set(stop_token_ids)
        self.detok = detok
        self.stop = stop
        self.prompt_len = prompt_len
        self.num_tokens = 0
        self.last_token: int | None = None
        self.cached_tokens = 0
        self.sent_any = False
        self.finished = False

    async def message(self, out: cpb.TokenOutput, finish: int) -> gpb.GenerateResponse:
        ids = list(out.token_ids)
        self.num_tokens += len(ids)
        self.last_token = ids[-1] if ids else self.last_token
        done = finish not in (cpb.FINISH_REASON_UNSPECIFIED, cpb.FINISH_REASON_PREFILLED)
        text = self.stop.push(await self.detok.push(ids, finish=done))
        if self.stop.matched is not None:
            done, finish = True, cpb.FINISH_REASON_STOP
        elif done:
            text += self.stop.flush()
        msg = gpb.GenerateResponse(request_id=self.request_id, text=text, token_ids=ids, logprobs=out.logprobs)
        first, self.sent_any = not self.sent_any, True
        if done:
            self.finished = True
            msg.finish_reason = finish
            msg.stop_reason = self._stop_reason(finish)
        if done or first:  # the first: what the prompt cost is known as soon as its first token is
            msg.usage.CopyFrom(cpb.Usage(prompt_tokens=self.prompt_len, completion_tokens=self.num_tokens,
                                         cached_tokens=self.cached_tokens))
        return msg

    def _stop_reason(self, finish: int) -> str:
        """The stop string or stop token id that ended it; empty for an end-of-sequence token (as vLLM)."""
        if self.stop.matched is not None:
            return self.stop.matched
        if finish == cpb.FINISH_REASON_STOP and self.last_token in self.stop_token_ids:
            return str(self.last_token)
        return ""


class Generation:
    """The steps of one call; ``backends`` is all it uses of the gateway."""

    def __init__(self, backends: Backends, plan: Plan, output: Output, context: grpc.aio.ServicerContext,
                 clock: Clock, record: RequestRecord) -> None:
        self.backends = backends
        self.record = record
        self.plan = plan
        self.out = output
        self.context = context
        self.clock = clock
        self.timings = cpb.Timings()
        self.prefill_worker = ""
        self.decode_worker = ""
        self.partial_ids: list[str] = []  # attempt ids whose partial blocks may sit in the store
        self.chain = list(plan.keys)  # keys of prompt + outputs, each block hashed once however often it moves

    def timeout(self) -> float | None:
        return self.context.time_remaining()

    async def run(self) -> AsyncIterator[gpb.GenerateResponse]:
        if self.backends.aggregated:
            stream = self._decode(self.plan.base_id, [], None)
        else:
            stream = self._disaggregated()
        async with contextlib.aclosing(stream):
            async for msg in stream:
                if "first_token" not in self.clock.marks:
                    self.clock.mark("first_token")
                if self.out.finished:
                    self._finish(msg)
                yield msg
                if self.out.finished:
                    return

    async def _disaggregated(self) -> AsyncIterator[gpb.GenerateResponse]:
        worker, call, first, rid = await self._prefill()
        try:
            self.out.cached_tokens = first.num_cached_tokens
            self.timings.prefill_queue_ms, self.timings.prefill_compute_ms = first.queue_ms, first.compute_ms
            yield await self.out.message(first.output, first.finish_reason)
            if self.out.finished:
                return
            handoff = await self._handoff(call)
        finally:
            call.cancel()
        decode = self._decode(rid, list(first.output.token_ids), handoff)
        async with contextlib.aclosing(decode):
            async for msg in decode:
                yield msg

    async def _prefill(self) -> tuple[WorkerClient, object, wpb.PrefillResponse, str]:
        """The first token from a prefill worker, retrying on another one if it dies or is full."""
        pool, plan, tried, last = self.backends.pool, self.plan, [], None
        for attempt in range(MAX_ATTEMPTS):
            picked = pool.pick(pool.prefill, plan.keys, plan.stored_blocks, len(plan.prompt), 0, tried)
            if picked is None:
                break
            worker, new_tokens = picked
            tried.append(worker)
            rid = f"{plan.base_id}-p{attempt}"
            self.partial_ids.append(rid)
            if attempt == 0:
                self._routed(worker, new_tokens)
            else:
                self.backends.reroutes.prefill_retried()
                self.record.root.add_event("prefill retried", {"tandem.worker": worker.address,
                                                               "reason": last.details() if last else ""})
            call = worker.track(worker.stub.Prefill(self._prefill_request(rid), timeout=self.timeout(),
                                                    metadata=self.record.metadata()))
            with worker.claim(new_tokens):
                try:
                    first = await call.read()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in RETRYABLE:
                        raise downstream_error(f"prefill worker {worker.address}", exc) from exc
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        worker.mark_down(exc.details() or "unavailable")
                    last = exc
                    continue
                except BaseException:  # cancelled by the client, or the deadline: abort it in the worker too
                    call.cancel()
                    raise
            if first is grpc.aio.EOF:
                call.cancel()
                raise GenerationError(grpc.StatusCode.INTERNAL, f"prefill worker {worker.address} sent nothing")
            worker.remember_prefix(plan.keys)
            self.prefill_worker = worker.address
            return worker, call, first, rid
        raise self._no_worker("prefill", last)

    def _prefill_request(self, rid: str) -> wpb.PrefillRequest:
        p = self.plan
        return wpb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=p.prompt,
            sampling=p.sampling,
            cache_salt=p.cache_salt,
            priority=p.priority,
            num_stored_tokens=p.stored_blocks * p.block_size,
        )

    async def _handoff(self, call) -> cpb.KVHandoff | None:
        """Where the prompt's blocks are; None if the prefill worker died first (decode then recomputes)."""
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise downstream_error("prefill worker", exc) from exc
            return None
        if msg is grpc.aio.EOF:
            return None
        self.timings.kv_push_ms = msg.kv_push_ms
        return msg.handoff

    async def _decode(
        self, rid: str, outputs: list[int], handoff: cpb.KVHandoff | None
    ) -> AsyncIterator[gpb.GenerateResponse]:
        """Stream from a decode worker. When it dies or hands the request back (draining), the request
        moves to another one with every token streamed so far, up to the migration limit: the client
        sees no token lost or repeated, and seeded sampling goes on as if nothing happened."""
        pool, plan, outputs = self.backends.pool, self.plan, list(outputs)
        failed: list[WorkerClient] = []
        last: grpc.aio.AioRpcError | None = None
        migrations = 0
        while True:
            prefills = handoff is None and not outputs  # aggregated: the worker computes the prompt
            picked = pool.pick(pool.decode, plan.keys, 0, len(plan.prompt) if prefills else 0,
                               DECODE_STREAM_COST if prefills else 1, failed)
            if picked is None:
                raise self._no_worker("decode", last, migrations)
            worker, new_tokens = picked
            if prefills and "routed" not in self.clock.marks:
                self._routed(worker, new_tokens)
            call = worker.track(worker.stub.Decode(self._decode_request(rid, outputs, handoff),
                                                   timeout=self.timeout(), metadata=self.record.metadata()))
            received, reason = 0, None
            with worker.claim(new_tokens) as claim:
                try:
                    async for msg in call:
                        if msg.finish_reason == cpb.FINISH_REASON_MIGRATE:
                            reason = f"decode worker {worker.address} is draining"
                            break
                        if received == 0:
                            claim.computed()
                            self._decode_started(worker, msg, prefills)
                        received += 1
                        outputs.extend(msg.output.token_ids)
                        yield await self.out.message(msg.output, msg.finish_reason)
                        if self.out.finished:
                            return
                    if reason is None:
                        raise GenerationError(grpc.StatusCode.INTERNAL, f"decode worker {worker.address} ended "
                                              "the stream without a finish reason")
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in RETRYABLE:
                        raise downstream_error(f"decode worker {worker.address}", exc) from exc
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        worker.mark_down(exc.details() or "unavailable")
                    last, reason = exc, f"decode worker {worker.address} failed: {exc.details()}"
                finally:
                    call.cancel()
            failed.append(worker)
            migrations += 1
            if migrations > self.backends.migration_limit:
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"{reason}, after {self.out.num_tokens} tokens; "
                                      f"the request was moved {migrations - 1} times, the limit is "
                                      f"{self.backends.migration_limit}")
            self._migrating(worker, reason, len(outputs))
            handoff = None if self.backends.aggregated else await self._resume_handoff(outputs)

    async def _resume_handoff(self, outputs: list[int]) -> cpb.KVHandoff:
        """What the next decode worker can pull: the stored prefix of prompt + outputs (the prompt's
        blocks, and generated blocks if decode workers push them), and the prompt's partial tail
        block, which the store keeps until the request ends."""
        plan, bs = self.plan, self.plan.block_size
        tokens = plan.prompt + outputs
        keys = self._keys(tokens, (len(tokens) - 1) // bs)
        stored = await self.backends.stored_blocks(keys, self.record.metadata())
        n, partial = stored * bs, False
        if stored == len(plan.prompt) // bs and len(plan.prompt) % bs:
            n, partial = len(plan.prompt), True
        return cpb.KVHandoff(kvstore_address=self.backends.kvstore_address, num_tokens=n,
                             block_keys=keys[:stored], has_partial=partial)

    def _keys(self, tokens: list[int], blocks: int) -> list[bytes]:
        """The first ``blocks`` keys of ``tokens`` (the prompt, then the outputs so far, which only grow): the
        chain goes on from the plan's prompt keys, and only blocks no earlier migration hashed are hashed."""
        chain, bs = self.chain, self.plan.block_size
        if len(chain) < blocks:
            parent = chain[-1] if chain else root_hash(self.plan.fingerprint, self.plan.cache_salt)
            chain.extend(chain_hashes(parent, tokens[: blocks * bs], bs, len(chain)))
        return chain[:blocks]

    def _migrating(self, worker: WorkerClient, reason: str, num_tokens: int) -> None:
        self.backends.reroutes.migrated()
        self.record.root.add_event("migration", {"tandem.from_worker": worker.address, "reason": reason,
                                                 "tandem.tokens_so_far": num_tokens})

    def _routed(self, worker: WorkerClient, new_tokens: int) -> None:
        self.clock.mark("routed")
        self.record.end_route(**{
            "tandem.worker": worker.address,
            "tandem.worker_queue_tokens": worker.pending_prompt_tokens,
            "tandem.worker_inflight": worker.inflight,
            "tandem.stored_blocks": self.plan.stored_blocks,
            "tandem.prompt_tokens_to_compute": new_tokens,
            "gen_ai.usage.input_tokens": len(self.plan.prompt),
        })

    def _decode_request(self, rid: str, outputs: list[int], handoff: cpb.KVHandoff | None) -> wpb.DecodeRequest:
        p = self.plan
        req = wpb.DecodeRequest(
            request_id=rid,
            prompt_token_ids=p.prompt,
            sampling=p.sampling,
            cache_salt=p.cache_salt,
            priority=p.priority,
            output_token_ids=outputs,
        )
        if handoff is not None:
            req.handoff.CopyFrom(handoff)
        return req

    def _decode_started(self, worker: WorkerClient, msg: wpb.DecodeResponse, prefills: bool) -> None:
        self.decode_worker = worker.address
        self.timings.decode_queue_ms, self.timings.kv_pull_ms = msg.queue_ms, msg.kv_pull_ms
        if prefills:
            worker.remember_prefix(self.plan.keys)
            self.out.cached_tokens = msg.num_cached_tokens
            self.timings.prefill_queue_ms, self.timings.prefill_compute_ms = msg.queue_ms, msg.prefill_ms
            self.timings.decode_queue_ms = 0.0

    def _no_worker(self, phase: str, last: grpc.aio.AioRpcError | None, migrations: int = 0) -> GenerationError:
        if last is not None and last.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and self.out.num_tokens == 0:
            return GenerationError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"every {phase} worker is full: "
                                   f"{last.details()}")
        detail = f" (last error: {last.details()})" if last is not None else ""
        moved = f" after {self.out.num_tokens} tokens and {migrations} migrations" if migrations else ""
        return GenerationError(grpc.StatusCode.UNAVAILABLE, f"no {phase} worker is available{moved}{detail}")

    def _finish(self, msg: gpb.GenerateResponse) -> None:
        t, c = self.timings, self.clock
        c.mark("end")
        t.tokenize_ms, t.route_ms = c.ms("tokenized"), c.ms("routed", "tokenized")
        t.ttft_ms = c.ms("first_token")
        t.first_token_ms = max(0.0, t.ttft_ms - t.tokenize_ms - t.route_ms - t.prefill_queue_ms
                               - t.prefill_compute_ms)
        t.queue_ms = t.prefill_queue_ms + t.decode_queue_ms
        t.prefill_ms = t.prefill_compute_ms
        t.kv_transfer_ms = t.kv_push_ms + t.kv_pull_ms
        t.e2e_ms = c.ms("end")
        msg.timings.CopyFrom(t)
        msg.prefill_worker, msg.decode_worker = self.prefill_worker, self.decode_worker
