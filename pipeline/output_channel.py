"""A request's output channel: the stream stage pushes, the client side pulls.

Pushing never waits. Deltas that the reader has not taken yet are merged per sample, so a slow
reader receives fewer, larger deltas and never slows the batch. Past `cap_bytes` of unread text
the channel reports an overflow and the engine aborts that request alone.
"""
from __future__ import annotations

import asyncio

from pipeline.request import OutputDelta


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
        """Queue a delta; returns False when the unread output passed the cap (caller aborts)."""
        if self.finished:
            return True
        pending = self._pending.get(delta.index)
        if pending is None:
            self._pending[delta.index] = delta
        else:
            pending.merge(delta)
        if delta.finish_reason is not None:
            self._finished.add(delta.index)
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

    async def next_batch(self) -> list[OutputDelta]:
        """Wait for output; returns [] once everything was delivered. Raises the channel's error."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            if len(self._finished) == self.num_samples:
                return []
            self._ready.clear()
            await self._ready.wait()
        batch = [self._pending[i] for i in sorted(self._pending)]
        self._pending.clear()
        self._pending_bytes = 0
        return batch
