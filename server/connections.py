"""Connection hygiene: slow clients, idle connections, and how many connections may be open.

Left alone, aiohttp waits as long as a client takes to send a request's headers and body, and keeps
an idle connection for an hour, so a client that trickles a byte every few seconds holds a socket
forever, and a few hundred of them exhaust the process's file descriptors. The guard bounds that:

- ``read_timeout``: from a request's first byte, its headers must be complete within this time, or
  the client gets 408 and the connection is closed. The handler gives the body as long again
  (``OpenAIServing`` reads it under the same timeout).
- ``keepalive_timeout``: a connection with no request in progress and no new bytes is closed.
- ``max_connections``: a connection beyond this many open ones gets 503 and is closed at once.

``ConnectionGuard.wrap`` puts a small protocol in front of each of aiohttp's per-connection
protocols (every asyncio callback is passed on, so aiohttp works as before). It sees the bytes
arrive; the app's middleware tells it when a request's headers were parsed and when its handler
returned (``ConnectionGuard.busy``). ``GuardedSite`` is the TCP site that listens through it.

What aiohttp answers by itself (malformed HTTP, before any handler of ours runs) carries our
``Server`` header and an OpenAI-style JSON error body like every other answer.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Iterator

from aiohttp import web, web_protocol, web_response

from server.protocol import APIError

SERVER_NAME = "pyengine"  # the Server header: no versions to look vulnerabilities up by
# aiohttp answers malformed HTTP (a bad request line or header) with its own 400, before any
# middleware or signal of ours runs; that answer's Server header is aiohttp's default, which names
# the Python and aiohttp versions. Make the default ours.
web_response.SERVER_SOFTWARE = SERVER_NAME
MAX_PARSER_MESSAGE = 300  # characters of aiohttp's parser message quoted in a malformed request's 400

_aiohttp_handle_error = web_protocol.RequestHandler.handle_error


def _handle_error_as_json(self: web_protocol.RequestHandler, request: web.BaseRequest, status: int = 500,
                          exc: BaseException | None = None, message: str | None = None) -> web.StreamResponse:
    """aiohttp's RequestHandler.handle_error, which answers malformed HTTP (and what escapes a handler),
    with an OpenAI-style JSON error body instead of plain text. aiohttp's own runs first: it logs, and
    raises if a response is already under way."""
    _aiohttp_handle_error(self, request, status, exc, message)
    if status < 500:
        detail = (message or HTTPStatus(status).phrase)[:MAX_PARSER_MESSAGE]
        err = APIError(status, f"Malformed HTTP request: {detail}", code="invalid_http_request")
    else:  # no exception text: it may be anything
        err = APIError(status, f"{HTTPStatus(status).phrase}.", type="server_error")
    resp = web.json_response(err.body(), status=status)
    resp.force_close()
    return resp


# The same for those answers' bodies (RequestHandler has __slots__: the class is where it can change).
web_protocol.RequestHandler.handle_error = _handle_error_as_json


@dataclass
class ConnectionLimits:
    read_timeout: float = 30.0  # seconds for a request's headers; as long again for its body
    keepalive_timeout: float = 15.0  # seconds an idle connection stays open
    max_connections: int = 512  # open connections; more are answered 503 and closed

    def __post_init__(self) -> None:
        if self.read_timeout <= 0 or self.keepalive_timeout <= 0 or self.max_connections < 1:
            raise ValueError("read_timeout and keepalive_timeout must be > 0 and max_connections >= 1")

    @property
    def handler_keepalive(self) -> float:
        """aiohttp's own idle timeout, a backstop behind the guard's. It counts from the end of the
        last response, so it must not fire while a request that started within keepalive_timeout is
        still allowed its read_timeout (that one gets a 408 from the guard)."""
        return self.keepalive_timeout + self.read_timeout + 1.0


def read_timeout_error(seconds: float) -> APIError:
    return APIError(408, f"The request did not arrive within {seconds:g} seconds.", type="timeout",
                    code="request_read_timeout")


class ConnectionGuard:
    """The open connections and the limits they are held to."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.connections: dict[asyncio.BaseTransport, _GuardedConnection] = {}  # the accepted, open ones

    def wrap(self, inner: asyncio.Protocol) -> asyncio.Protocol:
        return _GuardedConnection(self, inner)

    @contextlib.contextmanager
    def busy(self, request: web.BaseRequest) -> Iterator[None]:
        """Around a request's handling: no read or idle timer runs on its connection meanwhile.
        A no-op for connections the guard did not accept (e.g. aiohttp's test server)."""
        conn = self.connections.get(request.transport)
        if conn is None:
            yield
            return
        conn.request_started()
        try:
            yield
        finally:
            conn.request_finished()


