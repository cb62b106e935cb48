"""The wrong-key throttle and the connection cap count a client by its network (IPv4 /24, IPv6
/64, all of loopback as one), and wrong keys from all networks together are bounded too.

Loopback addresses are real sockets (any 127.x address can be a source on Linux); other
networks are driven through the ASGI app with the client address a socket would have given, or
through the uvicorn protocol with a transport that reports one. The servers hold a stub model:
nothing here generates.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("uvicorn")

from runtime.server import Server, ServerConfig, client_network  # noqa: E402
from tests.test_server import serving  # noqa: E402

KEY = "sk-edge-spec-networks"


def stub_model() -> SimpleNamespace:
    """What the auth-only routes and the body limits read of a Model."""
    return SimpleNamespace(name="stub", max_context=64, vocab_size=400, busy=False, queue_depth=0, max_queue=4, running=0, parallel=1,
                           engine=SimpleNamespace(tokenizer=SimpleNamespace(max_token_bytes=8)))


def asgi_get(server: Server, path: str, client: str, key: str | None) -> tuple[int, dict]:
    """(status, JSON body) of GET path through the server's ASGI app, from `client`."""
    headers = [(b"host", b"127.0.0.1")] + ([(b"authorization", f"Bearer {key}".encode())] if key else [])
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": (client, 40000), "server": ("127.0.0.1", 8000)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(server.app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def keyed_server(**config) -> Server:
    return Server(stub_model(), api_keys=(KEY,), config=ServerConfig(**{"auth_window": 30.0, **config}))


def get_from(source: str, port: int, key: str) -> int:
    """Status of GET /v1/models over a socket whose source address is `source`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_client_networks():
    config = ServerConfig()
    assert {config.client_network(a) for a in ("127.0.0.1", "127.0.0.31", "127.200.0.1", "::1", "::ffff:127.0.0.9")} == {"loopback"}
    assert config.client_network("192.0.2.7") == config.client_network("192.0.2.250") == "192.0.2.0/24"
    assert config.client_network("::ffff:192.0.2.7") == "192.0.2.0/24"  # a dual-stack socket's IPv4 client
    assert config.client_network("2001:db8::1") == config.client_network("2001:db8::ffff:ffff:ffff:ffff") == "2001:db8::/64"
    assert config.client_network("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert config.client_network("fe80::1%eth0") == "fe80::/64"
    assert client_network("192.0.2.7", 32, 128) == "192.0.2.7/32"
    assert ServerConfig(client_prefix_v4=16, client_prefix_v6=48).client_network("2001:db8:0:7::1") == "2001:db8::/48"
    for bad, fragment in (({"client_prefix_v4": 0}, "client_prefix_v4 must be a prefix length from 1 to 32"),
                          ({"client_prefix_v6": 129}, "client_prefix_v6 must be a prefix length from 1 to 128"),
                          ({"client_prefix_v4": True}, "client_prefix_v4"), ({"client_prefix_v6": 64.0}, "client_prefix_v6"),
                          ({"auth_failures_global": 0}, "auth_failures_global must be an integer >= 1")):
        with pytest.raises(ValueError, match=fragment):
            ServerConfig(**bad)


def test_wrong_keys_from_many_loopback_addresses_are_one_client():
    """The reported case: wrong keys from 127.0.0.2 ... 127.0.0.31 all got 401 and never a 429."""
    server = keyed_server(auth_failures=3)
    with serving(server) as (port, _):
        statuses = [get_from(f"127.0.0.{i}", port, "wrong") for i in range(2, 32)]
        assert statuses[:3] == [401] * 3 and set(statuses[3:]) == {429}, statuses
        assert get_from("127.0.0.1", port, KEY) == 429  # the right key too: a throttled client cannot probe


def test_wrong_keys_from_one_ipv4_24_are_throttled_together_and_another_24_is_served():
    server = keyed_server(auth_failures=3)
    statuses = [asgi_get(server, "/v1/models", f"192.0.2.{i}", "wrong")[0] for i in range(1, 31)]
    assert statuses[:3] == [401] * 3 and set(statuses[3:]) == {429}, statuses
    status, body = asgi_get(server, "/v1/models", "192.0.2.200", KEY)
    assert status == 429 and body["error"]["code"] == "auth_throttled" and "192.0.2.0/24" in body["error"]["message"]
    assert asgi_get(server, "/v1/models", "192.0.3.1", KEY)[0] == 200
    assert asgi_get(server, "/v1/models", "192.0.3.1", "wrong")[0] == 401


def test_wrong_keys_from_one_ipv6_64_are_throttled_together_and_another_64_is_served():
    server = keyed_server(auth_failures=3)
    statuses = [asgi_get(server, "/v1/models", f"2001:db8::{i:x}:{i * 7919 % 65536:x}", "wrong")[0] for i in range(1, 31)]
    assert statuses[:3] == [401] * 3 and set(statuses[3:]) == {429}, statuses
    status, body = asgi_get(server, "/v1/models", "2001:db8::ffff:1", KEY)
    assert status == 429 and "2001:db8::/64" in body["error"]["message"]
    assert asgi_get(server, "/v1/models", "2001:db8:0:1::1", KEY)[0] == 200


def test_rotating_networks_cannot_guess_past_the_global_limit():
    server = keyed_server(auth_failures=3, auth_failures_global=10)
    assert asgi_get(server, "/v1/models", "198.51.100.9", KEY)[0] == 200  # a client known good before the flood
    statuses = [asgi_get(server, "/v1/models", f"10.{i // 256}.{i % 256}.1", "wrong")[0] for i in range(200)]
    assert statuses.count(401) == 10 and statuses.count(429) == 190, "wrong keys past the global limit were checked"
    status, body = asgi_get(server, "/v1/models", "203.0.113.5", KEY)  # a network never seen: throttled too
    assert status == 429 and "all clients" in body["error"]["message"]
    assert asgi_get(server, "/v1/models", "198.51.100.77", KEY)[0] == 200  # the known-good network is still served
    assert asgi_get(server, "/health", "203.0.113.5", None)[0] == 200


class _Transport:
    """What uvicorn's protocol asks of a transport, for a peer at `address`."""

    def __init__(self, address: str):
        self.address, self.written, self.closed = address, b"", False

    def get_extra_info(self, name, default=None):
        return {"peername": (self.address, 40000), "sockname": ("::", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_connection_cap_counts_an_ipv6_64_and_an_ipv4_24_as_one_client():
    import uvicorn
    from uvicorn.server import ServerState

    from runtime.server import guarded_protocol

    config = ServerConfig(max_connections_per_client=3)
    protocol = guarded_protocol(config)
    loop = asyncio.new_event_loop()
    try:
        uv_config = uvicorn.Config(lambda scope, receive, send: None, http=protocol, lifespan="off")
        uv_config.load()
        state = ServerState()

        def connect(address: str) -> _Transport:
            transport = _Transport(address)
            protocol(uv_config, state, {}, _loop=loop).connection_made(transport)
            return transport

        for network in (["2001:db8::1", "2001:db8::2:1", "2001:db8::ffff:3", "2001:db8::4"],
                        ["192.0.2.1", "192.0.2.2", "192.0.2.3", "192.0.2.4"]):
            held = [connect(address) for address in network[:3]]
            assert not any(t.closed for t in held)
            refused = connect(network[3])
            assert refused.closed and refused.written.startswith(b"HTTP/1.1 429"), refused.written[:200]
            assert b"too_many_connections" in refused.written
        assert not connect("2001:db8:0:1::1").closed and not connect("192.0.3.1").closed  # other networks
    finally:
        loop.close()


def test_connection_cap_counts_loopback_addresses_as_one_client():
    server = keyed_server(max_connections_per_client=4)
    with serving(server) as (port, _):
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(f"127.0.0.{i}", 0))
                 for i in range(2, 6)]
        try:
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.6", 0)) as extra:
                extra.settimeout(3)
                got = b""
                while chunk := extra.recv(4096):
                    got += chunk
                assert got.startswith(b"HTTP/1.1 429") and b"(loopback)" in got, got[:200]
        finally:
            for s in socks:
                s.close()


