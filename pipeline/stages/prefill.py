"""The prefill stage: computes prompts (in chunks under the step's token budget) and picks each
sequence's first token, then hands the sequence to decode.

It owns sequences from admission until their prompt is in the KV cache: new requests from intake
and sequences that decode preempted for recompute. The step planner (pipeline/step_planner.py)
decides which of its prompts get a chunk in each step, strictly in arrival order; this stage offers
them, builds the chosen chunks, and records what comes back. While decode runs, its steps carry
the chunks; with nothing decoding, this stage asks for a step itself. One chunk step of its own is in
flight at a time. A request with n > 1 samples is prefilled once; its siblings share the prompt's
full blocks.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pipeline.messages import StepTokensBuilder
from pipeline.request import Request
from pipeline.runner.executor import LaunchedStep
from pipeline.runner.step_plan import ScheduledChunk
from pipeline.scheduler import PromptChunk, WaitingGauge, WaitingPrompt
from pipeline.sequence import Sequence, mix_seed, new_grammar_state
from pipeline.stage import Stage
from pipeline.stages.device_stage import DeviceStage
from pipeline.step_planner import StepPlanner


@dataclass(slots=True)
class _Grant:
    """This stage's chunks in a launched step, and where their rows start."""

    chunks: list[tuple[Sequence, int, list]]  # (sequence, tokens computed, grammar state of each sample)
    launched_at: float
    step: LaunchedStep | None = None
    first_row: int = 0


