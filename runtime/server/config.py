"""The server's limits and policies (ServerConfig), the Host/Origin rules, and which network a
client address counts under for the key throttle and the connection cap."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK = "loopback"  # every loopback address is one client: any local process may pick any of them


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _host_name(header: str) -> str | None:
    """The name in a Host header, without the port; None when it is not a host[:port]."""
    try:
        parts = urlsplit("//" + header)
        return parts.hostname if parts.port is None or 0 <= parts.port <= 65535 else None
    except ValueError:
        return None


def _origin(value: str) -> str:
    """An Origin (scheme://host[:port]) normalized for comparison."""
    return value.strip().rstrip("/").lower()


def client_network(address: str, v4_bits: int, v6_bits: int) -> str:
    """The network a client address counts under: "loopback" for every loopback address, the
    /v4_bits of an IPv4 address (an IPv4-mapped IPv6 address counts as its IPv4 address), the
    /v6_bits of an IPv6 one; anything that is not an IP address (a Unix socket) as itself."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return LOOPBACK
    return str(ipaddress.ip_network((ip, v4_bits if ip.version == 4 else v6_bits), strict=False))


@dataclass(frozen=True)
class ServerConfig:
    """Limits and policies of the HTTP server; `serve` sets most fields from its --flags.

    Host policy: a Host header must name loopback (localhost, 127.0.0.0/8, ::1), the address the
    server is bound to, any IP address when it is bound to all interfaces, or an allowed_hosts
    entry ("*" allows every name). Origin policy: a request with an Origin header (a browser)
    is refused unless the origin is in allowed_origins, which also get CORS headers.

    Client networks: the wrong-key throttle and the per-client connection cap count a client by
    its network, not its address, since one machine (or one customer of a provider) holds many
    addresses: an IPv4 address by its /client_prefix_v4 (default /24), an IPv6 one by its
    /client_prefix_v6 (default /64, the smallest network a site is given), and every loopback
    address as one client. auth_failures_global bounds wrong keys from all networks together, so
    rotating networks does not guess faster; past it, only networks that have sent a right key
    are still answered."""

    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int | None = None  # None: the most a request to the bundle can need (body.BodyLimits)
    header_timeout: float = 10.0  # seconds to send a request's line and headers
    body_timeout: float = 30.0  # seconds to send its body
    idle_timeout: float = 5.0  # seconds a keep-alive connection may sit idle between requests
    max_connections: int = 512
    max_connections_per_client: int = 64  # per client network (see client_prefix_v4/v6)
    shutdown_timeout: float = 10.0  # seconds running generations may go on after SIGTERM
    auth_failures: int = 10  # wrong keys a client network may send per auth_window before a 429
    auth_failures_global: int = 100  # wrong keys from all networks together per auth_window
    auth_window: float = 60.0
    client_prefix_v4: int = 24
    client_prefix_v6: int = 64
    access_log: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts))
        object.__setattr__(self, "allowed_origins", tuple(_origin(o) for o in self.allowed_origins))
        for name in ("header_timeout", "body_timeout", "idle_timeout", "shutdown_timeout", "auth_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("max_body_bytes", "max_connections", "max_connections_per_client", "auth_failures",
                     "auth_failures_global"):
            value = getattr(self, name)
            if name == "max_body_bytes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, bits in (("client_prefix_v4", 32), ("client_prefix_v6", 128)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bits:
                raise ValueError(f"{name} must be a prefix length from 1 to {bits} (leading bits that name one "
                                 f"client network), got {value!r}")
        for h in self.allowed_hosts:
            if not h or (h != "*" and not re.fullmatch(r"(\*\.)?[a-z0-9._\-\[\]:]+", h)):
                raise ValueError(f"--allowed-host {h!r} is not a host name (example.com, *.example.com, or *)")
        for o in self.allowed_origins:
            parts = urlsplit(o)
            if o != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
                raise ValueError(f"--allowed-origin {o!r} is not an origin like https://app.example.com[:port] (or *)")

    def client_network(self, address: str) -> str:
        """The network `address` counts under for the key throttle and the connection cap."""
        return client_network(address, self.client_prefix_v4, self.client_prefix_v6)

    def host_allowed(self, header: str | None) -> bool:
        if not header:
            return False
        name = _host_name(header)
        if name is None:
            return False
        if is_loopback(name) or name == self.host.strip("[]").lower():
            return True
        try:
            ipaddress.ip_address(name)
            if _is_wildcard(self.host):  # an IP address is no DNS-rebinding vector
                return True
        except ValueError:
            pass
        for allowed in self.allowed_hosts:
            if allowed == "*" or name == allowed or (allowed.startswith("*.") and name.endswith(allowed[1:])):
                return True
        return False

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or _origin(origin) in self.allowed_origins
