"""Request settings declared once: a dataclass field's `Param` says its kind, range and help, and
every reader of requests reads them from it: the frozen configs' own checks (check_params), the
command line (runtime/__main__.py `_request_args`) and the HTTP server (runtime/server/schema.py
`_settings`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass


class SettingError(ValueError):
    """A request setting out of range or of the wrong kind; `param` names it (the server's error
    field, the API's keyword) and `code` is the server's error code for it."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def shown(value, limit: int = 40) -> str:
    """A value as an error message quotes it, at a cost bounded by `limit`, never by the input: a
    container by its type and size, anything else as at most `limit` characters of its repr."""
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, (str, bytes)):
        text = repr(value[:limit])
        longer = len(value) > limit
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            text, longer = str(value), False
        except ValueError:  # more digits than Python turns into text
            return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    else:
        text, longer = repr(value), False
    return text if len(text) <= limit and not longer else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Param:
    """One numeric request setting, whose field's default is the value that turns it off;
    server_default/server_high/server_off are the OpenAI-compatible server's differences (its
    default where OpenAI's differs, a tighter upper bound, other spellings of off)."""

    kind: type  # int or float
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is out of range
    cli: str | None = None  # the command-line flag, where it is not --the-field-name
    server: bool = True  # read from a request body by the generic reader (else by name in the schema)
    server_default: object = None  # None: the field's own default
    server_high: float | None = None
    server_off: tuple = ()

    def bounds(self, high: float | None = None) -> str:
        high = self.high if high is None else high
        if self.kind is int:
            return f"{self.low}..{high}" if high is not None else f">= {self.low}"
        low = f"{self.low:g}"
        if high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"{'(' if self.low_open else '['}{low}, {high:g}]"

    def describe(self, high: float | None = None) -> str:
        """What a value must be: "an integer >= 1", "a number in (0, 1]"."""
        bounds = self.bounds(high)
        return f"{'an integer' if self.kind is int else 'a number'} {bounds if bounds[0] in '<>' else 'in ' + bounds}"

    def within(self, value, high: float | None = None) -> bool:
        high = self.high if high is None else high
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return high is None or value <= high

    def check(self, name: str, value, optional: bool = False, high: float | None = None):
        """value as this setting's kind, or SettingError(name) naming what it must be (high, when
        given, in place of the declared upper bound: the server's tighter one)."""
        if value is None and optional:
            return None
        if self.kind is int:
            if isinstance(value, bool):
                raise SettingError(name, f"{name} must be an integer, got {value!r}", code="invalid_type")
            try:
                value = operator.index(value)
            except TypeError:
                raise SettingError(name, f"{name} must be an integer, got {shown(value)}", code="invalid_type") from None
        else:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise SettingError(name, f"{name} must be a number, got {shown(value)}", code="invalid_type")
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an integer past a float's range is past every setting's range too
                raise SettingError(name, f"{name} must be {self.describe(high)}, got {shown(value)}") from None
            if not finite:
                raise SettingError(name, f"{name} must be a finite number, got {shown(value)}")
        if not self.within(value, high):
            raise SettingError(name, f"{name} must be {self.describe(high)}, got {shown(value)}")
        return value


def param(default, kind: type, help: str, **facts):
    """A dataclass field declared as a request setting (its Param in the field's metadata)."""
    return dataclasses.field(default=default, metadata={"param": Param(kind, help, **facts)})


def params(cls) -> dict[str, Param]:
    """The request settings of a dataclass, by field name, in declaration order."""
    return {f.name: f.metadata["param"] for f in dataclasses.fields(cls) if "param" in f.metadata}


def check_params(obj) -> None:
    """Each declared setting of a dataclass instance, checked by its Param (None allowed where the
    default is None)."""
    for f in dataclasses.fields(obj):
        if "param" in f.metadata:
            f.metadata["param"].check(f.name, getattr(obj, f.name), optional=f.default is None)


def same_as(cls, name: str):
    """A field declared as `cls`'s setting `name` is (its default and Param): a flat request
    type carries a nested config's settings without declaring them again."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=f.default, metadata=f.metadata)
