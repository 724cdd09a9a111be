"""The decode stage: the continuous batch. Every running sequence advances one token per step.

Steps run back to back while anything runs. Before each step it applies cancellations (the
sequence ends and frees its blocks at once; stopping is never just hiding output) and makes room
for every sequence's next token, preempting the latest arrival back to prefill when blocks run out.
"""
from __future__ import annotations

import time

from pipeline.messages import StepTokensBuilder
from pipeline.runner.step_plan import ScheduledChunk, StepPlan
from pipeline.scheduler import blocks_to_grow, decode_victim
from pipeline.sequence import Sequence
from pipeline.stage import Stage
from pipeline.stages.device_stage import DeviceStage


class DecodeStage(DeviceStage):
    name = "decode"

    def __init__(self, inbox_size: int, **resources) -> None:
        super().__init__(inbox_size, **resources)
        self.running: list[Sequence] = []
        self.prefill: Stage | None = None  # where preempted sequences go; wired by the engine
        self.preemptions = 0

    async def run(self) -> None:
        while True:
            if not self.running:
                self.running.append(await self.receive())
            self.running.extend(self.receive_ready())
            events = StepTokensBuilder()
            self._reap_cancelled(events)
            await self._make_room()
            if not self.running:
                await self.emit(events)
                continue
            await self._step(events)

    def _reap_cancelled(self, events: StepTokensBuilder) -> None:
        keep: list[Sequence] = []
        for seq in self.running:
            reason = seq.cancel_reason()
            if reason is None:
                keep.append(seq)
            else:
                self.finish(seq, reason, events)
        self.running = keep

    async def _make_room(self) -> None:
        """Give every running sequence the blocks its next tokens need, preempting if necessary."""
        block_size = self.pool.block_size
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running:
                continue  # preempted below while making room for an earlier arrival
            needed = blocks_to_grow(seq, block_size)
            while needed > self.pool.num_free:
                victim = decode_victim(self.running)
                await self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running and needed:
                seq.block_ids.extend(self.pool.allocate(needed))

    async def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV, keep the tokens and the seat, go back to prefill."""
        self.running.remove(seq)
        self.release(seq)
        seq.num_samples = 1
        seq.preemptions += 1
        self.preemptions += 1
        assert self.prefill is not None
        await self.prefill.put(seq)

    async def _step(self, events: StepTokensBuilder) -> None:
        started = time.monotonic()
        batch = self.running
        plan = StepPlan([
            ScheduledChunk(
                token_ids=seq.token_ids[seq.num_computed:],
                start_pos=seq.num_computed,
                block_ids=list(seq.block_ids),
                rows=[self.sampling_row(seq)],
            )
            for seq in batch
        ])
        output = await self.executor.submit(plan)
        tokens = output.token_ids.tolist()
        still_running: list[Sequence] = []
        for row, seq in enumerate(batch):
            seq.num_computed = len(seq.token_ids)
            if self.record_token(seq, tokens[row], row, events):
                still_running.append(seq)
        self.running = still_running
        self.record(started, len(batch), len(batch))
        await self.emit(events, output)
