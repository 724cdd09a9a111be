"""A streamed response's body: SSE events written through aiohttp, which frames them (chunked
encoding on HTTP/1.1) and applies its flow control. The handler writes at most once per stream per
step: the engine's output channel merges whatever the handler has not read yet."""
from __future__ import annotations

from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class SSEBody:
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> SSEBody:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        return cls(response)

    async def write(self, data: bytes) -> None:
        """Raises ConnectionResetError once the client is gone."""
        if data:
            await self.response.write(data)

    async def finish(self) -> None:
        await self.response.write_eof()

    def abandon(self) -> None:
        """The stream failed or was cancelled mid-way: the connection must not be reused."""
        self.response.force_close()
