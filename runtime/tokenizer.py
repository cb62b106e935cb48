"""Tokenization and chat templates from the bundle, with `tokenizers` and jinja2 only."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from edge_spec.manifest import TokenizerInfo


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


class BundleTokenizer:
    def __init__(self, path, info: TokenizerInfo):
        self.info = info
        self._tokenizer = Tokenizer.from_file(str(path))
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self._template = None
        if info.chat_template:
            # The same rendering rules Hugging Face applies to chat templates: a sandbox,
            # trimmed blocks, loop controls, and raise_exception / strftime_now helpers.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            # Templates serialize tool calls with tojson: keep key order and raw characters,
            # as Hugging Face does, not jinja2's HTML-safe, key-sorted default.
            env.filters["tojson"] = lambda value, indent=None, separators=None, sort_keys=False: json.dumps(
                value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
            )
            self._template = env.from_string(info.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ChatTemplateError("this bundle's tokenizer has no chat template; pass a raw prompt instead")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.info.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes any BOS itself, so no special tokens are added on top.
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class StreamDecoder:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: BundleTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.emitted = text[len(self.emitted) :], text
        return piece
