"""uvicorn's h11 protocol with what uvicorn lacks: read deadlines, connection limits, and no
request framed by both Content-Length and Transfer-Encoding."""

from __future__ import annotations

import json

from runtime.server.config import ServerConfig
from runtime.server.errors import ApiError
from runtime.server.security import Connections


def _raw_response(status: int, code: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps(ApiError(status, message, type="server_error" if status >= 500 else "invalid_request_error",
                               code=code).body()).encode()
    reason = {400: "Bad Request", 408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}[status]
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def guarded_protocol(config: ServerConfig):
    """uvicorn's h11 protocol plus what uvicorn lacks: a deadline for a request's headers (which
    also bounds a connection that sends nothing), a deadline for its body, connection limits
    per client network and in all, and a 400 that closes the connection for a request with both
    Content-Length and Transfer-Encoding. The keep-alive idle timeout is uvicorn's own."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    connections = Connections(config)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            self._reading = None
            next_event = self.conn.next_event  # uvicorn's handle_events reads every request through it
            self.conn.next_event = lambda: self._framed(next_event())
            self._client_key = config.client_network(self.client[0]) if self.client else "-"
            refusal = connections.admit(self._client_key)
            self._admitted = refusal is None
            if refusal is not None:
                status, reason = refusal
                transport.write(_raw_response(status, "too_many_connections", f"{reason}; retry later", retry_after=1))
                transport.close()
                return
            self._arm("headers")

        def _framed(self, event):
            """RFC 9112 §6.1: a request with both Content-Length and Transfer-Encoding may hide a
            second request in its body (h11 goes by Transfer-Encoding and keeps the connection):
            answered 400 and the connection closed, before the app sees it."""
            if isinstance(event, h11.Request):
                names = {name for name, _ in event.headers}  # h11 lowercases header names
                if b"content-length" in names and b"transfer-encoding" in names:
                    self.transport.write(_raw_response(400, "ambiguous_framing", "a request may not carry both "
                                                       "Content-Length and Transfer-Encoding (RFC 9112 6.1); send one"))
                    self.transport.close()
                    return h11.NEED_DATA  # uvicorn stops reading: the connection is closing
            return event

        def connection_lost(self, exc) -> None:
            if self._admitted:
                self._admitted = False
                connections.leave(self._client_key)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch(arrived=True)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch(arrived=False)

        def _watch(self, arrived: bool) -> None:
            if self.transport.is_closing():
                return self._disarm()
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                if self._reading != "body":
                    self._arm("body")
            elif state is h11.IDLE:
                if arrived and self._reading != "headers":
                    self._arm("headers")  # the next request began: its headers have a deadline
                elif not arrived:
                    self._disarm()  # between requests: uvicorn's keep-alive timeout applies
            else:
                self._disarm()

        def _arm(self, what: str) -> None:
            self._disarm()
            seconds = config.header_timeout if what == "headers" else config.body_timeout
            self._reading = what
            self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._reading = None, None

        def _expired(self, what: str, seconds: float) -> None:
            self._deadline, self._reading = None, None
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(_raw_response(408, "request_timeout", f"the request's {what} took longer than {seconds:g} s"))
            self.transport.close()

    GuardedH11Protocol.connections = connections
    return GuardedH11Protocol
