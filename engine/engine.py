"""The engine: ``add_request`` / ``step`` / ``abort``; a step is schedule -> forward -> update."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import torch

from engine.block_pool import KVCacheManager
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput, RequestStatus, TokenLogprobs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler


class Engine:
    """Runs continuous batching over one model; not thread-safe (see ``AsyncEngine``)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = config.model_config
        self.runner = ModelRunner(config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self.sampler = Sampler(config.seed)
        self._ids = itertools.count()

    @classmethod
    def from_model(cls, model: str, **kwargs) -> Engine:
        return cls(EngineConfig(model=model, **kwargs))

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.runner.num_blocks

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and queue; raises ValueError with the reason on bad input."""
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        request = Request(request_id, list(prompt_token_ids), params, eos, priority)
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

    def abort(self, request_id: str) -> bool:
        """Free everything the request holds, wherever it is; False if it is unknown or finished."""
        return self.scheduler.abort(request_id)

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched:
            return []
        logits = self.runner.execute(sched)
        sampling = [s for s in sched.scheduled if s.samples]
        tokens, logprobs = self.sampler.sample(logits, [s.request for s in sampling])
        return self._update(sched.scheduled, sampling, tokens, logprobs)

    def _update(
        self,
        scheduled: list[ScheduledRequest],
        sampling: list[ScheduledRequest],
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
    ) -> list[RequestOutput]:
        for s in scheduled:
            s.request.num_computed_tokens += s.num_tokens
        now = time.monotonic()
        outputs = []
        for s, token, lp in zip(sampling, tokens, logprobs, strict=True):
            r = s.request
            r.output_token_ids.append(token)
            if lp is not None:
                r.output_logprobs.append(lp)
            if r.first_token_time is None:
                r.first_token_time = now
            status = self._stop_status(r, token)
            if status is not None:
                self.scheduler.finish(r, status)
            outputs.append(
                RequestOutput(
                    r.request_id,
                    [token],
                    [lp] if lp is not None else [],
                    r.status.finished,
                    r.status.finish_reason,
                    r.num_prompt_tokens,
                    r.num_output_tokens,
                )
            )
        return outputs

    def _stop_status(self, r: Request, token: int) -> RequestStatus | None:
        if token in r.eos_token_ids or token in r.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if r.num_output_tokens >= r.params.max_tokens or r.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Batch helper: run prompts to completion, outputs in the order of ``prompts``."""
        prompts = list(prompts)
        per = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per, strict=True)]
        results: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]
