"""A request's output constraint, as the engine and the wire carry it, and its llguidance grammar.

Nothing here loads torch or a tokenizer: the gateway checks a constraint with ``check_structured``
before any worker is busy, and a worker compiles the same text against its tokenizer
(``engine.structured.compiler``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar (all choices together): larger is refused
MAX_CHOICES = 1024
# Compact JSON (``{"a":1}``), as json.dumps(separators=(",", ":")): no freedom for a sampled model to
# wander through whitespace. A schema can ask for other separators through its own "x-guidance" object.
JSON_DEFAULTS = {"whitespace_flexible": False}
MAX_MESSAGE_CHARS = 240  # llguidance's messages can quote the whole grammar: a rejection stays readable
ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One constraint: ``kind`` is one of ``KINDS``; ``value`` is the schema's JSON text, the regex or the
    grammar (Lark, or GBNF as llama.cpp writes it), empty for ``json_object``; ``choices`` for ``choice``.

    Raises ValueError on a malformed value (a schema that is not a JSON object, no choices, too large);
    whether it compiles is ``check_structured``'s question.
    """

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r:.40}")
        object.__setattr__(self, "choices", tuple(self.choices))
        size = len(self.value.encode()) + sum(len(c.encode()) for c in self.choices)
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"structured output {self.kind} is {size} bytes; at most {MAX_SPEC_BYTES}")
        if self.kind == "choice":
            self._check_choices()
        elif self.kind == "json_schema":
            self._check_schema()
        elif self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"structured output {self.kind} is empty")

    def _check_choices(self) -> None:
        if not self.choices:
            raise ValueError("structured output choice needs at least one string")
        if len(self.choices) > MAX_CHOICES:
            raise ValueError(f"structured output choice takes at most {MAX_CHOICES} strings")
        if not all(isinstance(c, str) and c for c in self.choices):
            raise ValueError("structured output choices must be non-empty strings")

    def _check_schema(self) -> None:
        try:
            schema = json.loads(self.value)
        except ValueError as exc:
            raise ValueError(f"structured output json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("structured output json_schema must be a JSON object (a JSON Schema)")

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What a compiled grammar is cached under (with the tokenizer, which is the compiler's own)."""
        return (self.kind, self.value, self.choices)

    def grammar(self) -> str:
        """The llguidance grammar for this constraint (its top-level JSON form); ValueError if a GBNF grammar
        does not parse (everything else is checked when a matcher is built from it)."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_DEFAULTS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA, defaults=JSON_DEFAULTS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            # Lark string literals take JSON's escapes, so json.dumps quotes any string safely.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choices))
        return grammar_from("grammar", self.value)  # Lark, or GBNF converted to Lark (ValueError if neither)


def check_structured(spec: StructuredOutput) -> None:
    """Raise ValueError naming the problem if ``spec`` does not compile (no tokenizer needed)."""
    error = _grammar_error(spec)
    if error:
        raise ValueError(compile_error(spec, error))


def compile_error(spec: StructuredOutput, error: str) -> str:
    """The message for a constraint that does not compile: llguidance's reason, cut to a readable length."""
    error = error.strip()
    if len(error) > MAX_MESSAGE_CHARS:
        error = error[:MAX_MESSAGE_CHARS] + "..."
    return f"structured output {spec.kind} does not compile: {error}"


@lru_cache(maxsize=256)
def _grammar_error(spec: StructuredOutput) -> str:
    """llguidance's message for a grammar that does not build, or ""; cached: clients resend the same
    schemas, and a check is a parse of the whole grammar."""
    from llguidance import LLMatcher

    try:
        grammar = spec.grammar()
    except ValueError as exc:
        return str(exc)
    message = LLMatcher.validate_grammar(grammar)
    return "" if message.startswith("WARNING") else message
