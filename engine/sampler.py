"""Turns a step's logits into next tokens, per request, with the vLLM parameter set.

Seeded requests draw from a generator seeded by (seed, position), so the token
at a position depends only on the request's own seed and history, never on what
else shares the batch (and a migrated request continues the same stream).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.request import Request, TokenLogprobs
from engine.sampling_params import SamplingParams

_SEED_STRIDE = 1_000_003


class Sampler:
    """Samples where the logits are (on the GPU on CUDA): only token ids and the requested logprobs come
    back to the host, never a ``[batch, vocab]`` row."""

    def __init__(self, seed: int = 0, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``argmax``: rows of [n, vocab] to each row's first largest index (the model's kernels have a faster
        one than torch's on CPU); ``torch.argmax(x, -1)`` by default."""
        self.seed = seed
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))
        self._unseeded: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        """The unseeded rows' generator on ``device`` (one per device, seeded by the engine's seed)."""
        gen = self._unseeded.get(device)
        if gen is None:
            gen = self._unseeded[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_requests, vocab] float32, one row per request that samples this step.

        Batched over the rows: greedy rows take one argmax together, the others one pass of filtering and
        noise (only penalties and seeded rows' noise run per row), so a step's sampling costs a few tensor ops
        whatever the batch size, not a Python loop over its requests.
        """
        dev = logits.device
        plain = [not r.params.has_penalties and r.params.greedy for r in requests]
        if all(plain):
            tokens = self.argmax(logits)
        else:
            tokens = torch.empty(len(requests), dtype=torch.long, device=dev)
            greedy = torch.tensor(plain, device=dev)
            if greedy.any():
                tokens[greedy] = self.argmax(logits[greedy])
            rest = [i for i, g in enumerate(plain) if not g]
            tokens[rest] = self.sample_rows(take(logits, rest), [requests[i] for i in rest])
        tokens_list = tokens.tolist()
        return tokens_list, batch_logprobs(logits, tokens_list, [r.params.logprobs for r in requests])

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
        p = request.params
        greedy = p.greedy and not p.has_penalties
        targets = self.argmax(rows).tolist() if greedy else None
        tokens: list[int] = []
        for i in range(len(draft) + 1):
            if targets is not None:
                token = targets[i]
            else:
                token = int(self.sample_rows(rows[i : i + 1], [request], [request.num_tokens + i])[0])
            tokens.append(token)
            if i == len(draft) or token != draft[i]:
                break
        return tokens, batch_logprobs(rows[: len(tokens)], tokens, [p.logprobs] * len(tokens))

    def sample_rows(
        self, rows: torch.Tensor, requests: list[Request], positions: list[int] | None = None
    ) -> torch.Tensor:
        """One token per row, by each request's parameters. ``positions[i]``: the number of tokens before the
        one sampled (default: all the request has); it seeds a seeded request's noise."""
        if any(r.params.has_penalties for r in requests):
            rows = rows.clone()
            for row, r in zip(rows, requests, strict=True):
                if r.params.has_penalties:
                    apply_penalties(row, r)
        params = [r.params for r in requests]
        dev = rows.device
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=rows.dtype, device=dev)
        probs = filter_rows(rows / temps[:, None], params)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. It flips only where two candidates
        # nearly tie, so logits that differ in the last bits (a prefix-cached prefill, another batch) sample
        # the same token; an inverse-CDF draw moves with every probability before the token. E = -log(U):
        # uniform_ and log_ are vectorised, exponential_ is not (4x slower). Unseeded rows share one
        # generator; a seeded row's noise depends on its seed and position only, never on the batch.
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):
            noise.uniform_(generator=self._generator(dev))
        elif unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).uniform_(
                generator=self._generator(dev))
        for i, (p, r) in enumerate(zip(params, requests, strict=True)):
            if p.seed is not None:
                at = r.num_tokens if positions is None else positions[i]
                seeded = torch.Generator(device=dev).manual_seed((p.seed * _SEED_STRIDE + at) % 2**64)
                noise[i].uniform_(generator=seeded)
        tokens = self.argmax(probs / noise.log_().neg_())
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        if greedy.any():  # greedy with penalties: the penalised argmax
            tokens[greedy] = self.argmax(rows[greedy])
        return tokens


