"""Text <-> token ids for one model folder: tokenizer.json, its chat template, and
incremental detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.paths import model_folder

# Roles a chat template may be asked to render; anything else is almost surely a typo
# that most templates would render silently as a turn of an unknown speaker.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
# Appended to the final message to find where its text ends in the rendered prompt
# (the same marker and rule transformers uses for ``continue_final_message``).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Special tokens handed to the template by name, as transformers does.
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# What one chat template render may take: a template loops over client-sized messages.
RENDER_BUDGET_S = 5.0
MAX_RENDERED_CHARS = 64 * 2**20
MAX_INT_BITS = 2**16  # integers a template may compute (** and * on ints)
# What a template error may be: jinja2's own, and Python's from filters and operators on bad values.
_TEMPLATE_FAILURES = (TemplateError, TypeError, LookupError, ValueError, AttributeError, ArithmeticError,
                      RecursionError)


class TokenizerInputError(ValueError):
    """A caller's mistake (bad ids, bad messages): the service answers INVALID_ARGUMENT."""


class ChatTemplateError(TokenizerInputError):
    """The messages could not be rendered through the model's chat template."""


class TextTokenizer:
    """The model folder's tokenizer, chat template and end-of-sequence ids, loaded once."""

    def __init__(self, model_dir: str | Path) -> None:
        path = model_folder(model_dir)  # a .gguf model: the tokenizer lies beside it
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = Tokenizer.from_file(str(tok_file))
        self._cfg: dict[str, Any] = _read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.is_file() else self._cfg.get("chat_template")
        )
        self._compiled: tuple[str, Template] | None = None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # The model's embedding rows when it has more (padded, as Qwen2's): it can sample those ids,
        # and they decode to nothing, as in transformers.
        self.num_tokens = max(vocab.values()) + 1  # ids the tokenizer itself knows
        self.vocab_size = max(self.num_tokens, _read_json(path / "config.json").get("vocab_size", 0))
        self.eos_token_ids = self._eos_token_ids(path)
        self.byte_fallback_ids = _byte_fallback_ids(self._tok, vocab)
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._byte_level = self._tok.decoder is not None and b'"ByteLevel"' in self._tok.decoder.__getstate__()

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def special_token(self, name: str) -> str | None:
        value = self._cfg.get(name)
        return value.get("content") if isinstance(value, dict) else value

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One id decoded alone, special tokens kept: how log probabilities name a token."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for: a piece of a UTF-8 character stays the piece (its text is U+FFFD),
        which is what OpenAI's ``bytes`` field is for."""
        piece = self._tok.id_to_token(token_id)
        if piece is None or token_id in self.special_ids:
            return self.token_text(token_id).encode()
        if token_id in self.byte_fallback_ids:
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self.token_text(token_id).encode()

    def check_ids(self, ids: Sequence[int]) -> None:
        """Refuse ids neither the tokenizer nor the model has: the tokenizer would silently drop them."""
        if ids and max(ids) >= self.vocab_size:
            bad = next(i for i in ids if i >= self.vocab_size)
            raise TokenizerInputError(f"token id {bad} is outside the vocabulary (ids are 0..{self.vocab_size - 1})")

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> str:
        """Messages through the model's template, in a sandbox that cannot touch files or run code.

        ``continue_final_message`` leaves the last message open (no end-of-turn, no new turn) so the
        model continues its text; it replaces ``add_generation_prompt``.
        """
        _check_messages(messages)
        if not continue_final_message:
            return self._render(messages, add_generation_prompt)
        last = {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}
        return _cut_at_continue_tag(self._render([*messages[:-1], last], add_generation_prompt=False))

    def encode_chat(self, messages: list[dict[str, str]], continue_final_message: bool = False) -> list[int]:
        # The template already writes any BOS it wants.
        return self.encode(self.render_chat(messages, continue_final_message=continue_final_message), False)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        template = self._template()
        parts, size = [], 0
        try:
            with template.environment.budget(RENDER_BUDGET_S):
                for part in template.generate(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    tools=None,
                    documents=None,
                    **{name: self.special_token(name) or "" for name in _TEMPLATE_TOKENS},
                ):
                    size += len(part)
                    if size > MAX_RENDERED_CHARS:
                        raise SecurityError(f"the rendered prompt is longer than {MAX_RENDERED_CHARS} characters")
                    parts.append(part)
        except _TEMPLATE_FAILURES as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from exc
        return "".join(parts)

    def _template(self) -> Template:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send the prompt as plain text instead")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _sandbox().from_string(self.chat_template))
        return self._compiled[1]

    def _eos_token_ids(self, path: Path) -> tuple[int, ...]:
        """generation_config.json first (what generate() stops on), then config.json, then the tokenizer's EOS."""
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            ids += value if isinstance(value, list) else [] if value is None else [value]
        eos = self.special_token("eos_token")
        eos_id = self._tok.token_to_id(eos) if eos else None
        ids += [] if eos_id is None else [eos_id]
        return tuple(dict.fromkeys(int(i) for i in ids))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_fallback_ids(tok: Tokenizer, vocab: dict[str, int]) -> frozenset[int]:
    """Ids of ``<0xNN>`` tokens when the decoder merges runs of them into bytes (SentencePiece byte fallback)."""
    if tok.decoder is None or b'"ByteFallback"' not in tok.decoder.__getstate__():
        return frozenset()
    return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))


