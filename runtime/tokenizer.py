"""Tokenization and chat templates from the bundle, with `tokenizers` and jinja2 only."""

from __future__ import annotations

import json
import re
import secrets
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
        # A second copy that splits special-token strings as plain text: the content of a
        # message (or a raw prompt, unless asked otherwise) can never write a control token.
        self._text_only = Tokenizer.from_file(str(path))
        self._text_only.encode_special_tokens = True
        self._specials = tuple(sorted({t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special and t.content},
                                      key=len, reverse=True))
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        # Bytes the longest token can stand for (UTF-8 of its vocabulary string over-counts,
        # which only makes the cheap "obviously too long" check more lenient).
        self.max_token_bytes = max((len(k.encode("utf-8", "surrogatepass")) for k in vocab), default=1) or 1
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
            try:
                self._template = env.from_string(info.chat_template)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"the bundle's chat template does not compile: {exc}; fix tokenizer.chat_template "
                                        "in manifest.json or re-export the bundle") from None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of text. parse_special=False tokenizes special-token strings ("<|im_end|>")
        as the plain text they spell. encode_batch releases the GIL, so a long prompt
        tokenized on a worker thread does not stall other threads."""
        tokenizer = self._tokenizer if parse_special else self._text_only
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def contains_special(self, text: str) -> bool:
        return any(s in text for s in self._specials)

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
        """The template writes any BOS itself, so no special tokens are added on top. Special-token
        strings inside message content stay text: each is swapped for a one-off marker before
        rendering, and the markers are tokenized as the text they replaced."""
        if not any(isinstance(m.get("content"), str) and self.contains_special(m["content"]) for m in messages):
            return self.encode(self.render_chat(messages), add_special_tokens=False)
        nonce = secrets.token_hex(8)
        pattern = re.compile("|".join(re.escape(s) for s in self._specials))
        marker = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        escaped = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                content = pattern.sub(lambda hit: f"\ue000{nonce}:{self._specials.index(hit.group(0))}\ue001", content)
            escaped.append({**m, "content": content})
        rendered = self.render_chat(escaped)
        ids, at = [], 0
        for hit in marker.finditer(rendered):
            if hit.start() > at:
                ids += self.encode(rendered[at : hit.start()], add_special_tokens=False)
            ids += self.encode(self._specials[int(hit.group(1))], add_special_tokens=False, parse_special=False)
            at = hit.end()
        if at < len(rendered):
            ids += self.encode(rendered[at:], add_special_tokens=False)
        return ids


class StreamDecoder:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8 sequences.

    Each push decodes only a window: the ids of the last non-empty piece it emitted (context,
    so a leading-space rule or a byte-level merge reads the new ids as decode(all ids) does)
    and those since. The piece is what the window decodes to past that context, so the work
    per push is the window's, not the whole output's.
    """

    def __init__(self, tokenizer: BundleTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._context = 0  # window start: the first id of the last piece emitted
        self._emitted = 0  # ids up to here are in emitted pieces; the rest wait

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        if len(self.ids) == self._emitted:
            return ""
        text = self.tokenizer.decode(self.ids[self._context :])
        if text.endswith("\ufffd"):
            return ""
        known = self.tokenizer.decode(self.ids[self._context : self._emitted]) if self._emitted > self._context else ""
        piece = text[len(known) :]
        if piece:  # ids that decode to nothing (a skipped special token) would strip the next one's leading space
            self._context = self._emitted
        self._emitted = len(self.ids)
        return piece
