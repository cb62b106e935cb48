"""A terminal chat over one bundle: `python -m runtime chat BUNDLE`.

Each turn is rendered with the bundle's chat template over the whole history, so the model
sees the conversation; when the history no longer fits the context, the oldest turns are
dropped (and it says so). Replies stream as tokens are accepted; a dim line after each says
how many tokens, why it stopped, and how fast. Ctrl-C stops a reply; Ctrl-D or /exit quits.
"""

from __future__ import annotations

import dataclasses
import sys
import unicodedata

from runtime.api import Model
from runtime.requests import Options

HELP = """commands:
  /reset         forget the conversation (keeps the system prompt)
  /system TEXT   set the system prompt (and forget the conversation)
  /history       show the conversation so far
  /exit          quit (Ctrl-D too); Ctrl-C stops a reply"""

MIN_ROOM = 8  # tokens left for the reply before older turns are dropped


def printable(text: str) -> str:
    """Model text as it is safe to print: control characters (escape sequences included) other
    than newline and tab become U+FFFD, so a reply cannot drive the terminal."""
    return "".join("\ufffd" if c not in "\n\t" and unicodedata.category(c) == "Cc" else c for c in text)


def _dim(text: str, tty: bool) -> str:
    return f"\x1b[2m{text}\x1b[0m" if tty else text


def fit_history(model: Model, system: str | None, history: list[dict], user: str, room: int) -> tuple[list[dict], int, int]:
    """The messages to send: system + as many of the latest turns as fit with `room` tokens left
    for the reply. Returns (messages, prompt tokens, turns dropped); raises ValueError when the
    new message alone does not fit."""
    head = [{"role": "system", "content": system}] if system else []
    dropped = 0
    turns = list(history)
    while True:
        messages = head + turns + [{"role": "user", "content": user}]
        ids = model.encode(messages=messages)
        if len(ids) + room <= model.max_context or (not turns and len(ids) < model.max_context):
            return messages, len(ids), dropped
        if not turns:
            raise ValueError(
                f"that message needs {len(ids)} tokens but the model's context is {model.max_context}; send a shorter one"
            )
        turns = turns[2:] if len(turns) >= 2 else []  # a user turn and its reply go together
        dropped += 1


def run_chat(model: Model, system: str | None = None, options: Options = Options(max_tokens=512), input_fn=input,
             out=sys.stdout) -> int:
    """options: every turn's settings; its max_tokens is capped by the context left, and a seed
    goes up by one each turn."""
    if not model.has_chat_template:
        print("error: this bundle's tokenizer has no chat template; use `python -m runtime generate` with a raw prompt",
              file=sys.stderr)
        return 2
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    tty = out.isatty()
    out.write(f"edge-spec chat: {model.name} ({model.max_context} tokens of context). /help for commands, Ctrl-D quits.\n")
    out.flush()
    history: list[dict] = []
    max_tokens, turn_seed = options.max_tokens, options.seed
    while True:
        try:
            line = input_fn("you> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, arg = text.partition(" ")
            if command in ("/exit", "/quit"):
                return 0
            if command == "/help":
                out.write(HELP + "\n")
            elif command == "/reset":
                history.clear()
                out.write(_dim("[conversation cleared]", tty) + "\n")
            elif command == "/system":
                system = arg.strip() or None
                history.clear()
                out.write(_dim(f"[system prompt {'set' if system else 'cleared'}; conversation cleared]", tty) + "\n")
            elif command == "/history":
                if system:
                    out.write(f"system: {system}\n")
                for message in history:
                    out.write(f"{message['role']}: {printable(message['content'])}\n")
                out.write(_dim(f"[{len(history)} messages]", tty) + "\n")
            else:
                out.write(f"unknown command {command}; /help lists them\n")
            out.flush()
            continue
        try:
            messages, n_prompt, dropped = fit_history(model, system, history, line, min(MIN_ROOM, max_tokens))
        except ValueError as exc:
            out.write(f"error: {exc}\n")
            out.flush()
            continue
        if dropped:
            history = messages[(1 if system else 0) : -1]
            out.write(_dim(f"[dropped the {dropped} oldest exchange(s) to fit the context]", tty) + "\n")
        room = model.max_context - n_prompt
        job = model.submit(messages=messages, options=dataclasses.replace(options, max_tokens=max(1, min(max_tokens, room)),
                                                                          seed=turn_seed))
        if turn_seed is not None:
            turn_seed += 1  # reproducible, yet not the same draw every turn
        out.write("bot> ")
        out.flush()
        result = None
        try:
            for chunk in job:
                if chunk.text:
                    out.write(printable(chunk.text))
                    out.flush()
                result = chunk.result or result
        except KeyboardInterrupt:
            job.close()
            out.write("\n" + _dim("[stopped; this exchange is not kept]", tty) + "\n")
            out.flush()
            continue
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": result.text}]
        t = result.timings
        out.write("\n" + _dim(
            f"[{len(result.token_ids)} tokens, stop: {result.stop_reason}, prompt {n_prompt} tokens, "
            f"{result.stats.tokens_per_pass:.2f} tokens/pass, {t['decode_tokens_per_s']:.1f} tok/s]", tty) + "\n")
        out.flush()
