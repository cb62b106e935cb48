"""The checks a request's content gets, shared by the Python API (runtime.api, the Engine) and
the HTTP server, so the two cannot drift: chat messages here, token ids in
runtime.engine.Prompt, sampling settings in edge_spec.sampling.SamplingConfig. Each failure is a
SettingError naming the field, which the server returns as a 400 and the API raises as is."""

from __future__ import annotations

from edge_spec.sampling import SettingError, shown

# developer is OpenAI's newer name for system; a role names a template branch, never free text,
# so a role string can never carry special tokens into the rendered prompt.
CHAT_ROLES = ("system", "developer", "user", "assistant")
MESSAGE_FIELDS = ("role", "content", "name")


def check_text(value: str, param: str) -> str:
    """value, if it is Unicode text: a lone UTF-16 surrogate ("\\ud800") is not."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise SettingError(param, f"{param} holds a lone UTF-16 surrogate (an escape like \\ud800 without its pair), "
                                      "which is not Unicode text", code="invalid_text") from None
    return value


def check_prompt_text(prompt) -> str:
    if not isinstance(prompt, str):
        raise SettingError("prompt", f"prompt must be a string, got {shown(prompt)}", code="invalid_type")
    return check_text(prompt, "prompt")


def check_messages(messages) -> list[dict]:
    """Chat messages as the template gets them: a non-empty list of {"role", "content"[, "name"]}
    with a role of CHAT_ROLES (developer becomes system) and content a string or a list of
    {"type": "text", "text": ...} parts (joined). Returns new dicts of role and content only."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, (list, tuple)) or not messages:
        raise SettingError("messages", 'messages must be a non-empty list of {"role": ..., "content": ...} objects, '
                                       f"got {shown(messages)}", code="invalid_type")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise SettingError(where, f'{where} must be an object like {{"role": "user", "content": "..."}}, '
                                      f"got {shown(message)}", code="invalid_type")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise SettingError(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {shown(role)}")
        if isinstance(content, (list, tuple)):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise SettingError(f"{where}.content", f'{where}.content: only text content parts ({{"type": "text", '
                                                           f'"text": "..."}}) are supported, got {shown(part)}')
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise SettingError(f"{where}.content", f"{where}.content must be a string or a list of text parts, "
                                                   f"got {shown(content)}", code="invalid_type")
        extra = sorted(str(key) for key in message if key not in MESSAGE_FIELDS)
        if extra:
            raise SettingError(f"{where}.{extra[0][:40]}", f"Unrecognized argument in {where}: {', '.join(extra)[:80]}",
                               code="unknown_parameter")
        clean.append({"role": "system" if role == "developer" else role, "content": check_text(content, f"{where}.content")})
    return clean


__all__ = ["CHAT_ROLES", "SettingError", "check_messages", "check_prompt_text", "check_text"]