def apply_penalties(row: torch.Tensor, request: Request) -> torch.Tensor:
    """Repetition penalty over prompt and output (as transformers); presence/frequency over output (as OpenAI)."""
    p = request.params
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(request.all_token_ids())), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        out = torch.tensor(request.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Softmax after top-k, top-p and min-p filtering (in that order, as vLLM), of one row."""
    return filter_rows(row[None], [p])[0]


def filter_rows(rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``filtered_probs`` of every row at once, each by its own parameters; each filter runs only on the rows
    that ask for it (top-k and top-p sort them)."""
    vocab = rows.shape[1]
    top_k = [i for i, p in enumerate(params) if p.top_k != -1 and p.top_k < vocab]
    if top_k:
        ks = torch.tensor([params[i].top_k for i in top_k], device=rows.device)
        sub = take(rows, top_k)
        kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
        if len(top_k) == len(params):
            rows = sub.masked_fill(sub < kth, float("-inf"))
        else:
            rows = rows.clone()
            rows[top_k] = sub.masked_fill(sub < kth, float("-inf"))
    probs = torch.softmax(rows, dim=-1)
    top_p = [i for i, p in enumerate(params) if p.top_p < 1]
    if top_p:
        limit = torch.tensor([params[i].top_p for i in top_p], dtype=probs.dtype, device=probs.device)[:, None]
        if len(top_p) == len(params):
            probs = nucleus(probs, limit)
        else:
            probs[top_p] = nucleus(probs[top_p], limit)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        probs[probs < (min_p * probs.max(dim=-1).values)[:, None]] = 0
    return probs / probs.sum(dim=-1, keepdim=True)


def take(rows: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``rows[index]``, without the copy when ``index`` is every row in order (the common case)."""
    return rows if index == list(range(rows.shape[0])) else rows[index]


TOP_P_CANDIDATES = 256


def nucleus(probs: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Top-p: each row keeps its most probable tokens up to the first whose predecessors' sum reaches
    ``limit`` (the top token always survives). The cut is searched among the TOP_P_CANDIDATES most probable
    tokens (a partial sort, tens of times cheaper than sorting the vocabulary); rows whose candidates do not
    reach the limit, where every token beyond them would be kept too, sort in full."""
    k = min(probs.shape[1], TOP_P_CANDIDATES)
    vals, order = probs.topk(k, dim=-1)
    short = (vals.sum(-1, keepdim=True) < limit)[:, 0]
    if short.any():  # rarely: a flat distribution
        full_vals, full_order = probs[short].sort(dim=-1, descending=True)
        return _keep_nucleus(probs, limit, vals, order, short, full_vals, full_order)
    return _keep_nucleus(probs, limit, vals, order)


def _keep_nucleus(probs, limit, vals, order, short=None, full_vals=None, full_order=None) -> torch.Tensor:
    out = torch.zeros_like(probs)
    before = vals.cumsum(-1) - vals
    out.scatter_(1, order, vals.masked_fill(before >= limit, 0))
    if short is not None:
        before = full_vals.cumsum(-1) - full_vals
        kept = full_vals.masked_fill(before >= limit[short], 0)
        out[short] = torch.zeros_like(full_vals).scatter_(1, full_order, kept)
    return out


def batch_logprobs(rows: torch.Tensor, tokens: list[int], top_ns: list[int | None]) -> list[TokenLogprobs | None]:
    """Each row's logprob of its token, rank and top-n, for the rows that asked (``top_ns[i]`` not None), from
    the raw model distribution, before penalties and filters (vLLM's default). One log-softmax for them all."""
    asked = [i for i, n in enumerate(top_ns) if n is not None]
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    if not asked:
        return out
    sub = take(rows, asked)
    lse = torch.logsumexp(sub, dim=-1, keepdim=True)  # log-softmax is x - lse: no [rows, vocab] result needed
    raw = sub.gather(1, torch.tensor([tokens[i] for i in asked], device=sub.device)[:, None])
    ranks = ((sub > raw).sum(dim=-1) + 1).tolist()
    chosen = (raw - lse)[:, 0].tolist()
    most = max(top_ns[i] for i in asked)
    top_vals, top_ids = sub.topk(most, dim=-1) if most else (sub[:, :0], sub[:, :0].long())
    top_vals = (top_vals - lse).tolist()
    top_ids = top_ids.tolist()
    for j, i in enumerate(asked):
        n = top_ns[i]
        top = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
        out[i] = TokenLogprobs(token_id=tokens[i], logprob=chosen[j], rank=ranks[j], top=top)
    return out
