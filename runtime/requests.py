"""The checks a request's content gets, shared by the Python API (runtime.api, the Engine) and
the HTTP server, so the two cannot drift: chat messages here, token ids in
runtime.engine.Prompt, sampling settings in edge_spec.sampling.SamplingConfig. Each failure is a
SettingError naming the field, which the server returns as a 400 and the API raises as is."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_spec.params import SettingError, check_params, param, params, same_as, shown
from edge_spec.sampling import SamplingConfig
from runtime.gamma import MAX_GAMMA

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



@dataclass(frozen=True)
class Speculation:
    """One request's speculation: a drafter the bundle has (Engine.available_drafters(); "none"
    decodes plainly) and a cap on γ; None keeps the Engine's own choice. Greedy output does not
    depend on it with fp32 bundles or in block-stable mode; it changes only the speed."""

    drafter: str | None = None
    max_gamma: int | None = None

    def __post_init__(self):
        if self.drafter is not None and not isinstance(self.drafter, str):
            raise SettingError("speculation.drafter", f"speculation.drafter must be a string such as 'none', 'lookup' "
                                                      f"or 'model', got {shown(self.drafter)}", code="invalid_type")
        if self.max_gamma is not None and (isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, int)
                                           or not 1 <= self.max_gamma <= MAX_GAMMA):
            raise SettingError("speculation.max_gamma", f"speculation.max_gamma must be an integer 1..{MAX_GAMMA}, "
                                                        f"got {shown(self.max_gamma)}")

    @classmethod
    def of(cls, value) -> "Speculation | None":
        """A Speculation from itself, None or a {"drafter", "max_gamma"} mapping (the server's JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise SettingError("speculation", f'speculation must be an object like {{"drafter": "none"}}, got {shown(value)}',
                               code="invalid_type")
        unknown = sorted(str(k) for k in value if k not in ("drafter", "max_gamma"))
        if unknown:
            raise SettingError(f"speculation.{unknown[0][:40]}", f"speculation takes drafter and max_gamma, not "
                                                                 f"{', '.join(unknown)[:80]}", code="unknown_parameter")
        return cls(value.get("drafter"), value.get("max_gamma"))


def check_client(client) -> None:
    """A request's client: None (one anonymous client) or a non-empty string naming who sent it."""
    if client is not None and (not isinstance(client, str) or not client):
        raise SettingError("client", f"client must be a non-empty string naming who sent the request, or None, "
                                     f"got {shown(client)}", code="invalid_type")


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    speculation: Speculation | None = None  # None: the Engine's drafter and γ
    client: str | None = None  # who sent it (check_client): the suffix cache and the scheduler's fairness go by it

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "speculation", Speculation.of(self.speculation))
        check_client(self.client)


@dataclass(frozen=True)
class Options:
    """One request's settings: what the Python API takes by keyword, and what the command line's
    flags and the server's fields are generated from (runtime/requests.py). The sampling fields
    are SamplingConfig's own (same_as: declared once, in edge_spec/sampling.py); stop strings end
    the text before their first occurrence."""

    max_tokens: int = param(256, int, "tokens to generate at most", low=1, cli="--max-new-tokens", server=False)
    temperature: float = same_as(SamplingConfig, "temperature")
    top_k: int = same_as(SamplingConfig, "top_k")
    top_p: float = same_as(SamplingConfig, "top_p")
    seed: int | None = same_as(SamplingConfig, "seed")
    stop: tuple[str, ...] = ()
    # Which drafter and γ cap this request decodes with (a Speculation or {"drafter", "max_gamma"});
    # None: the Model's own. Checked against the bundle at submit.
    speculation: Speculation | None = None
    # Who sent it: it copies only from this client's earlier text (suffix cache) and shares the
    # queue and batch fairly with other clients (runtime/scheduler.py); None: one anonymous client.
    client: str | None = None

    def __post_init__(self) -> None:
        check_params(self)
        if self.stop is None or isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,) if self.stop else ())
        stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise SettingError("stop", f"stop must be non-empty strings, got {shown(self.stop)}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "speculation", Speculation.of(self.speculation))
        check_client(self.client)
        self.sampling()  # SamplingConfig's own checks across its fields

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(**{name: getattr(self, name) for name in params(SamplingConfig)})

    def generate_config(self) -> GenerateConfig:
        return GenerateConfig(self.max_tokens, self.sampling(), self.stop, self.speculation, self.client)


__all__ = ["CHAT_ROLES", "GenerateConfig", "Options", "SettingError", "Speculation", "check_messages", "check_prompt_text", "check_text"]
