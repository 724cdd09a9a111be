"""What the prefill and decode stages share: the KV cache manager, seats, the executor, and how a
sequence's sampled token or its end is recorded and reported downstream."""
from __future__ import annotations

from typing import Any

from pipeline.memory.cache_manager import CacheManager
from pipeline.messages import StepTokensBuilder
from pipeline.request import FinishReason
from pipeline.runner.executor import DeviceExecutor
from pipeline.runner.sampler import SamplerOutput
from pipeline.runner.sampling_batch import SamplingRow
from pipeline.scheduler import SeatPool
from pipeline.sequence import Sequence
from pipeline.stage import Stage


OWN_GRAMMAR = object()  # sampling_row's default: the sequence's own grammar state


class DeviceStage(Stage):
    def __init__(
        self,
        inbox_size: int,
        *,
        cache: CacheManager,
        seats: SeatPool,
        executor: DeviceExecutor,
        detokenize: Stage,
    ) -> None:
        super().__init__(inbox_size)
        self.cache = cache  # the only way to KV memory: the stages never touch the pool
        self.seats = seats
        self.executor = executor
        self.detokenize = detokenize

    @staticmethod
    def sampling_row(seq: Sequence, seed: int | None = None, ahead: int = 0, grammar: Any = OWN_GRAMMAR,
                     grammar_previous_row: int = -1) -> SamplingRow:
        """The row that picks the sequence's next token; `ahead` tokens are still on the device."""
        request = seq.request
        num_output = len(seq.token_ids) - len(request.prompt_token_ids) + ahead
        # positional (the fields' order): keyword arguments cost this per-row constructor about twice as much
        return SamplingRow(request.params, (), (), request.eos_token_ids, seq.seed if seed is None else seed,
                           num_output, seq.grammar if grammar is OWN_GRAMMAR else grammar, grammar_previous_row,
                           seq.thinking.forced_token if seq.thinking is not None else None, seq.token_counts,
                           num_output)  # prompt/output ids stay empty: penalties read seq.token_counts

    def release(self, seq: Sequence) -> None:
        """Return a sequence's blocks to the cache (it keeps its seat)."""
        self.cache.free(seq)

    def finish(self, seq: Sequence, reason: FinishReason, events: StepTokensBuilder) -> None:
        """End a sequence: free its blocks and seat, and tell the detokenizer why."""
        seq.finish_reason = reason
        self.release(seq)
        self.seats.release(1)
        events.add(seq.request, seq.index, -1, reason, seq.num_output_tokens)

    def record_token(self, seq: Sequence, token: int, row: int, events: StepTokensBuilder) -> bool:
        """Append a sampled token; returns True if the sequence goes on."""
        reason = seq.append_token(token)
        events.add(seq.request, seq.index, token, reason, seq.num_output_tokens, row)
        if reason is None:
            return True
        seq.finish_reason = reason
        self.release(seq)
        self.seats.release(1)
        return False

    async def emit(self, events: StepTokensBuilder, output: SamplerOutput | None = None) -> None:
        if not len(events):
            return
        if output is None:
            message = events.build(None, None, None)
        else:
            message = events.build(output.logprobs, output.top_ids, output.top_logprobs)
        await self.detokenize.put(message)