# -- the serve flags --------------------------------------------------------------------------------

def _serve_config(monkeypatch, *flags) -> ServerConfig:
    """The ServerConfig `serve` hands the server for these flags; nothing is loaded or bound."""
    import runtime.__main__ as cli
    import runtime.api
    import runtime.server

    seen = {}
    monkeypatch.setattr(cli, "_engine", lambda args: object())
    monkeypatch.setattr(runtime.api, "Model", lambda engine, **kw: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(runtime.server, "serve", lambda model, *a, config, **kw: seen.setdefault("config", config))
    monkeypatch.delenv("EDGE_SPEC_API_KEY", raising=False)
    assert cli.main(["serve", "bundle", *flags]) == 0
    return seen["config"]


def test_serve_flags_reach_the_server_config(monkeypatch):
    config = _serve_config(monkeypatch, "--client-prefix-v4", "16", "--client-prefix-v6", "48",
                           "--auth-failures-global", "7", "--max-connections-per-client", "3")
    assert (config.client_prefix_v4, config.client_prefix_v6, config.auth_failures_global,
            config.max_connections_per_client) == (16, 48, 7, 3)
    assert config.client_network("10.1.2.3") == "10.1.0.0/16"
    assert config.client_network("2001:db8:1:2:3::4") == "2001:db8:1::/48"
    defaults = _serve_config(monkeypatch)
    assert (defaults.client_prefix_v4, defaults.client_prefix_v6, defaults.auth_failures_global,
            defaults.max_connections_per_client) == (24, 64, 100, 64) == (
        ServerConfig.client_prefix_v4, ServerConfig.client_prefix_v6, ServerConfig.auth_failures_global,
        ServerConfig.max_connections_per_client)


@pytest.mark.parametrize("flag, value, fragment", [
    ("--client-prefix-v4", "0", "client_prefix_v4 must be a prefix length from 1 to 32"),
    ("--client-prefix-v4", "33", "client_prefix_v4 must be a prefix length from 1 to 32"),
    ("--client-prefix-v6", "129", "client_prefix_v6 must be a prefix length from 1 to 128"),
    ("--client-prefix-v6", "x", "'x' is not an integer"),
    ("--auth-failures-global", "0", "auth_failures_global must be an integer >= 1"),
    ("--auth-failures-global", "1.5", "'1.5' is not an integer"),
])
def test_bad_serve_network_flags_exit_2_with_one_line_before_any_load(monkeypatch, capsys, flag, value, fragment):
    import runtime.__main__ as cli

    def load(args):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cli, "_engine", load)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "bundle", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: argument {flag}: ") and fragment in err, err
