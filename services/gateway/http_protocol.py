"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol with the limits of http_limits.py kept
as the bytes arrive, and OpenAI error objects where uvicorn would answer in plain text.

uvicorn closes an idle keep-alive connection, but a request that never finishes arriving holds its
connection (and, with a body, its handler) for as long as the client likes: a client trickling a header,
or sending less body than its Content-Length says. Here:

- a request's line and headers must arrive within --http-header-timeout of its first byte (of the
  connection's opening, for its first request) and within --http-max-header-size bytes;
- its body within --http-body-timeout of its last header;
- a connection opened while --http-max-connections others are open is answered 503 (with Connection:
  close) as soon as its request's headers are in, without running the app.

A timeout answers 408 when the request had begun (a connection that never sent a byte is closed
without a word, as a browser's spare connection may be), then closes the connection.
"""

from __future__ import annotations

import asyncio
import http
import json

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.gateway.http_errors import error_body
from services.gateway.http_limits import HttpLimits
from shared.logging import setup_logging

log = setup_logging("gateway")

OVER_CAPACITY_RETRY_S = 1
LINGER_S = 2.0  # how long a refused connection's unread bytes are drained before it closes


def error_content(status: int, message: str) -> bytes:
    """The OpenAI error object for ``status``, as JSON."""
    return json.dumps(error_body(HTTPException(status, message))[1]).encode()


def error_bytes(status: int, message: str) -> bytes:
    """A whole HTTP response carrying the error object for ``status`` that closes the connection."""
    content = error_content(status, message)
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(content)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + content


async def refuse_over_capacity(scope, receive, send) -> None:
    """The ASGI app a connection beyond the cap gets for its request."""
    content = error_content(503, "the gateway has as many connections open as it accepts (--http-max-connections); "
                                 "retry later")
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
        (b"retry-after", str(OVER_CAPACITY_RETRY_S).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": content})


class HeadersTooLong(Exception):
    """Raised in a parser callback: the parser stops, and uvicorn calls send_400_response."""


class LimitedHttpProtocol(HttpToolsProtocol):
    """One client connection (uvicorn makes one per connection: pass ``limits`` through functools.partial)."""

    def __init__(self, *args, limits: HttpLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._timer: asyncio.TimerHandle | None = None  # the header or the body deadline, whichever is running
        self._in_headers = False  # a request has begun and its headers are not all in
        self._header_bytes = 0  # of the parsed line and headers
        self._spanning_bytes = 0  # of the reads a header still spans (the parser sees a header only whole)
        self._lingering = False  # answered and half-closed: what still arrives is read and dropped

    # -- the connection

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("connection beyond --http-max-connections refused", connections=len(self.connections))
            self.app = refuse_over_capacity
        self._arm(self.limits.header_timeout_s, self._header_timeout)  # its first request's line counts from here

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        was_in_headers = self._in_headers
        super().data_received(data)
        # One header spanning many reads reaches the parser's callbacks only when whole, so reads the
        # headers span are counted too (whole: the limit holds to within one read).
        if was_in_headers and self._in_headers:
            self._spanning_bytes += len(data)
            if self._spanning_bytes > self.limits.max_header_bytes:
                self._answer_and_close(431, self._headers_too_long)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser cannot read as HTTP (or to a callback's error), as an error object."""
        if self._header_bytes > self.limits.max_header_bytes:
            self._answer_and_close(431, self._headers_too_long)
        else:
            self._answer_and_close(400, "malformed HTTP request: the gateway could not parse it")

    @property
    def _headers_too_long(self) -> str:
        return (f"the request's line and headers are longer than {self.limits.max_header_bytes} bytes "
                "(--http-max-header-size)")

    # -- the parser's events

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers, self._header_bytes, self._spanning_bytes = True, 0, 0
        if self._timer is None:  # (a connection's first request keeps the deadline its opening set)
            self._arm(self.limits.header_timeout_s, self._header_timeout)

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)  # with ": " and CRLF
        super().on_header(name, value)

    def _count_header_bytes(self, n: int) -> None:
        """Stops the parser (send_400_response then answers 431) once the headers pass the limit."""
        self._header_bytes += n
        if self._header_bytes > self.limits.max_header_bytes:
            raise HeadersTooLong(self._headers_too_long)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        super().on_headers_complete()
        if not self.pipeline:  # (a request pipelined behind another is not read until that one is answered)
            self._arm(self.limits.body_timeout_s, self._body_timeout)  # one without a body completes at once

    def on_response_complete(self) -> None:
        super().on_response_complete()
        waiting = self.cycle
        if self._timer is None and waiting is not None and waiting.more_body and not waiting.response_complete:
            self._arm(self.limits.body_timeout_s, self._body_timeout)  # a pipelined request's turn came

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    # -- deadlines

    def _arm(self, seconds: float, expire) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        if not self._in_headers:  # not a byte of a request yet: nothing to answer
            self.transport.close()
            return
        self._answer_and_close(408, f"the request's headers did not arrive within {self.limits.header_timeout_s} s "
                                    "(--http-header-timeout)")

    def _body_timeout(self) -> None:
        self._timer = None
        if self.cycle is not None and self.cycle.response_started:  # answered already (a 413): only close
            self.transport.close()
            return
        self._answer_and_close(408, f"the request's body did not arrive within {self.limits.body_timeout_s} s "
                                    "(--http-body-timeout)")

    def _answer_and_close(self, status: int, message: str) -> None:
        if self.transport.is_closing() or self._lingering:
            return
        self._disarm()
        log.info("HTTP request refused", status=status, reason=message, client=self.client)
        self.transport.write(error_bytes(status, message))
        self._close_lingering()
        if self.cycle is not None and not self.cycle.response_complete:  # its handler reads a disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def _close_lingering(self) -> None:
        """Send the answer and a FIN, then drain what the client still sends until it closes or LINGER_S pass.

        Closing a socket with unread bytes in it makes the kernel send a reset, which can overtake the
        answer: a client still writing its oversized headers would see "connection reset" and no 431.
        """
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)