def _check_messages(messages: list[dict[str, str]]) -> None:
    if not messages:
        raise ChatTemplateError("the chat has no messages; send at least one")
    for i, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            raise ChatTemplateError(f"message {i} has role {message.get('role')!r}; use one of {', '.join(CHAT_ROLES)}")


def _cut_at_continue_tag(rendered: str) -> str:
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ChatTemplateError("the chat template drops the final message's text, so it cannot be continued")
    # A template that trims trailing spaces trimmed the tag's too: trim the message alike.
    return rendered[:at] if rendered.startswith(_CONTINUE_TAG, at) else rendered[:at].rstrip()


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which templates written for transformers do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks: render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox (no file access: no loader; no code: no unsafe attributes or mutation), made
    stricter: an unsafe attribute fails at once (jinja2 hands back an Undefined that renders as ""), ``**``
    and ``*`` cannot build huge numbers or strings, and a render has a time budget, checked at every call,
    attribute, item and operator."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._render_state = threading.local()  # renders run on several threads at once

    @contextmanager
    def budget(self, seconds: float) -> Iterator[None]:
        self._render_state.deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self._render_state.deadline = None

    def _tick(self) -> None:
        deadline = getattr(self._render_state, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise SecurityError(f"rendering took longer than {RENDER_BUDGET_S:g} s")

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self._tick()
        if isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length() * max(right, 0) if operator == "**" else left.bit_length() + right.bit_length()
            if bits > MAX_INT_BITS:
                raise SecurityError(f"integers in a chat template are limited to {MAX_INT_BITS} bits")
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > MAX_RENDERED_CHARS:
                raise SecurityError(f"a repeated sequence is limited to {MAX_RENDERED_CHARS} items")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self._tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self._tick()
        return super().call(__context, __obj, *args, **kwargs)


def _sandbox() -> _Sandbox:
    """The environment transformers renders templates in, so Hub templates behave the same here."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# A character spans at most 4 bytes, so an unfinished one sits in the last few tokens:
# that many shorter windows are tried before holding text back.
_MAX_HELD_TOKENS = 4


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Text deltas for a growing token sequence that concatenate to ``decode(all ids)``.

    Decodes a short window (from ``prefix`` to the end): starting it one emitted chunk back
    makes SentencePiece drop a leading space exactly where the whole-sequence decode does.
    Text is emitted up to the last token boundary whose text does not end in U+FFFD (an
    unfinished multi-byte character) nor in a run of byte-fallback tokens (their bytes are
    decoded as one group); the rest is held back until later tokens or ``flush``.
    """

    tokenizer: TextTokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix: int = 0  # window start
    read: int = 0  # ids[:read] are emitted

    def push(self, new_ids: Iterable[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.prefix, self.read)
        for end in range(len(self.ids), max(self.read, len(self.ids) - _MAX_HELD_TOKENS), -1):
            if self._in_byte_run(end):
                continue
            text = self._decode(self.prefix, end)
            if len(text) > len(before) and not text.endswith("\ufffd"):
                return self._advance(end, text[len(before) :])
        return ""

    def flush(self) -> str:
        """Whatever was held back, once the sequence is finished."""
        before = self._decode(self.prefix, self.read)
        delta = self._decode(self.prefix, len(self.ids))[len(before) :]
        return self._advance(len(self.ids), delta) if delta else ""

    def _in_byte_run(self, end: int) -> bool:
        """Whether ids[:end] ends in byte-fallback tokens (tokens that decode to nothing aside),
        which the decoder would join with the bytes of later ones into one group."""
        if not self.tokenizer.byte_fallback_ids:
            return False
        skipped = self.tokenizer.special_ids if self.skip_special_tokens else frozenset()
        for i in range(end - 1, self.read - 1, -1):
            if self.ids[i] not in skipped and self.ids[i] < self.tokenizer.num_tokens:
                return self.ids[i] in self.tokenizer.byte_fallback_ids
        return False

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)

    def _advance(self, end: int, delta: str) -> str:
        self.prefix, self.read = self.read, end
        return delta
