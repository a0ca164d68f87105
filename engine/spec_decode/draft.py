"""Draft-model proposals: a smaller model of the same tokenizer guesses the next tokens, greedily.

The draft runs on the engine's own code (``ModelRunner``) with a paged cache of its own. Each request has
a mirror sequence there that holds the KV of the tokens the draft has seen: at each step it catches up on
the tokens accepted since (one pass over all requests, as spans), then drafts one token per pass. Guesses
the target rejected are dropped from the mirror by moving its computed count back; their slots are
overwritten by the next catch-up.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput


@dataclasses.dataclass(slots=True)
class _Mirror:
    """The draft's copy of one request: ``seq`` holds its tokens (and draft tokens fed to the draft model)."""

    seq: Request
    base: int = 0  # the request's tokens when the last draft was made (all computed here, but the last)


class DraftProposer:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        draft_config = EngineConfig(
            model=config.speculative_model, dtype=config.dtype, device=config.device,
            load_format=config.load_format, block_size=config.block_size, num_kv_blocks=num_blocks,
            max_model_len=None, attention_backend=config.attention_backend, cpu_kernels=config.cpu_kernels,
            kernel_cache_dir=config.kernel_cache_dir, seed=config.seed + 1,
        )
        target_vocab, draft_vocab = config.model_config.vocab_size, draft_config.model_config.vocab_size
        if draft_vocab > target_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) is larger than the target's "
                             f"({target_vocab}): it must be a model of the same tokenizer")
        self.max_len = min(config.max_model_len, draft_config.max_model_len)
        self.runner = ModelRunner(draft_config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self._mirrors: dict[str, _Mirror] = {}

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        mirrors = [self._sync(r) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, (m, k) in enumerate(zip(mirrors, num_tokens, strict=True))
                  if m is not None and k > 0 and requests[i].num_tokens + k <= self.max_len]
        step = 0
        while active:
            picks = self._forward([mirrors[i].seq for i in active])
            for i, token in zip(active, picks, strict=True):
                drafts[i].append(token)
            step += 1
            active = [i for i in active if step < num_tokens[i] and self._feed(mirrors[i], drafts[i][-1])]
        return drafts

    def release(self, request: Request) -> None:
        mirror = self._mirrors.pop(request.request_id, None)
        if mirror is not None:
            self.kv.free(mirror.seq)

    def _sync(self, r: Request) -> _Mirror | None:
        """The request's mirror, caught up with its tokens (the last one still to compute); None if the draft
        cache has no room for it."""
        mirror = self._mirrors.get(r.request_id)
        if mirror is None:
            seq = Request(r.request_id, r.prompt_token_ids, SamplingParams())
            mirror = self._mirrors[r.request_id] = _Mirror(seq)
        seq = mirror.seq
        fed = seq.token_ids(mirror.base, seq.num_tokens)  # drafts fed since the last sync, whatever came of them
        valid = mirror.base + _common_prefix(fed, r.token_ids(mirror.base, r.num_tokens))
        seq.num_computed_tokens = min(seq.num_computed_tokens, valid, r.num_tokens - 1)
        keep = max(0, mirror.base - len(r.prompt_token_ids))  # outputs both have: replace only what follows
        del seq.output_token_ids[keep:]
        seq.output_token_ids.extend(r.output_token_ids[keep:])
        mirror.base = r.num_tokens
        if not seq.block_ids:
            if not self.kv.admit(seq, r.num_tokens, 0):
                self.release(r)
                return None
        elif not self.kv.allocate_slots(seq, r.num_tokens - seq.num_computed_tokens):
            self.release(r)
            return None
        return mirror

    def _feed(self, mirror: _Mirror, token: int) -> bool:
        """Append a drafted token to the mirror, to be computed by the next pass; False if there is no room."""
        seq = mirror.seq
        seq.output_token_ids.append(token)
        return self.kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)

    def _forward(self, seqs: list[Request]) -> list[int]:
        """One pass over every sequence's uncomputed tokens; each one's greedy next token."""
        sched = SchedulerOutput()
        for seq in seqs:
            sched.add(seq, seq.num_tokens - seq.num_computed_tokens)
        logits = self.runner.execute(sched)
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_tokens
        return logits.argmax(dim=-1).tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

