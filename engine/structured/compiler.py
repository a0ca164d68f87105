"""Builds a request's grammar matcher against the model's tokenizer, off the step loop, and caches it.

A compiled grammar is an llguidance matcher in its start state; each request gets a copy of it
(``GrammarState``), which costs microseconds where building can take up to a second for large schemas.
Builds run on a small pool of their own, so the engine thread never waits for one
(``AsyncEngine.generate`` awaits it before handing the request over).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from engine.structured.spec import StructuredOutput, compile_error

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_S = 10.0


class GrammarState:
    """One request's position in its grammar: the matcher has consumed exactly the request's outputs."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False (and the matcher in its error state) if it breaks the grammar."""
        return bool(self.matcher.consume_token(token))

    def accept_all(self, tokens: Sequence[int]) -> bool:
        return not tokens or bool(self.matcher.consume_tokens(list(tokens)))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows no further token."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        """Why no token can follow (a dead end, the matcher's limits), or None."""
        return self.matcher.get_error() if self.matcher.is_error() else None

    def fill_mask(self, address: int, num_bytes: int) -> None:
        """The allowed next tokens as a bitmask (bit ``t % 32`` of int32 word ``t // 32``) at ``address``."""
        self.matcher.unsafe_compute_mask_ptr(address, num_bytes)


class CompiledGrammar:
    """A constraint built against one tokenizer: a matcher at the start, copied for each request."""

    __slots__ = ("_template",)

    def __init__(self, template: Any) -> None:
        self._template = template

    def new_state(self) -> GrammarState:
        return GrammarState(self._template.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; thread-safe.

    The tokenizer (the model folder's ``tokenizer.json``) is read on the first compile, not at engine
    start: most deployments never constrain, and building llguidance's token trie takes a fraction of
    a second. ``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's.
    ``limits`` override llguidance's parser limits (``LLParserLimits``: lexer states, items per step, fuel),
    which bound the work of one mask; a request that reaches one ends with ``grammar_error``.
    """

    def __init__(
        self,
        tokenizer_file: Path | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        threads: int = 1,
        limits: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self.limits = dict(limits or {})
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self.compiles = 0  # grammars built (cache misses)
        self.cache_hits = 0

    def cached(self, spec: StructuredOutput) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
                self.cache_hits += 1
            return compiled

    def submit(self, spec: StructuredOutput) -> Future[CompiledGrammar]:
        """The compiled grammar, from the cache (already done) or built on the compiler's pool; the future
        raises ValueError if the constraint does not compile."""
        compiled = self.cached(spec)
        if compiled is not None:
            done: Future[CompiledGrammar] = Future()
            done.set_result(compiled)
            return done
        return self._pool.submit(self._build, spec)

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """Blocking ``submit``: for callers without an event loop (``Engine.add_request`` alone, benchmarks)."""
        try:
            return self.submit(spec).result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise ValueError(self.timeout_message(spec)) from None

    def timeout_message(self, spec: StructuredOutput) -> str:
        return f"structured output {spec.kind} did not compile within {self.compile_timeout_s:g} s"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _build(self, spec: StructuredOutput) -> CompiledGrammar:
        from llguidance import LLMatcher, LLParserLimits

        try:
            grammar = spec.grammar()
        except ValueError as exc:
            raise ValueError(compile_error(spec, str(exc))) from None
        limits = LLParserLimits(**self.limits) if self.limits else None
        matcher = LLMatcher(self._tokenizer_or_load(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(compile_error(spec, matcher.get_error()))
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self.compiles += 1
            self._cache[spec.key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _tokenizer_or_load(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def _load_tokenizer(self) -> Any:
        from llguidance import LLTokenizer
        from tokenizers import Tokenizer

        if self.tokenizer_file is None or not self.tokenizer_file.is_file():
            raise ValueError("structured outputs need the model's tokenizer.json, and this model has none")
        text = Tokenizer.from_file(str(self.tokenizer_file)).to_str()
        eos = self.eos_token_ids or None
        return LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
