"""Turns a step's logits into next tokens, per request, with the vLLM parameter set.

Seeded requests draw from a generator seeded by (seed, position), so the token
at a position depends only on the request's own seed and history, never on what
else shares the batch (and a migrated request continues the same stream).
"""

from __future__ import annotations

import torch

from engine.request import Request, TokenLogprobs
from engine.sampling_params import SamplingParams

_SEED_STRIDE = 1_000_003


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._unseeded = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_requests, vocab] float32, one row per request that samples this step."""
        logits = logits.cpu()
        if all(r.params.greedy and not r.params.has_penalties for r in requests):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = [self._sample_one(row, r) for row, r in zip(logits, requests, strict=True)]
        logprobs = [
            _logprobs(row, tok, r.params.logprobs) if r.params.logprobs is not None else None
            for row, tok, r in zip(logits, tokens, requests, strict=True)
        ]
        return tokens, logprobs

    def verify(
        self, rows: torch.Tensor, request: Request, draft: list[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens a speculative step emits: the target's own token at each drafted position, for as long
        as it agrees with the draft, then the first that does not (or one past the last draft).

        ``rows[i]`` is the target's distribution after the draft's first ``i`` tokens. Each position samples
        exactly as a step without speculation would (same seeded noise), so the output is the one it would
        have given, token for token. For a draft that proposes single tokens (both proposers draft
        greedily, as vLLM's do), this is the standard rejection rule: the draft token is accepted with the
        target's probability of it, and a rejection samples from the target without it.
        """
        rows = rows.cpu()
        p = request.params
        greedy = p.greedy and not p.has_penalties
        targets = rows.argmax(dim=-1).tolist() if greedy else None
        tokens: list[int] = []
        for i in range(len(draft) + 1):
            token = targets[i] if targets is not None else self._sample_one(rows[i], request, request.num_tokens + i)
            tokens.append(token)
            if i == len(draft) or token != draft[i]:
                break
        logprobs = [_logprobs(rows[i], t, p.logprobs) if p.logprobs is not None else None
                    for i, t in enumerate(tokens)]
        return tokens, logprobs

    def _sample_one(self, row: torch.Tensor, request: Request, position: int | None = None) -> int:
        """``position``: the number of tokens before the one sampled (default: all the request has)."""
        p = request.params
        if p.has_penalties:
            row = apply_penalties(row.clone(), request)
        if p.greedy:
            return int(row.argmax())
        probs = filtered_probs(row / p.temperature, p)
        gen = self._unseeded
        if p.seed is not None:
            at = request.num_tokens if position is None else position
            gen = torch.Generator().manual_seed((p.seed * _SEED_STRIDE + at) % 2**64)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int((probs / noise).argmax())


def apply_penalties(row: torch.Tensor, request: Request) -> torch.Tensor:
    """Repetition penalty over prompt and output (as transformers); presence/frequency over output (as OpenAI)."""
    p = request.params
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(request.all_token_ids())), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        out = torch.tensor(request.output_token_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Softmax after top-k, top-p and min-p filtering (in that order, as vLLM)."""
    if p.top_k != -1 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        drop = order[before >= p.top_p]  # the top token always survives (before == 0)
        probs[drop] = 0
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0
    return probs / probs.sum()


def _logprobs(row: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    """From the raw model distribution, before penalties and filters (vLLM's default)."""
    lp = torch.log_softmax(row, dim=-1)
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    top: list[tuple[int, float]] = []
    if top_n:
        vals, ids = lp.topk(top_n)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprobs(token_id=token, logprob=chosen, rank=rank, top=top)
