"""OpenAI-style error objects (and the common 400s), and the signal that a client went away."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from edge_spec.params import SettingError, shown

ECHO_CHARS = 40  # the most of a sent value an error message or a log line quotes


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def __reduce__(self):  # raised in the parsing process, re-raised here whole
        return ApiError, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    pass


def echo(value) -> str:
    """A sent JSON value as a message quotes it, never serialized whole: an object or array by its
    size, a string or number by a short prefix (with an ellipsis when cut)."""
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    if isinstance(value, str):
        return json.dumps(value[:ECHO_CHARS]) + ("…" if len(value) > ECHO_CHARS else "")
    if value is None or isinstance(value, (bool, float)):
        return json.dumps(value)
    return shown(value, ECHO_CHARS)


def printable(text: str, limit: int = 200) -> str:
    """text as a log line or a message may hold it: at most `limit` characters (an ellipsis when
    cut), control characters escaped, so a sent CR LF cannot start a forged line."""
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def type_error(name: str, expected: str, value) -> ApiError:
    return ApiError(400, f"{name} must be {expected}, got {echo(value)}", param=name, code="invalid_type")


def value_error(name: str, message: str) -> ApiError:
    return ApiError(400, message, param=name, code="invalid_value")


def setting_error(exc: SettingError) -> ApiError:
    return ApiError(400, str(exc), param=exc.param, code=exc.code)
