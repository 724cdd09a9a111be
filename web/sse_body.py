"""Where a streamed response's events go once its headers are out: the socket sender when it can
take the connection (web/socket_sender.py), else aiohttp's response.

Through the sender the body is framed here, as HTTP/1.1 chunked encoding (the header aiohttp
sent), and aiohttp writes the final empty chunk after the sender let go of the socket, so the
two never interleave.
"""
from __future__ import annotations

from aiohttp import web
from aiohttp.http import HttpVersion11

from web.socket_sender import SenderStream, SocketSender

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class SSEBody:
    def __init__(self, response: web.StreamResponse, sender: SocketSender | None, stream: SenderStream | None) -> None:
        self.response = response
        self._sender = sender
        self._stream = stream

    @classmethod
    async def open(cls, request: web.Request, sender: SocketSender | None) -> SSEBody:
        response = web.StreamResponse(headers=SSE_HEADERS)
        chunked = request.version >= HttpVersion11
        if chunked:
            response.enable_chunked_encoding()
        await response.prepare(request)
        if sender is None or not chunked:
            return cls(response, None, None)
        await response.write(b"")  # the headers go out now (aiohttp holds them for the first body write)
        return cls(response, sender, sender.open(request.transport))

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
        if data:
            assert self._sender is not None and self._stream is not None
            self._sender.write(self._stream, b"%x\r\n%b\r\n" % (len(data), data))

    async def finish(self) -> None:
        """Everything written reached the socket; the response is ended."""
        if self._stream is not None:
            assert self._sender is not None
            try:
                await self._sender.close(self._stream)
            finally:
                self.abandon()
        await self.response.write_eof()

    def abandon(self) -> None:
        """The stream failed or was cancelled: unsent bytes are discarded and the socket left to aiohttp."""
        if self._stream is not None:
            assert self._sender is not None
            self._sender.drop(self._stream)
            self._stream = None