class PrefillStage(DeviceStage):
    name = "prefill"

    def __init__(self, inbox_size: int, *, waiting_gauge: WaitingGauge, planner: StepPlanner,
                 decode: Stage, **resources) -> None:
        super().__init__(inbox_size, **resources)
        self.waiting_gauge = waiting_gauge
        self.planner = planner
        self.decode = decode
        self.waiting: list[Sequence] = []  # arrival order
        self.started: set[int] = set()  # seq_ids holding seats
        self.grant: _Grant | None = None  # chunks of ours in a launched step, results unread
        self._wake = asyncio.Event()  # memory freed, a grant, or decode stopped driving
        self.cache.add_free_listener(self._wake.set)
        planner.on_change(self._wake.set)

    async def run(self) -> None:
        while True:
            for message in self.receive_ready():
                self._accept(message)
            events = StepTokensBuilder()
            self._reap_cancelled(events)
            await self.emit(events)
            if self.grant is not None and self.grant.step is not None:
                await self._complete(self.grant)
                continue
            self._wake.clear()
            if not self.waiting:  # a request, or a sequence decode gave back, will wake it
                await self._wait_for_wake_or_messages()
                continue
            if not self.planner.decode_drives:
                self.planner.compose(rows_in_flight=False)  # nothing decodes: a step of prompts alone
                if self.grant is not None:
                    continue
            await self._wait_for_wake_or_messages()

    # --- what the planner asks -------------------------------------------------------------------
    def offer_prompts(self, exact_release: bool = False) -> list[WaitingPrompt]:
        """The waiting prompts; with ``exact_release`` each also says how many of its blocks it holds alone (what
        preempting it gives back)."""
        if self.grant is not None:
            return []  # its chunks are in flight: the next ones are planned once they are read
        started = self.started
        for seq in self.waiting:  # a prompt holding nothing takes its cached prefix (a no-op once it holds blocks)
            if not seq.block_ids:
                self.cache.take_cached_prefix(seq)
        # a hybrid model's chunk stops at its prompt's last full block, where its state is snapshotted
        return [WaitingPrompt(seq.seq_id, seq.arrival, seq.num_computed,
                              min(seq.num_pending, self.cache.prompt_stop(seq) - seq.num_computed),
                              len(seq.block_ids), seq.num_samples, seq.seq_id in started,
                              self.cache.blocks_released(seq) if exact_release else None) for seq in self.waiting]

    def preempt_now(self, seq_id: int) -> None:
        """Give a later arrival's blocks back (it stays waiting, to be recomputed)."""
        self.release(next(seq for seq in self.waiting if seq.seq_id == seq_id))

    def requeue(self, seq: Sequence) -> None:
        """A sequence decode gave back (preempted): it keeps its seat and waits by its arrival."""
        self._accept(seq)
        self._wake.set()

    def build_chunks(self, chosen: tuple[PromptChunk, ...]) -> list[ScheduledChunk]:
        if not chosen:
            return []
        by_id = {seq.seq_id: seq for seq in self.waiting}
        grant = _Grant([], time.monotonic())
        chunks: list[ScheduledChunk] = []
        for choice in chosen:
            seq = by_id[choice.seq_id]
            if choice.starts:
                self.seats.acquire(seq.num_samples)
                self.started.add(seq.seq_id)
                self.waiting_gauge.remove(seq.num_prompt_tokens)
                self.cache.count_prefix_query(seq)
                seq.request.cached_prompt_tokens = seq.num_computed  # usage: prompt_tokens_details
                seq.request.scheduled_time = grant.launched_at  # its queue time ends (request spans, web/otel_spans.py)
            if not self.cache.allocate_slots(seq, choice.num_tokens):
                raise RuntimeError(f"the planner counted {choice.new_blocks} blocks the cache does not have")
            end = seq.num_computed + choice.num_tokens
            self.cache.snapshot_after_chunk(seq, end)
            rows, grammars = [], []
            if end == len(seq.token_ids):  # the prompt completes: pick each sample's first token
                request_seed = seq.request.params.seed or 0
                grammars = [seq.grammar] + [new_grammar_state(seq.request) for _ in range(1, seq.num_samples)]
                rows = [self.sampling_row(seq, seed=mix_seed(request_seed, i) if i else seq.seed,
                                          grammar=grammars[i]) for i in range(seq.num_samples)]
            chunks.append(ScheduledChunk(seq.token_ids[seq.num_computed:end], seq.num_computed, seq.block_ids, rows,
                                         state_slot=seq.state_slot))
            grant.chunks.append((seq, choice.num_tokens, grammars))
        self.grant = grant
        return chunks

    def granted(self, step: LaunchedStep, first_row: int) -> None:
        assert self.grant is not None
        self.grant.step, self.grant.first_row = step, first_row
        self._wake.set()

    def _accept(self, message: Request | Sequence) -> None:
        if isinstance(message, Request):
            seq = Sequence.from_request(message)
        else:  # preempted out of decode: it kept its seat
            seq = message
            self.started.add(seq.seq_id)
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.arrival)

    def _reap_cancelled(self, events: StepTokensBuilder) -> None:
        keep: list[Sequence] = []
        for seq in self.waiting:
            reason = seq.cancel_reason()
            if reason is None:
                keep.append(seq)
                continue
            if seq.seq_id in self.started:
                self.started.discard(seq.seq_id)
                self.seats.release(seq.num_samples - 1)  # finish() releases the last one
                self.finish(seq, reason, events)
            else:
                self.waiting_gauge.remove(seq.num_prompt_tokens)
                self.release(seq)  # it may hold cached prefix blocks taken while it waited
                seq.finish_reason = reason
                events.add(seq.request, seq.index, -1, reason, seq.num_output_tokens)
            for index in range(1, seq.num_samples):  # siblings not forked yet end with it
                events.add(seq.request, index, -1, reason, 0)
        self.waiting = keep

    async def _wait_for_wake_or_messages(self) -> None:
        receive = asyncio.ensure_future(self.receive())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait({receive, woken}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the stage stops: its two waits go with it
            receive.cancel()
            woken.cancel()
            raise
        woken.cancel()
        if receive in done:
            self._accept(receive.result())
        else:
            receive.cancel()
            try:
                self._accept(await receive)  # it may have completed while being cancelled
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the stage itself is being stopped, not just the receive


    async def _complete(self, grant: _Grant) -> None:
        """Read our rows of the step; completed prompts record their first tokens and go to decode."""
        assert grant.step is not None
        output = await self.executor.fetch(grant.step)
        self.grant = None
        tokens = output.token_ids.tolist()
        events = StepTokensBuilder()
        ready: list[Sequence] = []
        row = grant.first_row
        for seq, num_tokens, grammars in grant.chunks:
            if seq.finish_reason is not None or seq not in self.waiting:
                row += len(grammars)
                continue  # cancelled while the step ran
            seq.num_computed += num_tokens
            self.cache.register_computed(seq)
            if seq.num_pending:
                continue
            self.waiting.remove(seq)
            self.started.discard(seq.seq_id)
            ready.extend(self._complete_prompt(seq, tokens[row:row + seq.num_samples], row, events, grammars))
            row += len(grammars)
        self.record(grant.launched_at, len(grant.chunks), len(ready))
        await self.emit(events, output)
        for seq in ready:  # after the first tokens went downstream, so decode's come later
            await self.decode.put(seq)

    def _complete_prompt(self, seq: Sequence, tokens: list[int], first_row: int, events: StepTokensBuilder,
                  grammars: list) -> list[Sequence]:
        """The prompt is cached: record each sample's first token; siblings fork off the parent."""
        samples = [seq] + [seq.fork(i, self.cache.share_prompt(seq), self.cache.block_size, grammars[i])
                           for i in range(1, seq.num_samples)]
        seq.num_samples = 1
        return [sample for i, sample in enumerate(samples)
                if self.record_token(sample, tokens[i], first_row + i, events)]
