"""Synthetic workloads for ``tandem bench serve``: what each request sends and how long it runs.

Prompts are random token ids, so their length is exact on the gRPC backend (the gateway takes
``token_ids``) and no natural-language corpus has to be shipped. By default they are drawn from
the tokens that are plain lowercase words (`` ocean``, `` table``): a prompt of random words reads
as text to a model, which then answers in words too. Fully random ids make models emit byte
fragments that servers such as llama-cpp-python hold back until they form valid UTF-8, which
bunches their streamed tokens and would spoil inter-token latencies. Each request also forces its
output length (``ignore_eos`` with ``max_tokens``, or ``min_tokens`` on OpenAI servers), so that
two systems run the same work whatever the model would have said.

Three shapes, as in ``vllm bench serve``:

- ``random``: input and output lengths uniform in ``len * [1 - ratio, 1 + ratio]``.
- ``shared-prefix``: N system prompts x M questions, shuffled: what a prefix cache is for.
- ``conversation``: lengths from a log-normal distribution (median, sigma), clipped: most
  requests are short, a long tail is not, as in chat logs such as ShareGPT.
"""

from __future__ import annotations

import argparse
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

DATASETS = ("random", "shared-prefix", "conversation")
WORD = re.compile(r" [a-z]{3,12}")
# Token ids are drawn away from both ends of the vocabulary, where the special tokens live.
ID_MARGIN = 100


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload: its prompt as token ids (text for HTTP backends) and its forced output length."""

    prompt_ids: list[int]
    output_len: int
    prompt_text: str | None = None  # filled by ``attach_text`` for backends that take text

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """Workload flags, shared by ``bench serve`` and ``bench compare``."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random", choices=DATASETS)
    g.add_argument("--prompt-tokens", default="words", choices=["words", "any"],
                   help="words: prompts of random lowercase word tokens (default); any: any token id")
    g.add_argument("--num-prompts", type=int, default=100, help="measured requests per request rate")
    g.add_argument("--input-len", type=int, default=1024,
                   help="random: prompt tokens; conversation: the median prompt length")
    g.add_argument("--output-len", type=int, default=128,
                   help="random / shared-prefix: output tokens; conversation: the median output length")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in len * [1 - ratio, 1 + ratio]")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per system prompt")
    g.add_argument("--question-len", type=int, default=64, help="shared-prefix: tokens per question")
    g.add_argument("--sigma", type=float, default=1.0, help="conversation: log-normal spread (0: all at the median)")
    g.add_argument("--max-input-len", type=int, default=4096, help="conversation: the tail's cut for prompts")
    g.add_argument("--max-output-len", type=int, default=1024, help="conversation: the tail's cut for outputs")


def check_dataset_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag when a workload cannot be built."""
    positive = ("num_prompts", "input_len", "output_len", "num_prefixes", "prefix_len", "question_len",
                "max_input_len", "max_output_len")
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    if args.sigma < 0:
        raise ValueError("--sigma must be >= 0")


def random_ids(rng: random.Random, n: int, vocab: int | list[int]) -> list[int]:
    """``n`` ids from ``range(ID_MARGIN, vocab - ID_MARGIN)``, or from a pool of ids."""
    if isinstance(vocab, list):
        return [rng.choice(vocab) for _ in range(n)]
    return [rng.randrange(ID_MARGIN, vocab - ID_MARGIN) for _ in range(n)]


def word_ids(tokenizer_path: str) -> list[int]:
    """The ids that decode to a space and one lowercase word of 3 to 12 letters."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    return [i for i in range(tok.get_vocab_size()) if WORD.fullmatch(tok.decode([i]))]


def uniform_len(rng: random.Random, center: int, ratio: float) -> int:
    return max(1, rng.randint(math.floor(center * (1 - ratio)), math.ceil(center * (1 + ratio))))


def lognormal_len(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def random_dataset(args: argparse.Namespace, n: int, vocab: int, rng: random.Random) -> list[BenchRequest]:
    return [BenchRequest(random_ids(rng, uniform_len(rng, args.input_len, args.range_ratio), vocab),
                         uniform_len(rng, args.output_len, args.range_ratio)) for _ in range(n)]


def shared_prefix_dataset(args: argparse.Namespace, n: int, vocab: int, rng: random.Random) -> list[BenchRequest]:
    """``n`` requests spread evenly over ``--num-prefixes`` system prompts, in random order: every
    system prompt is computed once, then (with prefix caching) served from the cache."""
    prefixes = [random_ids(rng, args.prefix_len, vocab) for _ in range(args.num_prefixes)]
    requests = [BenchRequest(prefixes[i % len(prefixes)] + random_ids(rng, args.question_len, vocab), args.output_len)
                for i in range(n)]
    rng.shuffle(requests)
    return requests


def conversation_dataset(args: argparse.Namespace, n: int, vocab: int, rng: random.Random) -> list[BenchRequest]:
    return [BenchRequest(random_ids(rng, lognormal_len(rng, args.input_len, args.sigma, args.max_input_len), vocab),
                         lognormal_len(rng, args.output_len, args.sigma, args.max_output_len)) for _ in range(n)]


BUILDERS: dict[str, Callable[[argparse.Namespace, int, int, random.Random], list[BenchRequest]]] = {
    "random": random_dataset,
    "shared-prefix": shared_prefix_dataset,
    "conversation": conversation_dataset,
}


def build_dataset(args: argparse.Namespace, n: int, vocab: int | list[int], seed: int | str) -> list[BenchRequest]:
    """``n`` requests of ``args.dataset``; the same seed gives the same requests. ``vocab`` is the
    vocabulary size, or the pool of ids to draw prompts from (``word_ids``)."""
    if isinstance(vocab, list) and not vocab:
        raise ValueError("no token of the vocabulary is a plain word: use --prompt-tokens any")
    if isinstance(vocab, int) and vocab <= 2 * ID_MARGIN:
        raise ValueError(f"a vocabulary of {vocab} tokens is too small for random prompts")
    return BUILDERS[args.dataset](args, n, vocab, random.Random(seed))


def attach_text(requests: list[BenchRequest], tokenizer_path: str) -> None:
    """Give each request a text prompt that tokenizes back to about its length, for servers that take
    text (llama-cpp-python's). Random ids do not survive decode + encode unchanged, so the text is
    re-encoded once and cut to the intended length, which makes the round trip stable in practice."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    for req in requests:
        ids = tok.encode(tok.decode(req.prompt_ids), add_special_tokens=False).ids[:req.prompt_len]
        req.prompt_text = tok.decode(ids)
