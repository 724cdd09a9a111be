"""The decode stage: the continuous batch. Every running sequence advances one token per step.

Steps run back to back while anything runs, one step ahead: step N+1 is launched before the host
reads step N's tokens, feeding them to N+1 on the device, so the host's bookkeeping (and the
detokenizer's, and the streams') hides behind the device's work. A sequence that turns out to end
at step N wasted one row of step N+1; that row is dropped when it arrives. Requests whose next
token depends on the values of earlier ones on the host (penalties, min_tokens still pending)
make the stage wait for step N before launching N+1.

Before each launch it applies cancellations (the sequence ends and frees its blocks at once;
stopping is never just hiding output) and makes room for every sequence's next token, preempting
the latest arrival back to prefill when blocks run out (after waiting for the step in flight).
Freeing blocks a launched step still writes is safe: every later use of a block is a later step on
the same device stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.messages import StepTokensBuilder
from pipeline.runner.executor import LaunchedStep
from pipeline.runner.sampler import SamplerOutput
from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
from pipeline.scheduler import decode_victim
from pipeline.sequence import Sequence
from pipeline.stage import Stage
from pipeline.stages.device_stage import OWN_GRAMMAR, DeviceStage


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose tokens the host has not read yet."""

    batch: list[Sequence]  # row i sampled batch[i]'s next token
    step: LaunchedStep
    launched_at: float
    rows: dict[int, int]  # seq_id -> row


def _last_token_in_flight(seq: Sequence) -> bool:
    """The token the step in flight picks for `seq` surely ends it (its length limit)."""
    return len(seq.token_ids) + 1 >= seq.request.max_total_tokens


