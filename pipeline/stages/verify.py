"""The verify stage: where a step's drafts come from.

Decode hands it the sequences whose turn it is to draft, with how many drafts each may verify
(pipeline/spec/budget.py); it asks the drafter and hands the drafts back, and decode's next step scores them in
its verify rows, in the same forward as the other rows and prompt chunks (a verify row is a decode row with its
drafts after its last token). A host drafter guesses here on the event loop; a model drafter plans here and drafts
on the device thread, and where its drafts may stay there, the stage replies before they are made (promised
drafts, pipeline/spec/device_drafts.py). The stage keeps the statistics every stage keeps: requests in and out,
their wait, how long drafting took (for promised drafts, queueing them) and for how many sequences.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from pipeline.runner.executor import DeviceExecutor
from pipeline.sequence import Sequence
from pipeline.spec.device_drafts import DeviceDrafts
from pipeline.spec.drafter import Drafter, ModelDrafter
from pipeline.stage import Stage


@dataclass(slots=True)
class DraftRequest:
    wanted: list[tuple[Sequence, int]]  # each sequence that drafts, and up to how many drafts
    reply: asyncio.Future[list[list[int]] | DeviceDrafts]
    keep_on_device: bool  # a model drafter's drafts may stay on the device (pipeline/spec/device_drafts.py)


class VerifyStage(Stage[DraftRequest]):
    name = "verify"

    def __init__(self, inbox_size: int, *, drafter: Drafter | None, executor: DeviceExecutor) -> None:
        super().__init__(inbox_size)
        self.drafter = drafter
        self.executor = executor

    async def drafts(self, wanted: list[tuple[Sequence, int]],
                     keep_on_device: bool = False) -> list[list[int]] | DeviceDrafts:
        """Each sequence's drafts (decode awaits them before composing its step); with ``keep_on_device``, a model
        drafter's come as promised ``DeviceDrafts`` where every sequence drafts as many: their forwards are queued on
        the device thread and the reply comes at once, so decode plans its step while they run."""
        reply: asyncio.Future[list[list[int]] | DeviceDrafts] = asyncio.get_running_loop().create_future()
        await self.put(DraftRequest(wanted, reply, keep_on_device))
        return await reply

    async def run(self) -> None:
        while True:
            request = await self.receive()
            started = time.monotonic()
            try:
                drafter = self.drafter
                if drafter.on_device:
                    plan = drafter.plan(request.wanted)
                    width = drafter.uniform_width(plan) if request.keep_on_device else None
                    if width:
                        proposals = DeviceDrafts.pending(width)
                        self.executor.post(partial(_draft_into, drafter, plan, proposals))
                    else:
                        proposals = await self.executor.call(partial(drafter.draft, plan))
                else:
                    proposals = [drafter.propose(seq, k) for seq, k in request.wanted]
            except Exception as exc:  # delivered to decode, which fails its step as for a device error
                if not request.reply.done():
                    request.reply.set_exception(exc)
                continue
            if not request.reply.done():
                request.reply.set_result(proposals)
            self.record(started, len(request.wanted), 1)  # (batch: the sequences drafting)


def _draft_into(drafter: ModelDrafter, plan: Any, drafts: DeviceDrafts) -> None:
    """Device thread: fill promised drafts; a failure stays with them (the step that feeds them raises it)."""
    try:
        drafter.draft(plan, drafts)
    except Exception as exc:
        drafts.fail(exc)
