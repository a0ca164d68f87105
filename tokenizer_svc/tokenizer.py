"""Text <-> token ids for one model folder: tokenizer.json, its chat template, and
incremental detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The messages could not be rendered through the model's chat template."""


class TextTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = Tokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        self._cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.is_file() else self._cfg.get("chat_template")
        )
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def special_token(self, name: str) -> str | None:
        value = self._cfg.get(name)
        return value.get("content") if isinstance(value, dict) else value

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Messages through the model's template, in a sandbox that cannot touch files or run code."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        try:
            return self._env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.special_token("bos_token") or "",
                eos_token=self.special_token("eos_token") or "",
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template already writes any BOS it wants.
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _raise(message: str) -> None:
    raise TemplateError(message)


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Text deltas for a growing token sequence that concatenate to ``decode(all ids)``.

    Decodes a short window (from ``prefix`` to the end) and holds back text that
    ends in U+FFFD, i.e. an unfinished multi-byte character (TGI/vLLM's method).
    """

    tokenizer: TextTokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix: int = 0
    read: int = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], self.skip_special_tokens)
        after = decode(self.ids[self.prefix :], self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever was held back, once the sequence is finished."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], self.skip_special_tokens)
        after = decode(self.ids[self.prefix :], self.skip_special_tokens)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