class _GuardedConnection(asyncio.Protocol):
    """One connection: passes every callback on to aiohttp's protocol and runs one timer, for the
    idle connection (keepalive_timeout: close) or the request being read (read_timeout: 408)."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.accepted = False
        self.busy = False  # a request's headers were parsed and its handler has not returned yet
        self.reading = False  # bytes of a new request arrived; its headers are not parsed yet
        self.lingering = False  # answered without a handler: input is discarded until the close
        self.timer: asyncio.TimerHandle | None = None

    # ---------------------------------------------------------------- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        limits = self.guard.limits
        if len(self.guard.connections) >= limits.max_connections:
            err = APIError(503, f"The server has {limits.max_connections} connections open already. "
                           "Retry later.", type="server_error", code="too_many_connections")
            self._answer_and_close(err)
            return
        self.accepted = True
        self.guard.connections[transport] = self
        self.inner.connection_made(transport)
        self._arm(limits.keepalive_timeout, self._idle_expired)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        if not self.busy and not self.reading and data:
            self.reading = True
            self._arm(self.guard.limits.read_timeout, self._read_expired)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.lingering:
            return None  # the client has finished sending too: close now
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.accepted:
            self.guard.connections.pop(self.transport, None)
            self.inner.connection_lost(exc)

    # ---------------------------------------------------------------- request lifecycle
    def request_started(self) -> None:
        self.busy, self.reading = True, False
        self._disarm()

    def request_finished(self) -> None:
        self.busy = False
        if not self.transport.is_closing():  # e.g. the client left mid-request
            self._arm(self.guard.limits.keepalive_timeout, self._idle_expired)

    # ---------------------------------------------------------------- timers
    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds, callback)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _still_writing(self, callback) -> bool:
        """A response is still going out (slow reader): look again later rather than cut it."""
        if self.transport.get_write_buffer_size() == 0:
            return False
        self._arm(1.0, callback)
        return True

    def _idle_expired(self) -> None:
        self.timer = None
        if not self.busy and not self.reading and not self._still_writing(self._idle_expired):
            self.transport.close()

    def _read_expired(self) -> None:
        self.timer = None
        if self.reading and not self._still_writing(self._read_expired):
            self._answer_and_close(read_timeout_error(self.guard.limits.read_timeout))

    def _answer_and_close(self, err: APIError) -> None:
        """No handler runs on this connection: answer in raw HTTP and close (after the write)."""
        body = json.dumps(err.body()).encode()
        head = (f"HTTP/1.1 {err.status} {_REASONS[err.status]}\r\nServer: {SERVER_NAME}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        # A lingering close, as nginx does: FIN after the answer, then what the client still sends is
        # read and dropped for a moment. Closing with unread input makes the kernel answer with RST,
        # which can destroy the answer before the client has read it.
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_SECONDS, self.transport.close)


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}
LINGER_SECONDS = 2.0  # how long a connection answered without a handler keeps draining input


class GuardedSite(web.BaseSite):
    """A TCP site (like web.TCPSite) whose connections pass through a ConnectionGuard."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 **kwargs: Any) -> None:
        super().__init__(runner, **kwargs)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._guard.wrap(server()), self._host, self._port, backlog=self._backlog)
