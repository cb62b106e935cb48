"""Request settings are declared once (a Param on a field of runtime.requests.Options, the sampling
ones SamplingConfig's own): every declared setting reaches the Python API, the command line of
each command that takes it and the server's body, each with the range it declares."""

from __future__ import annotations

import dataclasses

import pytest

from edge_spec.params import Param, SettingError, params
from edge_spec.sampling import SamplingConfig
from runtime.__main__ import _options, build_parser
from runtime.requests import Options
from runtime.server.errors import ApiError
from runtime.server.schema import CHAT_FIELDS, COMPLETION_FIELDS, _settings

SETTINGS = params(Options)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Options)}


def _inside(p: Param, high: float | None = None):
    """A value inside the range that differs from the default."""
    high = p.high if high is None else high
    if p.kind is int:
        return p.low + 1 if high is None or p.low + 1 <= high else p.low
    return high / 2 if high is not None else p.low + 0.5


def _outside(p: Param, high: float | None = None) -> list:
    """Values just past each declared bound."""
    high = p.high if high is None else high
    below = p.low if p.low_open else p.low - (1 if p.kind is int else 0.5)
    return [below] + ([high + (1 if p.kind is int else 0.5)] if high is not None else [])


def test_sampling_settings_are_sampling_configs_own_declarations():
    """Options carries SamplingConfig's settings, not copies of them: the same defaults and Params."""
    sampling = {f.name: f for f in dataclasses.fields(SamplingConfig)}
    assert set(sampling) <= set(SETTINGS)
    for name, f in sampling.items():
        assert SETTINGS[name] is f.metadata["param"] and DEFAULTS[name] == f.default
    assert Options(**{name: _inside(p) for name, p in SETTINGS.items()}).sampling() == SamplingConfig(
        **{name: _inside(SETTINGS[name]) for name in sampling})


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_api_refuses_each_setting_outside_its_range(name):
    p = SETTINGS[name]
    assert getattr(Options(**{name: _inside(p)}), name) == _inside(p)
    for value in _outside(p) + ["1"]:
        with pytest.raises(SettingError) as caught:
            Options(**{name: value})
        assert caught.value.param == name, value


@pytest.mark.parametrize("command, expected", [("generate", set(SETTINGS)), ("chat", set(SETTINGS)),
                                               ("audit", {"temperature", "top_k", "top_p"})])
def test_each_command_has_a_flag_per_setting_with_its_range(command, expected, capsys):
    parser = build_parser()
    head = [command, "BUNDLE"] + (["--prompt", "x"] if command != "chat" else [])
    assert set(parser.parse_args(head).request_settings) == expected
    for name in expected:
        p = SETTINGS[name]
        flag = p.cli or "--" + name.replace("_", "-")
        args = parser.parse_args(head + [flag, str(_inside(p))])
        assert getattr(_options(args), name) == _inside(p), name
        for value in _outside(p):
            with pytest.raises(SystemExit) as caught:
                parser.parse_args(head + [flag, str(value)])
            assert caught.value.code == 2
            assert f"argument {flag}: {value} is out of range" in capsys.readouterr().err, (name, value)


def test_chat_defaults_are_its_own_and_the_rest_the_apis():
    args = build_parser().parse_args(["chat", "BUNDLE"])
    assert _options(args) == Options(max_tokens=512, temperature=0.7)
    args = build_parser().parse_args(["generate", "BUNDLE", "--prompt", "x"])
    assert _options(args) == Options()


@pytest.mark.parametrize("name", sorted(n for n, p in SETTINGS.items() if p.server))
def test_the_server_reads_each_setting_with_its_range(name):
    p = SETTINGS[name]
    high = p.server_high if p.server_high is not None else p.high
    assert name in COMPLETION_FIELDS and name in CHAT_FIELDS
    assert _settings({name: _inside(p, high)})[name] == _inside(p, high)
    for value in _outside(p, high):
        if value in p.server_off:
            continue
        with pytest.raises(ApiError) as caught:
            _settings({name: value})
        assert (caught.value.status, caught.value.param, caught.value.code) == (400, name, "invalid_value"), value
    with pytest.raises(ApiError) as caught:
        _settings({name: "1"})
    assert (caught.value.param, caught.value.code) == (name, "invalid_type")


def test_the_servers_own_defaults_and_spellings_of_off():
    """OpenAI's default temperature is 1 and its range ends at 2; llama.cpp's top_k -1 is off."""
    assert _settings({}) == {"temperature": 1.0}
    assert _settings({"top_k": -1}) == {"temperature": 1.0}
    with pytest.raises(ApiError):
        _settings({"temperature": 2.5})
    assert Options(temperature=2.5).temperature == 2.5  # the API's range has no such bound
