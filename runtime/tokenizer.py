"""Tokenization and chat templates from the bundle, with `tokenizers` and jinja2 only."""

from __future__ import annotations

import re
import secrets
import weakref

from tokenizers import Tokenizer

from edge_spec.manifest import BundleError, TokenizerInfo
from runtime.render_worker import RenderCompileError, RenderFailed, RenderLimit, RenderWorker


class ChatTemplateError(ValueError):
    pass


class TemplateLimitError(ChatTemplateError):
    """A chat template that went past a rendering limit (time, memory, size): the bundle's fault."""


# A bundle's chat template is code from whoever made the bundle (hashed only through a pinned --bundle-sha256).
# It renders in its own process (runtime/render_worker.py), so these bound it whatever it does.
RENDER_SECONDS = 5.0  # real templates render in milliseconds; past this the render process is killed
RENDER_BASE_CHARS = 1 << 20  # what a template may add around the messages' own text
RENDER_MEMORY_BYTES = 512 << 20  # address space a render may take, plus 16 bytes per character of its output limit
RENDER_BYTES_PER_CHAR = 16  # a few copies of the output at up to 4 bytes a character


class BundleTokenizer:
    def __init__(self, path, info: TokenizerInfo):
        self.info = info
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for any bad file
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise BundleError(f"{path} is not a tokenizer the tokenizers library can read ({reason}); "
                              "re-export the bundle") from None
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
        self._renderer = None
        if info.chat_template:
            self._renderer = RenderWorker(info.chat_template, info.special_tokens)
            weakref.finalize(self, self._renderer.close)  # the render process ends with its tokenizer
            try:  # a template over its limits for one short message would be so for every request
                self._render([{"role": "user", "content": "Hello"}], True)
            except RenderCompileError as exc:
                raise ChatTemplateError(str(exc)) from None
            except RenderLimit as exc:
                raise TemplateLimitError(f"{exc} for a one-message chat; fix tokenizer.chat_template in manifest.json "
                                         "or re-export the bundle") from None
            except RenderFailed:
                pass  # the template's own refusal (raise_exception) of this probe says nothing about the bundle

    @property
    def has_chat_template(self) -> bool:
        return self._renderer is not None

    def stop_renders(self) -> None:
        """Kill a chat render in flight (it fails with ChatTemplateError); the next render starts afresh."""
        if self._renderer is not None:
            self._renderer.stop()

    def close(self) -> None:
        """End the render process; later chat renders fail."""
        if self._renderer is not None:
            self._renderer.close()

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

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        chars = RENDER_BASE_CHARS + 2 * text_chars  # a template may show the messages twice
        return self._renderer.render(messages, add_generation_prompt, seconds=RENDER_SECONDS, chars=chars,
                                     memory=RENDER_MEMORY_BYTES + RENDER_BYTES_PER_CHAR * chars)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._renderer is None:
            raise ChatTemplateError("this bundle's tokenizer has no chat template; pass a raw prompt instead")
        try:
            return self._render(messages, add_generation_prompt)
        except RenderLimit as exc:
            raise TemplateLimitError(str(exc)) from None
        except RenderFailed as exc:
            raise ChatTemplateError(str(exc)) from None

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
