"""The request schema: which fields each endpoint takes, and a decoded body turned into a checked
prompt and Options (the API's own checks, with errors in OpenAI's shape)."""

from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from edge_spec.params import SettingError, params, shown
from runtime.api import Model, Options
from runtime.engine import Prompt, PromptTooLongError
from runtime.requests import check_messages
from runtime.server.body import MAX_STOP_CHARS, MAX_STOP_STRINGS
from runtime.server.errors import ApiError, echo, setting_error, type_error, value_error
from runtime.tokenizer import ChatTemplateError

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left

# Accepted for compatibility, but only with the value that means "off" (or null).
_COMMON_INERT = {
    "n": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "best_of": (1,),
}
# speculation (an extension): {"drafter": ..., "max_gamma": N} for this request; absent: the server's.
# The numeric request settings come from their declarations (Options' Params, read by _settings).
_COMMON = {"model", "max_tokens", "stop", "stream", "stream_options", "user", "speculation"} | {
    name for name, p in params(Options).items() if p.server}
# parse_special (an extension, as in llama.cpp's server): special-token strings in a raw prompt are
# control tokens only when the caller asks; by default they are text.
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "logprobs", "parse_special"} | set(_COMMON_INERT)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls"} | (set(_COMMON_INERT) - {"best_of"})


def _integer(body: dict, name: str, default, low: int | None = None, high: int | None = None, high_message: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)
        else:
            raise type_error(name, "an integer", value)
    if low is not None and value < low:
        raise value_error(name, f"{name} must be >= {low}, got {shown(value)}")
    if high is not None and value > high:
        raise value_error(name, high_message or f"{name} must be <= {high}, got {shown(value)}")
    return value


def _settings(body: dict) -> dict:
    """The request settings a body may carry (their Param on Options: type, range, and the
    server's own default, upper bound and spellings of off), read generically: a new setting
    is a field, not a line here."""
    found = {}
    for name, p in params(Options).items():
        if not p.server:
            continue
        value = body.get(name)
        if value is None:
            if p.server_default is not None:
                found[name] = p.server_default
            continue
        if _neutral(value, p.server_off):
            continue  # the field's default is its off
        if p.kind is int:
            value = _integer(body, name, None)  # an integral float such as 2.0 too, as OpenAI takes it
        try:  # the Param's own check: a number too large for a float is out of range, not an OverflowError
            value = p.check(name, value, high=p.server_high if p.server_high is not None else p.high)
        except SettingError as exc:
            raise setting_error(exc) from None
        found[name] = float(value) if p.kind is float else value
    return found


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(name, "a boolean", value)
    return value


