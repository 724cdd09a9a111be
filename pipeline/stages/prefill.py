"""The prefill stage: computes prompts (in chunks under the step's token budget) and picks each
sequence's first token, then hands the sequence to decode.

It owns sequences from admission until their prompt is in the KV cache: new requests from intake
and sequences that decode preempted for recompute. It serves them strictly in arrival order.
A request with n > 1 samples is prefilled once; its siblings share the prompt's full blocks.
"""
from __future__ import annotations

import asyncio
import time

from pipeline.messages import StepTokensBuilder
from pipeline.request import Request
from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
from pipeline.scheduler import PrefillChoice, WaitingGauge, plan_prefill, prefill_victims
from pipeline.sequence import Sequence, mix_seed, new_grammar_state
from pipeline.stage import Stage
from pipeline.stages.device_stage import DeviceStage


class PrefillStage(DeviceStage):
    name = "prefill"

    def __init__(self, inbox_size: int, *, waiting_gauge: WaitingGauge, token_budget: int,
                 decode: Stage, **resources) -> None:
        super().__init__(inbox_size, **resources)
        self.waiting_gauge = waiting_gauge
        self.token_budget = token_budget
        self.decode = decode
        self.waiting: list[Sequence] = []  # arrival order
        self.started: set[int] = set()  # seq_ids holding seats
        self._memory_freed = asyncio.Event()
        self.cache.add_free_listener(self._memory_freed.set)

    async def run(self) -> None:
        while True:
            for message in self.receive_ready():
                self._accept(message)
            events = StepTokensBuilder()
            self._reap_cancelled(events)
            await self.emit(events)
            if not self.waiting:
                self._accept(await self.receive())
                continue
            choices = self._plan()
            if choices:
                await self._step(choices)
            else:
                await self._wait_for_memory_or_messages()

    def _accept(self, message: Request | Sequence) -> None:
        if isinstance(message, Request):
            seq = Sequence.from_request(message)
        else:  # preempted by decode: it kept its seat
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
                seq.finish_reason = reason
                events.add(seq.request, seq.index, -1, reason, seq.num_output_tokens)
            for index in range(1, seq.num_samples):  # siblings not forked yet end with it
                events.add(seq.request, index, -1, reason, 0)
        self.waiting = keep

    def _plan(self) -> list[PrefillChoice]:
        decoding = self.seats.held - sum(s.num_samples for s in self.waiting if s.seq_id in self.started)
        budget = max(1, self.token_budget - decoding)
        watermark = max(1, self.cache.capacity // 100)
        plan = lambda: plan_prefill(  # noqa: E731
            self.waiting, started=self.started, token_budget=budget, free_blocks=self.cache.num_free,
            block_size=self.cache.block_size, seats_available=self.seats.available,
            watermark_blocks=watermark)
        choices = plan()
        if not choices:  # the head lacks memory: take it back from later arrivals still in prefill
            head = self.waiting[0]
            reserve = 0 if head.seq_id in self.started else watermark
            deficit = self.cache.blocks_needed(head, 1) + reserve - self.cache.num_free
            victims = prefill_victims(self.waiting, deficit, head) if deficit > 0 else []
            for victim in victims:
                self.release(victim)
            if victims:
                choices = plan()
        return choices

    async def _wait_for_memory_or_messages(self) -> None:
        self._memory_freed.clear()
        receive = asyncio.ensure_future(self.receive())
        freed = asyncio.ensure_future(self._memory_freed.wait())
        done, _ = await asyncio.wait({receive, freed}, return_when=asyncio.FIRST_COMPLETED)
        freed.cancel()
        if receive in done:
            self._accept(receive.result())
        else:
            receive.cancel()
            try:
                self._accept(await receive)  # it may have completed while being cancelled
            except asyncio.CancelledError:
                pass

    async def _step(self, choices: list[PrefillChoice]) -> None:
        started = time.monotonic()
        chunks: list[ScheduledChunk] = []
        sibling_grammars: dict[int, list] = {}  # seq_id -> grammar state of each sample (n > 1)
        for choice in choices:
            seq = choice.seq
            if choice.starts:
                self.seats.acquire(seq.num_samples)
                self.started.add(seq.seq_id)
                self.waiting_gauge.remove(seq.num_prompt_tokens)
            if choice.new_blocks and not self.cache.allocate_slots(seq, choice.num_tokens):
                raise RuntimeError(f"plan_prefill counted {choice.new_blocks} blocks the cache does not have")
            end = seq.num_computed + choice.num_tokens
            completes = end == len(seq.token_ids)
            rows = []
            if completes:
                request_seed = seq.request.params.seed or 0
                grammars = [seq.grammar] + [new_grammar_state(seq.request) for _ in range(1, seq.num_samples)]
                sibling_grammars[seq.seq_id] = grammars
                rows = [self.sampling_row(seq, seed=mix_seed(request_seed, i) if i else seq.seed,
                                          grammar=grammars[i]) for i in range(seq.num_samples)]
            chunks.append(ScheduledChunk(seq.token_ids[seq.num_computed:end], seq.num_computed,
                                         seq.block_ids, rows))
        output = await self.executor.submit(build_step_plan(chunks, self.cache.block_size), lane=self.name)
        tokens = output.token_ids.tolist()
        events = StepTokensBuilder()
        ready: list[Sequence] = []
        row = 0
        for choice in choices:
            seq = choice.seq
            seq.num_computed += choice.num_tokens
            if seq.num_pending:
                continue
            self.waiting.remove(seq)
            self.started.discard(seq.seq_id)
            ready.extend(self._complete(seq, tokens[row:row + seq.num_samples], row, events,
                                        sibling_grammars[seq.seq_id]))
            row += seq.num_samples
        self.record(started, len(choices), len(ready))
        await self.emit(events, output)
        for seq in ready:  # after the first tokens went downstream, so decode's come later
            await self.decode.put(seq)

    def _complete(self, seq: Sequence, tokens: list[int], first_row: int, events: StepTokensBuilder,
                  grammars: list) -> list[Sequence]:
        """The prompt is cached: record each sample's first token; siblings fork off the parent."""
        samples = [seq] + [seq.fork(i, self.cache.share_prompt(seq), self.cache.block_size, grammars[i])
                           for i in range(1, seq.num_samples)]
        seq.num_samples = 1
        return [sample for i, sample in enumerate(samples)
                if self.record_token(sample, tokens[i], first_row + i, events)]
