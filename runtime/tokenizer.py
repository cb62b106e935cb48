"""Tokenization and chat templates from the bundle, with `tokenizers` and jinja2 only."""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import threading
import time
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from tokenizers import Tokenizer

from edge_spec.manifest import BundleError, TokenizerInfo


class ChatTemplateError(ValueError):
    pass


class TemplateLimitError(ChatTemplateError):
    """A chat template that went past a rendering limit (size, time): the bundle's fault."""


def _raise(message: str):
    raise ChatTemplateError(message)


# A bundle's chat template is code from whoever made the bundle (hashed only through a pinned --bundle-sha256).
# The sandbox stops attribute tricks; these stop it from exhausting memory or time on each request.
RENDER_SECONDS = 5.0  # real templates render in milliseconds
RENDER_BASE_CHARS = 1 << 20  # what a template may add around the messages' own text
MAX_POWER_BITS = 1 << 16  # an integer ** result larger than this is refused before it is computed


class _Budget(threading.local):
    deadline = math.inf
    chars = RENDER_BASE_CHARS


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox plus per-render limits: no string or list over the render's character budget
    from `*`, `%` or an integer argument of a call or filter, no huge `**`, and a deadline checked
    at every such operation, range() and piece of output."""

    intercepted_binops = frozenset(("*", "**", "%"))

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.budget = _Budget()
        self.globals["range"] = self._range
        self.filters = {name: self._bounded_filter(f) for name, f in self.filters.items()}

    def check_time(self) -> None:
        if time.monotonic() > self.budget.deadline:
            raise TemplateLimitError(f"the bundle's chat template took longer than {RENDER_SECONDS:g} s to render")

    def check_size(self, n: int, what: str) -> None:
        if n > self.budget.chars:
            raise TemplateLimitError(f"the bundle's chat template asked for {what} of {n} items, over its limit of "
                                     f"{self.budget.chars} characters")

    def check_arguments(self, args, kwargs) -> None:
        self.check_time()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.budget.chars:
                self.check_size(abs(value), "a width or count")

    def _range(self, *args):
        self.check_arguments(args, {})
        return safe_range(*args)

    def _bounded_filter(self, f):
        skip = 2 if getattr(f, "jinja_pass_arg", None) else 1  # the context/environment, then the value filtered

        @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
        def bounded(*args, **kwargs):
            self.check_arguments(args[skip:], kwargs)
            return f(*args, **kwargs)

        return bounded

    def call_binop(self, context, operator, left, right):
        self.check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                    self.check_size(len(seq) * n, "a repeated string or list")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if abs(left).bit_length() * right > MAX_POWER_BITS:
                    raise TemplateLimitError(f"the bundle's chat template computes a power with over {MAX_POWER_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            self.check_arguments(right if isinstance(right, tuple) else (right,), {})
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        __self.check_arguments(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


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
        self._template = None
        if info.chat_template:
            # The same rendering rules Hugging Face applies to chat templates: a sandbox,
            # trimmed blocks, loop controls, and raise_exception / strftime_now helpers.
            env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            # Templates serialize tool calls with tojson: keep key order and raw characters,
            # as Hugging Face does, not jinja2's HTML-safe, key-sorted default.
            env.filters["tojson"] = lambda value, indent=None, separators=None, sort_keys=False: json.dumps(
                value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
            )
            env.filters["tojson"] = env._bounded_filter(env.filters["tojson"])
            self._env = env
            try:
                self._template = env.from_string(info.chat_template)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"the bundle's chat template does not compile: {exc}; fix tokenizer.chat_template "
                                        "in manifest.json or re-export the bundle") from None
            try:  # a template over its limits for one short message would be so for every request
                self.render_chat([{"role": "user", "content": "Hello"}])
            except TemplateLimitError as exc:
                raise TemplateLimitError(f"{exc} for a one-message chat; fix tokenizer.chat_template in manifest.json "
                                         "or re-export the bundle") from None
            except ChatTemplateError:
                pass  # the template's own refusal (raise_exception) of this probe says nothing about the bundle

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
        budget = self._env.budget
        text_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        budget.chars = RENDER_BASE_CHARS + 2 * text_chars  # a template may show the messages twice
        budget.deadline = time.monotonic() + RENDER_SECONDS
        pieces, size = [], 0
        try:
            for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **self.info.special_tokens):
                size += len(piece)
                self._env.check_size(size, "output")
                self._env.check_time()
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, ArithmeticError, LookupError, MemoryError, RecursionError, TypeError, ValueError,
                AttributeError) as exc:
            # One line, whatever the template did (MemoryError, OverflowError from range(), a type error).
            reason = (str(exc).splitlines() or [""])[0][:200]
            raise ChatTemplateError(f"the bundle's chat template failed: {type(exc).__name__}: {reason}") from None
        finally:
            budget.deadline = math.inf
        return "".join(pieces)

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