def _neutral(value, values) -> bool:
    """value is one of values, of the same type: true is not 1 (as in Python) here."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in values)


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)[:80]}",
                       param=unknown[0][:40], code="unknown_parameter")
    for name, values in _COMMON_INERT.items():
        if name in body and body[name] is not None and not _neutral(body[name], values):
            raise value_error(name, f"{name}={echo(body[name])} is not supported by this server "
                                    f"(leave it out or use {json.dumps(values[0])})")


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
        raise type_error("stop", "a string or a list of strings", value)
    if len(values) > MAX_STOP_STRINGS:
        raise value_error("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(values)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in values):
        raise value_error("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(values)


@dataclass
class Parsed:
    prompt_ids: Prompt  # checked once, in RequestParser._check_prompt_ids
    options: Options
    stream: bool
    include_usage: bool


class RequestParser:
    """Turns a decoded body into a Parsed request for one model served as model_id."""

    def __init__(self, model: Model, model_id: str):
        self.model, self.model_id = model, model_id
        # One tokenizing thread: a huge prompt is tokenized off the event loop (the tokenizer
        # releases the GIL) and several at once queue there instead of taking every core.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="edge-spec-tokenize")

    def _check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is None:
            return  # one model is served: leaving it out means that one
        if not isinstance(name, str):
            raise type_error("model", "a string", name)
        if name != self.model_id:
            raise ApiError(404, f"The model '{name[:100]}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def _options(self, body: dict, prompt_len: int, default_tokens: int, token_names: tuple[str, ...]) -> Options:
        context = self.model.max_context
        max_tokens = None
        for name in token_names:
            max_tokens = _integer(body, name, None, 1, context,
                                  f"{name} is too large: {shown(body.get(name))}. This model's context holds {context} tokens, "
                                  "prompt included")
            if max_tokens is not None:
                break
        if max_tokens is None:
            max_tokens = default_tokens
        if _neutral(body.get("top_p"), (0, 0.0)):  # OpenAI's smallest nucleus: only the most likely token
            body = {**body, "temperature": 0.0, "top_p": None}
        settings = _settings(body)
        try:  # Options is the API's own check (a temperature too small to scale the logits, ...)
            options = Options(max_tokens=max_tokens, stop=_stop(body), speculation=body.get("speculation"), **settings)
            self.model.engine.check_speculation(options.speculation)  # against the drafters this bundle has
            return options
        except SettingError as exc:
            raise setting_error(exc) from None

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = _boolean(body, "stream", False)
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not isinstance(options, dict) or set(options) - {"include_usage"}:
                raise type_error("stream_options", 'an object like {"include_usage": true}', options)
            include_usage = _boolean(options, "include_usage", False)
        return stream, include_usage

    def _check_prompt_ids(self, ids: list[int], param: str) -> Prompt:
        """The prompt check, once per request (submit takes the Prompt as checked), with the
        errors in OpenAI's shape."""
        try:
            return self.model.check_prompt(ids)
        except PromptTooLongError:
            raise ApiError(400, f"This model's maximum context length is {self.model.max_context} tokens, but the "
                                f"prompt has {len(ids)} tokens; shorten the prompt", param=param,
                           code="context_length_exceeded") from None
        except ValueError as exc:
            raise value_error(param, str(exc)) from None

    def _cheap_length_check(self, n_bytes: int, param: str) -> None:
        """Refuse, without tokenizing, text that cannot fit: no token stands for more than
        max_token_bytes bytes, so it needs more tokens than the context holds."""
        bound = self.model.max_context * self.model.engine.tokenizer.max_token_bytes
        if n_bytes > bound:
            raise ApiError(400, f"This model's maximum context length is {self.model.max_context} tokens, and the "
                                f"{param} has {n_bytes} bytes, more than that many tokens can hold; shorten it",
                           param=param, code="context_length_exceeded")

    async def _encode(self, **kwargs) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, lambda: self.model.encode(**kwargs))

    async def completion(self, body: dict) -> Parsed:
        _check_fields(body, COMPLETION_FIELDS)
        self._check_model(body)
        if _boolean(body, "echo", False):
            raise value_error("echo", "echo is not supported by this server")
        if body.get("suffix") not in (None, ""):
            raise value_error("suffix", "suffix is not supported by this server")
        if body.get("logprobs") not in (None, 0, False):
            raise value_error("logprobs", "logprobs are not supported by this server")
        _boolean(body, "stream", False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        parse_special = _boolean(body, "parse_special", False)
        if isinstance(prompt, str):
            self._cheap_length_check(len(prompt.encode("utf-8")), "prompt")
            ids = await self._encode(prompt=prompt, parse_special=parse_special)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            outside = next((t for t in ids if not 0 <= t < self.model.vocab_size), None)
            if outside is not None:  # named here by a short prefix: the engine's message quotes the id whole
                raise value_error("prompt", f"token id {shown(outside)} is outside the vocabulary [0, {self.model.vocab_size})")
        elif prompt is None:
            raise ApiError(400, "prompt is required", param="prompt", code="missing_required_parameter")
        elif isinstance(prompt, list):
            raise value_error("prompt", "this server takes one prompt per request (a string or a list of token ids)")
        else:
            raise type_error("prompt", "a string or a list of token ids", prompt)
        ids = self._check_prompt_ids(ids, "prompt")
        options = self._options(body, len(ids), DEFAULT_COMPLETION_TOKENS, ("max_tokens",))
        stream, include_usage = self._stream_flags(body)
        return Parsed(ids, options, stream, include_usage)

    async def chat(self, body: dict) -> Parsed:
        _check_fields(body, CHAT_FIELDS)
        self._check_model(body)
        if body.get("logprobs") not in (None, False) or not _neutral(body.get("top_logprobs"), (None, 0)):
            raise value_error("logprobs", "logprobs are not supported by this server")
        if body.get("tools") not in (None, []) or body.get("tool_choice") not in (None, "none"):
            raise value_error("tools", "tool calls are not supported by this server")
        if body.get("parallel_tool_calls") is not None:
            _boolean(body, "parallel_tool_calls", False)
        response_format = body.get("response_format")
        if response_format is not None and response_format != {"type": "text"}:
            raise value_error("response_format", 'only {"type": "text"} is supported by this server')
        messages = body.get("messages")
        if messages is None:
            raise ApiError(400, "messages is required", param="messages", code="missing_required_parameter")
        try:
            clean = check_messages(messages)  # the API's own check
        except SettingError as exc:
            raise setting_error(exc) from None
        if not self.model.has_chat_template:
            raise ApiError(400, "this bundle's tokenizer has no chat template; use /v1/completions with a raw prompt",
                           param="messages", code="no_chat_template")
        self._cheap_length_check(sum(len(m["content"].encode("utf-8")) for m in clean), "messages")
        try:
            ids = await self._encode(messages=clean)
        except ChatTemplateError as exc:
            raise value_error("messages", str(exc)) from None
        ids = self._check_prompt_ids(ids, "messages")
        options = self._options(body, len(ids), self.model.max_context - len(ids),
                                ("max_completion_tokens", "max_tokens"))
        stream, include_usage = self._stream_flags(body)
        return Parsed(ids, options, stream, include_usage)
