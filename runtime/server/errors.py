"""OpenAI-style error objects (and the common 400s), and the signal that a client went away."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from edge_spec.params import SettingError


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    pass


def type_error(name: str, expected: str, value) -> ApiError:
    return ApiError(400, f"{name} must be {expected}, got {json.dumps(value)[:80]}", param=name, code="invalid_type")


def value_error(name: str, message: str) -> ApiError:
    return ApiError(400, message, param=name, code="invalid_value")


def setting_error(exc: SettingError) -> ApiError:
    return ApiError(400, str(exc), param=exc.param, code=exc.code)