class DecodeStage(DeviceStage):
    name = "decode"

    def __init__(self, inbox_size: int, *, run_ahead: bool = True, **resources) -> None:
        super().__init__(inbox_size, **resources)
        self.running: list[Sequence] = []
        self.prefill: Stage | None = None  # where preempted sequences go; wired by the engine
        self.run_ahead = run_ahead
        self.preemptions = 0
        self.steps_ahead = 0  # steps launched while the previous one was still in flight
        self.in_flight: InFlightStep | None = None  # the launched step whose tokens are unread

    async def run(self) -> None:
        while True:
            in_flight = self.in_flight
            if not self.running and in_flight is None:
                self.running.append(await self.receive())
            self.running.extend(self.receive_ready())
            events = StepTokensBuilder()
            output: SamplerOutput | None = None
            can_run_ahead = self.run_ahead and not self._reap_cancelled(events)
            if in_flight is not None and not can_run_ahead:
                output = await self._complete(in_flight, events)
                in_flight = None
            launched: InFlightStep | None = None
            if self.running:
                if not await self._make_room(in_flight):  # waiting for the step in flight freed nothing
                    assert in_flight is not None
                    output = await self._complete(in_flight, events)
                    in_flight = None
                    await self._make_room(None)
                launched = self._launch(in_flight)
            if in_flight is not None:
                output = await self._complete(in_flight, events)
            self.in_flight = launched
            await self.emit(events, output)

    def _reap_cancelled(self, events: StepTokensBuilder) -> bool:
        """Finish the cancelled sequences; returns whether a remaining one reads its own tokens (then
        the stage may not run ahead). One pass, per sequence per step: two cheap screens first (a
        set flag, and what could make a sequence read its tokens: a thinking budget, penalties, which
        come with token counts, or min_tokens), the exact checks only past them."""
        keep: list[Sequence] = []
        reads_own_tokens = False
        for seq in self.running:
            request = seq.request
            flag = request.cancel
            if flag.reason is not None or flag.children:
                reason = seq.cancel_reason()
                if reason is not None:
                    self.finish(seq, reason, events)
                    continue
            keep.append(seq)
            if (seq.thinking is not None or seq.token_counts is not None or request.params.min_tokens) \
                    and seq.reads_own_tokens:
                reads_own_tokens = True
        self.running = keep
        return reads_own_tokens

    async def _make_room(self, in_flight: InFlightStep | None) -> bool:
        """Give every running sequence the blocks its next token needs, preempting if necessary.

        A sequence asks the cache for slots for its pending tokens; one with a row in the step in
        flight also for a lookahead of 1, the token that step samples on the device and the next
        step feeds from there (none when that token surely ends it: nothing is launched for it).
        With a step in flight it only allocates when everything fits; otherwise it returns False
        and the caller waits for that step first (its finished sequences may free enough).
        """
        cache = self.cache
        if in_flight is not None:
            rows = in_flight.rows
            block_size = cache.block_size
            wants: list[tuple[Sequence, int]] = []  # (sequence, lookahead)
            total = 0
            for seq in self.running:
                if len(seq.token_ids) + 1 <= len(seq.block_ids) * block_size:
                    continue  # the screen: a sequence can only need a block when its next token's is full
                if seq.seq_id not in rows:
                    ahead = 0
                elif _last_token_in_flight(seq):
                    continue
                else:
                    ahead = 1
                if n := cache.blocks_needed(seq, seq.num_pending, ahead):
                    wants.append((seq, ahead))
                    total += n
            if total > cache.num_free:
                return False
            for seq, ahead in wants:  # they fit: all of them were counted above
                if not cache.allocate_slots(seq, seq.num_pending, ahead):
                    raise RuntimeError("the cache refused blocks it had free")
            return True
        preempted: set[int] = set()
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.seq_id in preempted:
                continue  # preempted below while making room for an earlier arrival
            while not cache.allocate_slots(seq, seq.num_pending):  # all or nothing: preempt until it fits
                victim = decode_victim(self.running)
                await self._preempt(victim)
                preempted.add(victim.seq_id)
                if victim is seq:
                    break
        return True

    async def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV, keep the tokens and the seat, go back to prefill."""
        self.running.remove(seq)
        self.release(seq)
        seq.num_samples = 1
        seq.preemptions += 1
        self.preemptions += 1
        assert self.prefill is not None
        await self.prefill.put(seq)

    def _launch(self, in_flight: InFlightStep | None) -> InFlightStep | None:
        batch: list[Sequence] = []
        chunks: list[ScheduledChunk] = []
        rows = in_flight.rows if in_flight is not None else {}
        for seq in self.running:
            row = rows.get(seq.seq_id, -1)
            num_tokens = len(seq.token_ids)
            if row >= 0:  # its token is still on the device: feed it from there
                if _last_token_in_flight(seq):
                    continue
                # positional arguments: this runs per sequence per step, and keywords cost more
                chunk = ScheduledChunk([0], num_tokens, seq.block_ids, [self.sampling_row(seq, None, 1, OWN_GRAMMAR, row)], row)
            else:
                chunk = ScheduledChunk(seq.token_ids[seq.num_computed:], seq.num_computed, seq.block_ids,
                                       [self.sampling_row(seq)])
            batch.append(seq)
            chunks.append(chunk)
        if not batch:
            return None
        self.steps_ahead += in_flight is not None
        step = self.executor.launch(build_step_plan(chunks, self.cache.block_size), lane=self.name)
        return InFlightStep(batch, step, time.monotonic(), {seq.seq_id: i for i, seq in enumerate(batch)})

    async def _complete(self, in_flight: InFlightStep, events: StepTokensBuilder) -> SamplerOutput:
        """Read a step's tokens and record them; rows of sequences that ended meanwhile are dropped."""
        output = await self.executor.fetch(in_flight.step)
        tokens = output.token_ids.tolist()
        for row, seq in enumerate(in_flight.batch):
            if seq.finish_reason is not None:
                continue  # ended by the previous step or cancelled while this one ran
            seq.num_computed += 1
            self.record_token(seq, tokens[row], row, events)
        self.running = [seq for seq in self.running if seq.finish_reason is None]
        batch_size = len(in_flight.batch)
        self.record(in_flight.launched_at, batch_size, batch_size)
        return output
