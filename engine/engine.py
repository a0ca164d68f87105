"""The engine: ``add_request`` / ``step`` / ``abort``; a step is schedule -> forward -> update.

The role decides where a request's life ends: ``both`` runs it to its stop
condition; ``producer`` stops after the first token, having handed the prompt's
blocks to the KV connector; ``consumer`` (or any role, given
``num_external_tokens``) starts from KV loaded through the connector.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from engine.block_hash import HASH_BYTES, model_fingerprint
from engine.config import EngineConfig
from engine.kv_blocks import wire_block_shape
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.kv_staging import StagingPool
from engine.kv_transfer import KVConnector, LoadResult, block_ref
from engine.loader import weights_id
from engine.parallel.build import build_runner
from engine.request import Request, RequestOptions, RequestOutput, RequestStatus, RequestTimes, TokenLogprobs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import KVLoad, ScheduledRequest, Scheduler
from engine.spec_decode.build import build_speculator
from engine.stats import EngineLoad, EngineStats
from engine.structured.bitmask import GrammarBitmask
from engine.structured.compiler import GrammarCompiler, GrammarState

log = logging.getLogger("tandem.engine")

# How long a step with nothing to compute but KV loads in flight sleeps before it returns. Without it a caller
# stepping in a loop (the async loop, generate, a test) held the GIL that the connector's threads need to finish
# those loads: four pulls of a few blocks took 5-9 s that way (long enough on a slow host for the store's lease on
# the blocks to end mid-pull), 0.2 s with the pause.
LOAD_POLL_S = 0.001


class Engine:
    """Runs continuous batching over one model; not thread-safe (see ``AsyncEngine``)."""

    def __init__(self, config: EngineConfig, kv_connector: KVConnector | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = config.model_config
        self.runner = build_runner(config)  # a TPExecutor driving every rank at tensor_parallel_size > 1
        self.fingerprint = model_fingerprint(
            self.model_config.to_dict(),
            config.dtype,
            config.block_size,
            weights_id(config.model, config.load_format, config.seed, config.quantization, config.gguf_file,
                       config.device),
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, self.fingerprint
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.scheduling_policy,
        )
        self.sampler = Sampler(config.seed, self.runner.model.kernels.argmax)
        mc = self.model_config
        self.grammars = GrammarCompiler(
            Path(config.model) / "tokenizer.json", mc.vocab_size, mc.eos_token_ids,
            config.grammar_cache_size, config.grammar_compile_timeout_s,
        )
        self._bitmask = GrammarBitmask(mc.vocab_size)
        self.spec = build_speculator(config, self.runner.num_blocks)
        self.connector = kv_connector
        self.staging = None  # host rows that KV exports and pulls borrow (engine.kv_staging)
        if kv_connector is not None:
            self.staging = self._staging_pool()
            kv_connector.use_staging(self.staging)
            if kv_connector.rank_agent is not None and config.tensor_parallel_size > 1:
                kv_connector.use_ranks(self.runner.start_transfer_agents(kv_connector.rank_agent))
        self.stats = EngineStats(prefix_cache=self.kv.stats)
        self._loads: dict[str, KVLoad] = {}
        self._ids = itertools.count()

    def _staging_pool(self) -> StagingPool:
        cfg = self.config
        shape = wire_block_shape(self.model_config, cfg.block_size)
        itemsize = torch.empty((), dtype=cfg.torch_dtype).element_size()
        blocks = max(1, int(cfg.kv_staging_mb * 2**20) // (math.prod(shape) * itemsize))
        if cfg.tensor_parallel_size > 1:  # in shared memory: every rank reads and writes its heads in place
            pool = StagingPool(shape, cfg.torch_dtype, blocks, shm_name=self.runner.pool_name)
            self.runner.use_staging(pool)
            return pool
        return StagingPool(shape, cfg.torch_dtype, blocks, pin=cfg.device.startswith("cuda"))

    @classmethod
    def from_model(cls, model: str, kv_connector: KVConnector | None = None, **kwargs) -> Engine:
        return cls(EngineConfig(model=model, **kwargs), kv_connector)

    @property
    def role(self) -> str:
        return self.config.role

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached prefixes included: they are reusable on demand)."""
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.runner.num_blocks

    def load_snapshot(self) -> EngineLoad:
        """The engine's load now; call it on the thread that steps the engine."""
        s, total = self.scheduler, self.num_total_blocks
        queued = sum(r.num_tokens - r.num_computed_tokens for r in s.waiting)
        queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in s.running)
        return EngineLoad(len(s.running), len(s.waiting), len(s.loading), s.num_unfinished,
                          total - self.num_free_blocks, total, queued)

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """``callback(why)`` once if the engine dies (a tensor-parallel rank is lost); never at degree 1."""
        self.runner.on_dead(callback)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any; the engine is unusable after."""
        if self.connector is not None:
            self.connector.flush()  # pushes in flight may be the ranks' own: they finish before the ranks stop
        self.runner.shutdown()
        if self.staging is not None:
            self.staging.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def only_loading(self) -> bool:
        """Every unfinished request waits for its KV to arrive: a step now would compute nothing."""
        s = self.scheduler
        return bool(s.loading) and not s.running and not s.waiting

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> str:
        """Validate and queue; raises ValueError with the reason on bad input.

        ``params`` arrive already valid (``SamplingParams`` checks itself); what is checked here depends
        on this engine: its vocabulary, model length, cache size and connector. ``options`` carries a
        handoff's tokens and keys (``RequestOptions``).
        """
        params = params or SamplingParams()
        options = options or RequestOptions()
        self._validate(prompt_token_ids, params)
        self._validate_options(prompt_token_ids, params, options)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        request = Request(request_id, list(prompt_token_ids), params, eos, options.priority, options.cache_salt)
        request.output_token_ids = list(options.output_token_ids)
        if options.block_hashes:
            request.block_hashes = list(options.block_hashes)  # the caller hashed them: update_hashes extends
        request.num_external_tokens = options.num_external_tokens
        # What it loads came from the store: pushing it back would be wasted.
        request.num_saved_blocks = options.num_external_tokens // self.config.block_size
        if params.structured is not None:
            request.grammar = self._grammar_state(params, options)
        self.scheduler.add(request)
        return request_id

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model length {self.config.max_model_len}"
            )
        if not self.kv.can_ever_fit(total):
            raise ValueError(
                f"prompt + max_tokens = {total} tokens needs more KV blocks than the whole cache "
                f"({self.runner.num_blocks} blocks of {self.config.block_size})"
            )

    def _validate_options(self, prompt: list[int], params: SamplingParams, options: RequestOptions) -> None:
        if not isinstance(options, RequestOptions):
            raise TypeError("options must be a RequestOptions")
        if options.cache_salt is not None and not isinstance(options.cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if not isinstance(options.priority, int) or isinstance(options.priority, bool):
            raise ValueError(f"priority must be an integer (lower is served first), got {options.priority!r}")
        outputs, num_external = options.output_token_ids, options.num_external_tokens
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in outputs):
            raise ValueError(f"output token ids must be integers in [0, {vocab})")
        if len(outputs) >= params.max_tokens:
            raise ValueError(f"{len(outputs)} tokens already generated: nothing left within max_tokens")
        total = len(prompt) + len(outputs)
        if not isinstance(num_external, int) or not 0 <= num_external < total:
            raise ValueError(
                "num_external_tokens must be in [0, prompt + generated tokens - 1]: at least the last "
                f"token is computed here, got {num_external}"
            )
        if num_external and self.connector is None:
            raise ValueError("num_external_tokens needs a KV connector, and this engine has none")
        keys, bs = options.block_hashes, self.config.block_size
        if keys is None:
            return
        if len(keys) > total // bs:
            raise ValueError(f"{len(keys)} block hashes for {total} tokens: at most one per full block ({total // bs})")
        if num_external % bs and len(keys) > num_external // bs:
            # The connector finds a block by key when the request has one for it (kv_transfer.block_ref).
            raise ValueError(
                f"block {num_external // bs} is loaded as a partial block, by request: give at most "
                f"num_external_tokens // block_size = {num_external // bs} block hashes"
            )
        if any(not isinstance(k, bytes) or len(k) != HASH_BYTES for k in keys):
            raise ValueError(f"block hashes must be {HASH_BYTES}-byte keys (engine.block_hash)")

    def _grammar_state(self, params: SamplingParams, options: RequestOptions) -> GrammarState:
        """The request's matcher, advanced over the tokens generated before it came here (a prefill's first
        token, a migrated stream's outputs), so that it continues the grammar where they left it."""
        compiled = options.grammar or self.grammars.compile(params.structured)
        state = compiled.new_state()
        if not state.accept_all(options.output_token_ids):
            raise ValueError(
                f"the {len(options.output_token_ids)} tokens generated so far do not follow the structured-output "
                f"constraint: {state.error}"
            )
        return state

    def abort(self, request_id: str) -> bool:
        """Free everything the request holds, wherever it is; False if it is unknown or finished."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget cached prefixes no request holds (e.g. after the weights changed); how many."""
        return self.kv.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._apply_loads()
        sched = self.scheduler.schedule()
        self._start_loads(sched.loads)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if not sched:
            self.stats.last_step_overhead_s = time.perf_counter() - t0
            if self.only_loading():  # nothing to compute until a KV load lands: wait a poll interval (LOAD_POLL_S)
                time.sleep(LOAD_POLL_S)
            return []
        if self.spec is not None:
            self.spec.expand(sched, self.kv, self.config.max_num_batched_tokens, self.config.max_model_len)
        sampling = [s for s in sched.scheduled if s.samples]
        t1 = time.perf_counter()
        logits = self.runner.execute(sched)
        tokens, logprobs, dead = self._sample(logits, sampling)
        t2 = time.perf_counter()
        outputs = self._update(sched.scheduled, sampling, tokens, logprobs, dead)
        self.stats.num_steps += 1
        self.stats.last_step_overhead_s = (t1 - t0) + (time.perf_counter() - t2)
        return outputs

    def _sample(
        self, logits: torch.Tensor, sampling: list[ScheduledRequest]
    ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]], dict[int, str]]:
        """Each sampling request's new tokens (one, or what its draft's verification kept) and their logprobs;
        the constrained requests whose grammar allows no token, by index, with why."""
        if not any(s.draft for s in sampling):
            requests = [s.request for s in sampling]
            dead = self._constrain(logits, requests)
            tokens, logprobs = self.sampler.sample(logits, requests)
            return [[t] for t in tokens], [[lp] for lp in logprobs], dead
        starts, at = [], 0
        for s in sampling:
            starts.append(at)
            at += 1 + len(s.draft)
        plain = [i for i, s in enumerate(sampling) if not s.draft]
        tokens: list[list[int]] = [[] for _ in sampling]
        logprobs: list[list[TokenLogprobs | None]] = [[] for _ in sampling]
        dead: dict[int, str] = {}
        if plain:
            rows = logits[torch.tensor([starts[i] for i in plain], device=logits.device)]
            requests = [sampling[i].request for i in plain]
            dead = {plain[j]: why for j, why in self._constrain(rows, requests).items()}
            for i, t, lp in zip(plain, *self.sampler.sample(rows, requests), strict=True):
                tokens[i], logprobs[i] = [t], [lp]
        for i, s in enumerate(sampling):
            if s.draft:
                rows = logits[starts[i] : starts[i] + 1 + len(s.draft)]
                tokens[i], logprobs[i] = self.sampler.verify(rows, s.request, s.draft)
        return tokens, logprobs, dead

    def _constrain(self, logits: torch.Tensor, requests: list[Request]) -> dict[int, str]:
        """Mask the rows of constrained requests to what their grammars allow; the rows whose grammar
        allows nothing, with why (they end instead of sampling an unconstrained token)."""
        states = [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]
        if not states:
            return {}
        self.stats.structured_tokens += len(states)
        return self._bitmask.apply(logits, states).dead

    def _start_loads(self, loads: list[KVLoad]) -> None:
        for load in loads:
            r = load.request
            self.kv.update_hashes(r, r.num_external_tokens)  # full blocks are found by key
            self._loads[r.request_id] = load
            self.connector.start_load(r, load.first_block, load.num_blocks)

    def _apply_loads(self) -> None:
        """Write finished loads into the cache; a failed load falls back to recomputation."""
        if self.connector is None or not self._loads:
            return
        for result in self.connector.poll_loads():
            load = self._loads.pop(result.request_id, None)
            try:
                if load is not None and load.request.status is RequestStatus.WAITING_FOR_KV:  # else aborted
                    self._apply_load(load, result)
            finally:
                if result.release is not None:
                    result.release()

    def _apply_load(self, load: KVLoad, result: LoadResult) -> None:
        r = load.request
        if result.data is not None:
            try:
                ids = r.block_ids[load.first_block : load.first_block + load.num_blocks]
                read = self.runner.import_blocks_async(ids, result.data)
                if read is not None and result.release is not None:  # a GPU still copies out of the rows
                    _release_once_read(read, result.release)
                    result.release = None
            except ValueError as exc:
                result.error = str(exc)
        if result.error is not None:
            log.warning("request %s: its KV load failed, recomputing instead: %s", r.request_id, result.error)
            self.stats.kv_load_failures += 1
            r.num_saved_blocks = 0  # the store lacks them after all: a producer pushes what it recomputes
            self.scheduler.requeue_for_recompute(r)
            return
        self.stats.kv_blocks_loaded += load.num_blocks
        self.scheduler.finish_load(r)

    def _update(
        self,
        scheduled: list[ScheduledRequest],
        sampling: list[ScheduledRequest],
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprobs | None]],
        dead: dict[int, str],
    ) -> list[RequestOutput]:
        for s in scheduled:
            if not s.draft:  # a verified draft advances by what it kept, once its tokens are known (below)
                self._advance(s.request, s.num_tokens)
        now = time.monotonic()
        producer, running = self.role == "producer", RequestStatus.RUNNING
        outputs = []
        for i, (s, toks, lps) in enumerate(zip(sampling, tokens, logprobs, strict=True)):
            r = s.request
            new_tokens, new_logprobs, status, broken = self._emit(r, toks, lps, dead.get(i) if dead else None)
            self.stats.generation_tokens += len(new_tokens)
            if s.draft:
                self.spec.record(s, len(toks))
                if status is None and broken is None:
                    self._advance(r, len(new_tokens))  # the last token and the accepted draft are computed
                    self.kv.trim(r, r.num_tokens)  # the rejected draft's slots go back
            times = None
            if r.first_token_time is None:
                r.first_token_time = now
                times = RequestTimes.of(r)
            if broken is not None:
                self._end_ungrammatical(r, broken)
            elif status is not None:
                self._finish(r, status)
            elif producer:
                self._finish(r, RequestStatus.FINISHED_PREFILLED)
            finished = r.status > running
            out = RequestOutput(
                r.request_id,
                new_tokens,
                new_logprobs,
                finished,
                r.status.finish_reason if finished else None,
                len(r.prompt_token_ids),
                len(r.output_token_ids),
                max(r.num_cached_tokens, min(r.num_external_tokens, len(r.prompt_token_ids))),
                times,
            )
            if r.spec is not None:
                out.num_draft_tokens, out.num_accepted_tokens = r.spec.num_draft_tokens, r.spec.num_accepted_tokens
            outputs.append(out)
        return outputs

    def _advance(self, r: Request, n: int) -> None:
        """``n`` more of the request's tokens have their KV computed: count them, register the blocks that
        became full in the prefix cache, and hand the connector those it pushes."""
        bs = self.config.block_size
        computed = r.num_computed_tokens
        if computed < len(r.prompt_token_ids):
            self.stats.prompt_tokens_computed += min(n, len(r.prompt_token_ids) - computed)
        r.num_computed_tokens = computed = computed + n
        if computed // bs > r.num_cached_blocks:
            self.kv.cache_computed_blocks(r)
        if self.connector is None:
            return
        if self.role == "producer":
            self._save_final_blocks(r)
        elif self.role == "consumer" and self.config.push_generated_blocks and computed // bs > r.num_saved_blocks:
            self._save_full_blocks(r)

    def _emit(
        self, r: Request, tokens: list[int], logprobs: list[TokenLogprobs | None], broken: str | None
    ) -> tuple[list[int], list[TokenLogprobs], RequestStatus | None, str | None]:
        """Append the sampled tokens up to the first that ends the request; what was appended, how it ends
        (None: it goes on), and why its grammar broke (None: it did not)."""
        new_tokens: list[int] = []
        new_logprobs: list[TokenLogprobs] = []
        status = None
        for token, lp in zip(tokens, logprobs, strict=True):
            if broken is None and r.grammar is not None and not r.grammar.accept(token):
                broken = r.grammar.error or f"token {token} does not follow the grammar"
            if broken is not None:
                break
            r.output_token_ids.append(token)
            new_tokens.append(token)
            if lp is not None:
                r.output_logprobs.append(lp)
                new_logprobs.append(lp)
            status = self._stop_status(r, token)
            if status is not None:
                break
        return new_tokens, new_logprobs, status, broken

    def _stop_status(self, r: Request, token: int) -> RequestStatus | None:
        """How the request ends with ``token`` just appended, or None if it goes on."""
        params = r.params
        if token in r.eos_token_ids or (params.stop_token_ids and token in params.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if r.grammar is not None and r.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        n_out = len(r.output_token_ids)
        if n_out >= params.max_tokens or n_out + len(r.prompt_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _end_ungrammatical(self, r: Request, why: str) -> None:
        """A constrained request that cannot go on ends here, rather than with an unconstrained token."""
        log.warning("request %s: its structured-output grammar allows no further token: %s", r.request_id, why)
        self.stats.grammar_errors += 1
        self._finish(r, RequestStatus.FINISHED_GRAMMAR)

    def _save_final_blocks(self, r: Request) -> None:
        """Hand the connector the prompt blocks that became final this step."""
        computed = min(r.num_computed_tokens, r.num_prompt_tokens)
        done = computed == r.num_prompt_tokens
        end = cdiv(computed, self.config.block_size) if done else computed // self.config.block_size
        if end <= r.num_saved_blocks:
            return
        self.kv.update_hashes(r, computed)
        self._save_blocks(r, end)

    def _save_full_blocks(self, r: Request) -> None:
        """Consumer: hand the connector the blocks of prompt + generated tokens that became full."""
        end = r.num_computed_tokens // self.config.block_size
        self.kv.update_hashes(r, end * self.config.block_size)
        self._save_blocks(r, end)

    def _save_blocks(self, r: Request, end: int) -> None:
        """Push blocks ``num_saved_blocks .. end`` of ``r``: a full one under its key (``update_hashes``
        computed it), the partial tail under its request."""
        refs = [block_ref(r, i) for i in range(r.num_saved_blocks, end)]
        staged = self.staging.take(len(refs)) if self.staging is not None else None  # None: a fresh tensor
        out, release = (staged.tensor, staged.release) if staged is not None else (None, None)
        try:  # on a GPU the copy to the host runs on a side stream, and the connector waits for it
            data, ready = self.runner.export_blocks_async(r.block_ids[r.num_saved_blocks : end], out)
        except BaseException:
            if release is not None:
                release()
            raise
        self.connector.save_blocks(r, r.num_saved_blocks, refs, data, release, ready)
        self.stats.kv_blocks_saved += end - r.num_saved_blocks
        r.num_saved_blocks = end

    def _finish(self, r: Request, status: RequestStatus) -> None:
        self.scheduler.finish(r, status)
        if self.spec is not None:
            self.spec.release(r)
        self._loads.pop(r.request_id, None)
        if self.connector is not None:
            self.connector.request_finished(r)

    def generate(
        self,
        prompts: Iterable[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        options: RequestOptions | list[RequestOptions] | None = None,
    ) -> list[list[int]]:
        """Batch helper: run prompts to completion, outputs in the order of ``prompts``.

        ``params`` and ``options`` are one for all prompts or a list with one per prompt (per-prompt
        options are what carry outputs, external tokens or block hashes: those are about one prompt).
        """
        prompts = list(prompts)
        per = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        opts = options if isinstance(options, list) else [options] * len(prompts)
        ids = [self.add_request(p, sp, None, o) for p, sp, o in zip(prompts, per, opts, strict=True)]
        results: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]


def _release_once_read(read: Callable[[], None], release: Callable[[], None]) -> None:
    """Give a load's staging rows back once the GPU's copy out of them is done, off the engine thread."""

    def wait_then_release() -> None:
        try:
            read()
        finally:
            release()

    threading.Thread(target=wait_then_release, name="kv-load-release", daemon=True).start()
