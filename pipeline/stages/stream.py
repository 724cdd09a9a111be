"""The stream stage: delivers deltas into each request's output channel without ever waiting.

A reader that falls behind gets merged deltas; one that falls past the channel's byte cap has its
request aborted with an error, which frees its sequence without touching anyone else's.
"""
from __future__ import annotations

import time

from pipeline.output_channel import push_all
from pipeline.request import CancelReason, OutputDelta, Request
from pipeline.stage import Stage


class StreamStage(Stage[list[tuple[Request, OutputDelta]]]):
    name = "stream"

    async def run(self) -> None:
        while True:
            batch = await self.receive()
            started = time.monotonic()
            for request in push_all(batch):
                request.cancel.cancel(
                    CancelReason.ERROR,
                    f"output buffer exceeded {request.channel.cap_bytes} bytes: the client is not reading",
                )
            self.record(started, len(batch), len(batch))
