"""A request's output channel: the stream stage pushes, the request's reader pulls.

Pushing never waits. Deltas that the reader has not taken yet are merged per sample, so a slow
reader receives fewer, larger deltas (one write per stream per step at most) and never slows the
batch. Past `cap_bytes` of unread text the channel reports an overflow and the engine aborts that
request alone.
"""
from __future__ import annotations

import asyncio

from pipeline.request import OutputDelta, Request


class OutputChannelOverflow(RuntimeError):
    pass


class OutputChannel:
    def __init__(self, num_samples: int, cap_bytes: int) -> None:
        self.num_samples = num_samples
        self.cap_bytes = cap_bytes
        self._pending: dict[int, OutputDelta] = {}
        self._pending_bytes = 0
        self._finished: set[int] = set()
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.overflowed = False

    @property
    def finished(self) -> bool:
        """Every sample has delivered its final delta (or the channel failed)."""
        return self._error is not None or len(self._finished) == self.num_samples

    def push(self, delta: OutputDelta) -> bool:
        """Queue a delta; False when the unread output passed the cap (the caller aborts the request)."""
        if self.finished:
            return True
        if delta.finish_reason is not None:
            self._finished.add(delta.index)
        pending = self._pending.get(delta.index)
        if pending is None:
            self._pending[delta.index] = delta
        else:
            pending.merge(delta)
        self._pending_bytes += len(delta.text.encode())
        self._ready.set()
        if self._pending_bytes > self.cap_bytes and not self.overflowed:
            self.overflowed = True
            return False
        return True

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            self._ready.set()

    async def next_delta(self) -> OutputDelta | None:
        """The lowest sample's unread output (merged); None once everything was delivered. Raises the
        channel's error."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            if len(self._finished) == self.num_samples:
                return None
            self._ready.clear()
            await self._ready.wait()
        delta = self._pending.pop(min(self._pending))
        self._pending_bytes = self._pending_bytes - len(delta.text.encode()) if self._pending else 0
        return delta


def push_all(deltas: list[tuple[Request, OutputDelta]]) -> list[Request]:
    """Push a step's deltas into their requests' channels; returns the requests whose channel passed
    its cap (the caller aborts them)."""
    overflowed: list[Request] = []
    for request, delta in deltas:
        channel = request.channel
        if channel is not None and not channel.push(delta):
            overflowed.append(request)
    return overflowed
