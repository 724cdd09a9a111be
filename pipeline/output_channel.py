"""A request's output channel: the stream stage pushes, the client side pulls or listens.

Pushing never waits. Pulled, deltas that the reader has not taken yet are merged per sample, so a
slow reader receives fewer, larger deltas and never slows the batch. Past `cap_bytes` of unread
text the channel reports an overflow and the engine aborts that request alone.

Listened (`deliver_to`), each delta goes straight to a callback as the stream stage pushes it: no
task wakes per token, which at batch 256 is most of what a streaming handler costs the event loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from pipeline.request import OutputDelta, Request

Listener = Callable[[OutputDelta], None]


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
        self._listener: Listener | None = None
        # the listener while a non-final delta goes straight to it (listened, not finished): push_all's fast path
        self.direct: Listener | None = None
        self._delivered: asyncio.Future[None] | None = None
        self.overflowed = False

    @property
    def finished(self) -> bool:
        """Every sample has delivered its final delta (or the channel failed)."""
        return self._error is not None or len(self._finished) == self.num_samples

    def push(self, delta: OutputDelta) -> bool:
        """Queue (or hand to the listener) a delta; False when the unread output passed the cap (caller aborts).
        (The stream stage's push_all hands a listened non-final delta to the listener itself.)"""
        if self.finished:
            return True
        if delta.finish_reason is not None:
            self._finished.add(delta.index)
            if self.finished:
                self.direct = None
        if self._listener is not None:
            self._deliver(delta)
            return True
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
            self.direct = None
            self._ready.set()
            if self._delivered is not None and not self._delivered.done():
                self._delivered.set_exception(error)

    async def next_delta(self) -> OutputDelta | None:
        """The lowest sample's unread output (merged); None once everything was delivered. Raises the
        channel's error. One delta at a time, so the reader holds nothing when it starts listening."""
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

    def deliver_to(self, listener: Listener) -> asyncio.Future[None]:
        """From now on each delta goes straight to `listener`, called by the stream stage as it pushes
        (so it must not block), the unread ones first. The future is done once every sample delivered
        its final delta; it fails with the channel's error, or with what the listener raised (which
        also fails the channel: the reader then closes the request)."""
        self._listener = listener
        self._delivered = asyncio.get_running_loop().create_future()
        if self._error is not None:
            self._delivered.set_exception(self._error)
            return self._delivered
        pending = [self._pending[index] for index in sorted(self._pending)]
        self._pending.clear()
        self._pending_bytes = 0
        for delta in pending:
            self._deliver(delta)
        if not pending and self.finished:
            self._delivered.set_result(None)
        if self._listener is not None and not self.finished:
            self.direct = self._listener
        return self._delivered

    def stop_delivering(self) -> None:
        """Back to pulling (the listener's reader was cancelled)."""
        self._listener = self.direct = None

    def _deliver(self, delta: OutputDelta) -> None:
        try:
            self._listener(delta)  # type: ignore[misc]
        except Exception as error:  # noqa: BLE001 - the listener's failure is its reader's, not the stage's
            self._listener_failed(error)
            return
        # only a final delta can finish the channel here (a failure resolves the future in fail())
        if delta.finish_reason is not None and self.finished and not self._delivered.done():  # type: ignore[union-attr]
            self._delivered.set_result(None)  # type: ignore[union-attr]

    def _listener_failed(self, error: Exception) -> None:
        self._listener = self.direct = None
        self.fail(error)


def push_all(deltas: list[tuple[Request, OutputDelta]]) -> list[Request]:
    """Push a step's deltas into their requests' channels; returns the requests whose channel passed
    its cap (the caller aborts them). A listened channel's non-final delta goes straight to its
    listener here: at batch 256 this runs 256 times per step, and the push call alone was a tenth of
    the stream stage's cost."""
    overflowed: list[Request] = []
    for request, delta in deltas:
        channel = request.channel
        if channel is None:
            continue
        direct = channel.direct
        if direct is not None and delta.finish_reason is None:
            try:
                direct(delta)
            except Exception as error:  # noqa: BLE001 - the listener's failure is its reader's, not the stage's
                channel._listener_failed(error)
        elif not channel.push(delta):
            overflowed.append(request)
    return overflowed
