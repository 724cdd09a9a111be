"""Every connection has a deadline: aiohttp's HTTP protocol with a write watchdog, bounded request heads, and
errors aiohttp answers itself given in the API's error shape.

- A request's line and headers must arrive within `header_timeout_s` of the connection opening or of its previous
  response: that is aiohttp's keep-alive timer, which closes a connection still waiting for a whole request head
  (so an idle keep-alive connection closes then too).
- Response bytes a client does not take within `write_timeout_s` cut its connection. The transport's write
  buffer has a high-water mark of 0, so the protocol is paused exactly while bytes wait in user space (the kernel's
  send buffer is full); pausing arms a timer and resuming disarms it. The kernel's send buffer is capped
  (`send_buffer_bytes`): left to itself Linux grows it to megabytes on loopback, which a stream that stopped
  being read would fill for minutes before any write waits. The cut is an abort: closing would wait for bytes the
  client never takes. A handler blocked on such a write is cancelled with the connection (`handler_cancellation`),
  which ends its request and frees its sequences (invariant 1).
- A request head over the size limits is 431, a malformed one 400, as API error JSON: aiohttp answers these before
  any application code runs (in plain text), so the protocol's `handle_error` answers instead.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from web.app import ServerSettings
from web.protocol import GENERIC_SERVER_ERROR, APIError

log = logging.getLogger("conveyor.web")

MAX_HEADERS = 128  # aiohttp's own bound on a request's header count
SHUTDOWN_TIMEOUT_S = 1.0  # at runner cleanup: how long a handler still running may take before it is cancelled


class GuardedRequestHandler(RequestHandler):
    """aiohttp's protocol, plus the write watchdog and API-shaped answers to requests it cannot parse."""

    __slots__ = ("_write_timeout_s", "_send_buffer_bytes", "_stall", "_socket_transport")

    def __init__(self, manager: web.Server, *, write_timeout_s: float, send_buffer_bytes: int, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._write_timeout_s = write_timeout_s
        self._send_buffer_bytes = send_buffer_bytes
        self._stall: asyncio.TimerHandle | None = None
        self._socket_transport: asyncio.BaseTransport | None = None  # kept: aiohttp drops its own at a forced close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
        super().connection_made(transport)
        self._socket_transport = transport
        transport.set_write_buffer_limits(high=0)  # type: ignore[attr-defined]  # paused while any byte waits

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stall = self._loop.call_later(self._write_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._socket_transport = None
        super().connection_lost(exc)

    def _disarm(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        transport = self._socket_transport  # a closing connection still waiting to flush is cut too
        if transport is not None:
            log.info("a client took no response bytes for %gs: its connection is cut", self._write_timeout_s)
            transport.abort()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """What aiohttp answers itself (a request head it cannot parse, a handler's escaped exception), as API
        error JSON; the connection closes after it, as aiohttp's own answer does."""
        if request.writer.output_size > 0:  # a response is under way: aiohttp's answer (it raises) ends it
            return super().handle_error(request, status, exc, message)
        error = head_error(exc, self.max_field_size) if isinstance(exc, HttpProcessingError) else None
        if error is not None:
            log.warning("refused a request head from %s: %s", request.remote, error.message)
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            error = APIError(504, "the request timed out", "timeout") if status == 504 else APIError(
                500, GENERIC_SERVER_ERROR, "server_error")
        response = web.Response(status=error.status, body=orjson.dumps(error.body()), content_type="application/json")
        response.force_close()
        return response


def head_error(exc: HttpProcessingError, max_line_bytes: int) -> APIError:
    """A request head aiohttp's parser refused: 431 past the size limits, else 400."""
    if isinstance(exc, LineTooLong) or "Too many headers" in exc.message:
        return APIError(431, f"the request head is too large: a line over {max_line_bytes} bytes or over "
                             f"{MAX_HEADERS} headers", "invalid_request_error", code="request_header_fields_too_large")
    return APIError(400, f"malformed HTTP request: {exc.message}", "invalid_request_error")


class GuardedServer(web.Server):
    """aiohttp's Server building GuardedRequestHandler protocols (its kwargs, from the runner, hold the timeout)."""

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp's Application builds a plain Server and has no hook for the protocol class; GuardedServer adds no
        # state, only the protocol it builds.
        server.__class__ = GuardedServer
        return server


def make_runner(app: web.Application, settings: ServerSettings) -> web.AppRunner:
    """The runner every server uses (`conveyor serve` and the tests' live server)."""
    return GuardedAppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                            keepalive_timeout=settings.header_timeout_s, max_line_size=settings.max_header_bytes,
                            max_field_size=settings.max_header_bytes, max_headers=MAX_HEADERS,
                            write_timeout_s=settings.write_timeout_s, send_buffer_bytes=settings.send_buffer_bytes)
