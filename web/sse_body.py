"""Where a streamed response's events go once its headers are out: the socket sender when it can
take the connection (web/socket_sender.py), else aiohttp's response.

Through the sender the body is framed here, as HTTP/1.1 chunked encoding (the header aiohttp
sent), and aiohttp writes the final empty chunk after the sender let go of the socket, so the
two never interleave.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11

import ext
from web.socket_sender import SenderStream, SocketSender

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# aiohttp's writes wait for the socket past 64 KiB buffered; then the engine's output channel fills
# up to its cap. The sender holds the same total for a client that stops reading.
TRANSPORT_HIGH_WATER = 64 << 10
_http_chunk = ext.load("sse_text").http_chunk


class SSEBody:
    def __init__(self, response: web.StreamResponse, transport: Any, sender: SocketSender | None = None,
                 stream: SenderStream | None = None) -> None:
        self.response = response
        self._transport = transport
        self._sender = sender
        self._stream = stream

    @classmethod
    async def open(cls, request: web.Request, sender: SocketSender | None, channel_cap_bytes: int) -> SSEBody:
        """channel_cap_bytes: the engine's cap of unread output per request (a client that stops reading
        is failed past it, whichever way the bytes go)."""
        response = web.StreamResponse(headers=SSE_HEADERS)
        chunked = request.version >= HttpVersion11
        if chunked:
            response.enable_chunked_encoding()
        await response.prepare(request)
        if sender is None or not chunked:
            return cls(response, request.transport)
        await response.write(b"")  # the headers go out now (aiohttp holds them for the first body write)
        return cls(response, request.transport, sender, sender.open(request.transport, channel_cap_bytes + TRANSPORT_HIGH_WATER))

    @property
    def via_sender(self) -> bool:
        return self._stream is not None

    async def write(self, data: bytes) -> None:
        """Raises ConnectionResetError once the client is gone."""
        if self._stream is None:
            if data:
                await self.response.write(data)
        else:
            self.send(data)

    def send(self, data: bytes) -> None:
        """`write` without waiting, through the sender only (see via_sender)."""
        if data:  # per streamed delta: no asserts here (via_sender says whether there is a stream)
            self._stream.write(_http_chunk(data))  # type: ignore[union-attr]

    def chunk_writer(self) -> Callable[[bytes], None]:
        """`send` for bytes already framed as one HTTP chunk, through the sender only (see via_sender)."""
        return self._stream.write  # type: ignore[union-attr]

    async def finish(self) -> None:
        """Everything written reached the socket, then the response ends (a client that hung up at the
        very end changes nothing: the request is complete)."""
        if self._stream is not None:
            assert self._sender is not None
            try:
                await self._sender.close(self._stream)
            except ConnectionResetError:
                self.abandon()
                return
            except BaseException:
                self.abandon()
                raise
            self._stream = None
        await self.response.write_eof()

    def abandon(self) -> None:
        """The stream failed or was cancelled. Through the sender, unsent bytes are discarded, so the
        connection is closed too: its chunked framing may be cut mid-chunk, and it must not be reused."""
        if self._stream is not None:
            assert self._sender is not None
            self._sender.drop(self._stream)
            self._stream = None
            self.response.force_close()
            if self._transport is not None:
                self._transport.close()
