"""Bench prompts: FILE.jsonl (one object a line: id, category, and prompt or messages) or
humaneval[:N] from $EDGE_SPEC_MODELS, several separated by commas."""

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


def _humaneval(spec: str) -> list[BenchPrompt]:
    count = HUMANEVAL_DEFAULT_COUNT
    if spec != "humaneval":
        text = spec.split(":", 1)[1] if spec.startswith("humaneval:") else ""
        if not text.isdigit() or int(text) < 1:
            raise PromptsError(f"bad prompts spec {spec!r}: use humaneval or humaneval:N with N a positive integer")
        count = int(text)
    path = models_dir() / HUMANEVAL_FILE
    if not path.is_file():
        raise PromptsError(f"{path} not found: put {HUMANEVAL_FILE} in $EDGE_SPEC_MODELS, or pass a prompts file")
    prompts = []
    with gzip.open(path, "rt") as f:
        for line in f:
            item = json.loads(line)
            content = f"Complete this Python function. Reply with the full function only.\n\n```python\n{item['prompt']}```"
            prompts.append(BenchPrompt(item["task_id"], "code", messages=({"role": "user", "content": content},)))
            if len(prompts) == count:
                break
    if len(prompts) < count:
        raise PromptsError(f"{spec}: {path} holds only {len(prompts)} problems")
    return prompts


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
    has_prompt, has_messages = "prompt" in item, "messages" in item
    if has_prompt == has_messages:
        raise PromptsError(f"{where}: give exactly one of 'prompt' (raw text) or 'messages' (chat), not {'both' if has_prompt else 'neither'}")
    if has_prompt:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise PromptsError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(str(item["id"]), item["category"], prompt=item["prompt"])
    return BenchPrompt(str(item["id"]), item["category"], messages=_check_messages(item["messages"], where))


def _prompts_file(spec: str) -> list[BenchPrompt]:
    path = Path(spec)
    if not path.is_file():
        raise PromptsError(f"prompts file {path} not found (pass FILE.jsonl or humaneval[:N])")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            prompts.append(_prompt_from_line(line, f"{path} line {number}"))
    if not prompts:
        raise PromptsError(f"prompts file {path} has no prompts (one JSON object per line)")
    return prompts


def load_prompts(spec: str) -> list[BenchPrompt]:
    """FILE.jsonl (one object a line: id, category, and prompt or messages) or humaneval[:N]
    (chat "complete this function", category "code"); several, separated by commas."""
    prompts, seen = [], {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise PromptsError(f"empty entry in prompts spec {spec!r}")
        for prompt in _humaneval(part) if part.startswith("humaneval") and not Path(part).is_file() else _prompts_file(part):
            if prompt.id in seen:
                raise PromptsError(f"prompt id {prompt.id!r} appears twice (in {seen[prompt.id]} and {part}); ids must be unique")
            seen[prompt.id] = part
            prompts.append(prompt)
    return prompts

