"""Bench prompts: FILE.jsonl (one object a line: id, category, and prompt, messages or turns),
humaneval[:N] or humaneval:A-B from $EDGE_SPEC_MODELS, or stdlib-edit:N or stdlib-edit:A-B (functions of this
Python's standard library to annotate), several separated by commas."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from edge_spec.catalog import models_dir

HUMANEVAL_FILE = "HumanEval.jsonl.gz"
HUMANEVAL_DEFAULT_COUNT = 20


class PromptsError(ValueError):
    """A prompts spec or file that cannot be benchmarked, with where and why."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str | None = None
    messages: tuple | None = None
    # A conversation: user turns, each answered before the next is asked (the bench answers
    # with plain decoding's reply, so every mode sees the same history).
    turns: tuple[str, ...] | None = None


def _humaneval(spec: str) -> list[BenchPrompt]:
    first, count = 0, HUMANEVAL_DEFAULT_COUNT
    if spec != "humaneval":
        text = spec.split(":", 1)[1] if spec.startswith("humaneval:") else ""
        span = _range(text)
        if span is None:
            raise PromptsError(f"bad prompts spec {spec!r}: use humaneval, humaneval:N (the first N problems, N a positive integer) "
                               "or humaneval:A-B (problems A to B-1, from 0)")
        first, count = span
    path = models_dir() / HUMANEVAL_FILE
    if not path.is_file():
        raise PromptsError(f"{path} not found: put {HUMANEVAL_FILE} in $EDGE_SPEC_MODELS, or pass a prompts file")
    prompts = []
    with gzip.open(path, "rt") as f:
        for number, line in enumerate(f):
            if number < first:
                continue
            item = json.loads(line)
            content = f"Complete this Python function. Reply with the full function only.\n\n```python\n{item['prompt']}```"
            prompts.append(BenchPrompt(item["task_id"], "code", messages=({"role": "user", "content": content},)))
            if len(prompts) == count:
                break
    if len(prompts) < count:
        raise PromptsError(f"{spec}: {path} holds only {first + len(prompts)} problems")
    return prompts


def _range(text: str) -> tuple[int, int] | None:
    """N (the first N) or A-B (A to B-1, from 0) as (first, count); None when malformed."""
    low, dash, high = text.partition("-")
    if dash and low.isdigit() and high.isdigit() and int(low) < int(high):
        return int(low), int(high) - int(low)
    if not dash and text.isdigit() and int(text) >= 1:
        return 0, int(text)
    return None


def _stdlib_edits(spec: str) -> list[BenchPrompt]:
    from benchmarks.bench.stdlib_edits import stdlib_edit_prompts

    span = _range(spec.split(":", 1)[1] if ":" in spec else "")
    if span is None:
        raise PromptsError(f"bad prompts spec {spec!r}: use stdlib-edit:N (the first N functions, N a positive integer) "
                           "or stdlib-edit:A-B (functions A to B-1, from 0)")
    first, count = span
    items = stdlib_edit_prompts(first + count)[first:]
    if len(items) < count:
        raise PromptsError(f"{spec}: this Python's standard library has only {first + len(items)} functions that qualify")
    return [BenchPrompt(item["id"], item["category"], messages=tuple(item["messages"])) for item in items]


def _check_messages(messages, where: str) -> tuple:
    if not isinstance(messages, list) or not messages:
        raise PromptsError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise PromptsError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return tuple(messages)


def _prompt_from_line(line: str, where: str) -> BenchPrompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptsError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise PromptsError(f"{where}: expected a JSON object with id, category and prompt or messages, got {type(item).__name__}")
    for key in ("id", "category"):
        if key not in item:
            raise PromptsError(f"{where}: missing field {key!r} (each line needs id, category, and prompt or messages)")
    if not isinstance(item["id"], (str, int)) or isinstance(item["id"], bool) or str(item["id"]) == "":
        raise PromptsError(f"{where}: 'id' must be a non-empty string or an integer")
    if not isinstance(item["category"], str) or not item["category"]:
        raise PromptsError(f"{where}: 'category' must be a non-empty string")
    given = [key for key in ("prompt", "messages", "turns") if key in item]
    if len(given) != 1:
        raise PromptsError(f"{where}: give exactly one of 'prompt' (raw text), 'messages' (chat) or 'turns' (a conversation), "
                           f"not {'none' if not given else 'both' if len(given) == 2 else 'all three'}")
    has_prompt = given == ["prompt"]
    if given == ["turns"]:
        turns = item["turns"]
        if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, str) and t for t in turns):
            raise PromptsError(f"{where}: 'turns' must be a list of at least two non-empty strings (the user's messages)")
        return BenchPrompt(str(item["id"]), item["category"], turns=tuple(turns))
    if has_prompt:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise PromptsError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(str(item["id"]), item["category"], prompt=item["prompt"])
    return BenchPrompt(str(item["id"]), item["category"], messages=_check_messages(item["messages"], where))


def _prompts_file(spec: str) -> list[BenchPrompt]:
    path = Path(spec)
    if not path.is_file():
        raise PromptsError(f"prompts file {path} not found (pass FILE.jsonl, humaneval[:N], humaneval:A-B, stdlib-edit:N or stdlib-edit:A-B)")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            prompts.append(_prompt_from_line(line, f"{path} line {number}"))
    if not prompts:
        raise PromptsError(f"prompts file {path} has no prompts (one JSON object per line)")
    return prompts


def load_prompts(spec: str) -> list[BenchPrompt]:
    """FILE.jsonl (one object a line: id, category, and prompt, messages or turns), humaneval[:N]
    or humaneval:A-B (chat "complete this function", category "code"), or stdlib-edit:N or :A-B
    (category "edit"); several, separated by commas."""
    prompts, seen = [], {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise PromptsError(f"empty entry in prompts spec {spec!r}")
        if Path(part).is_file():
            found = _prompts_file(part)
        elif part.startswith("humaneval"):
            found = _humaneval(part)
        elif part.startswith("stdlib-edit"):
            found = _stdlib_edits(part)
        else:
            found = _prompts_file(part)
        for prompt in found:
            if prompt.id in seen:
                raise PromptsError(f"prompt id {prompt.id!r} appears twice (in {seen[prompt.id]} and {part}); ids must be unique")
            seen[prompt.id] = part
            prompts.append(prompt)
    return prompts

