"""The one place a device step is composed.

The prefill and decode stages own their sequences (admission, first tokens, forks, recording tokens,
finishing); what goes into each step is decided here, by `scheduler.plan_step`, from both stages'
offers at once: every decode row, then prompt chunks under what is left of the one token budget,
with one preemption rule. Decode drives the steps while it has sequences (it runs back to back, one
step ahead); a prompt waiting then joins decode's next step. With nothing decoding, prefill asks for
a step itself. Either way the same state gives the same step.

The planner applies a decision through the stages' own methods (each mutates only its sequences):
preemptions first, then the cache's slots for every row, then one plan and one launch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pipeline.live_stats import LiveStats
from pipeline.memory.cache_manager import CacheManager
from pipeline.runner.executor import DeviceExecutor, LaunchedStep
from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
from pipeline.scheduler import PromptChunk, RunningRow, SeatPool, StepDecision, StepLimits, WaitingPrompt, plan_step
from pipeline.tracing import TRACE_OFF, TraceRecorder

if TYPE_CHECKING:
    from pipeline.sequence import Sequence


class RowLane(Protocol):
    """The decode stage as the planner sees it."""

    def offer_rows(self, exact_release: bool = False) -> list[RunningRow]: ...

    def preempt_now(self, seq_id: int) -> Sequence: ...

    def build_rows(self, seq_ids: tuple[int, ...]) -> tuple[list[Sequence], list[ScheduledChunk]]: ...


class PromptLane(Protocol):
    """The prefill stage as the planner sees it."""

    def offer_prompts(self, exact_release: bool = False) -> list[WaitingPrompt]: ...

    def preempt_now(self, seq_id: int) -> None: ...

    def requeue(self, seq: Sequence) -> None: ...

    def build_chunks(self, chunks: tuple[PromptChunk, ...]) -> list[ScheduledChunk]: ...

    def granted(self, step: LaunchedStep, first_row: int) -> None: ...


@dataclass(slots=True)
class ComposedStep:
    step: LaunchedStep
    batch: list[Sequence]  # decode's rows, in row order (rows 0 .. len(batch) - 1 of the step)


WAIT_FOR_STEP = object()  # compose()'s answer when decode must read its step in flight first


class StepPlanner:
    trace: TraceRecorder = TRACE_OFF  # the engine's recorder (pipeline/tracing.py): each step's makeup

    def __init__(self, *, cache: CacheManager, seats: SeatPool, executor: DeviceExecutor, token_budget: int,
                 live: LiveStats | None = None) -> None:
        self.cache = cache
        self.live = live  # the dashboard's step ring: told of every launch
        self.seats = seats
        self.executor = executor
        self.token_budget = token_budget
        self.decode: RowLane | None = None
        self.prefill: PromptLane | None = None
        self.decode_drives = False  # decode has sequences: it launches every step
        self.mixed_steps = 0  # steps holding decode rows and prompt chunks
        self._listeners: list[Callable[[], None]] = []

    def bind(self, *, decode: RowLane, prefill: PromptLane) -> None:
        self.decode, self.prefill = decode, prefill

    def on_change(self, listener: Callable[[], None]) -> None:
        """Called when decode stops driving (a waiting prompt must ask for its own step)."""
        self._listeners.append(listener)

    def set_decode_drives(self, drives: bool) -> None:
        if self.decode_drives and not drives:
            for listener in self._listeners:
                listener()
        self.decode_drives = drives

    def decide(self, rows_in_flight: bool) -> tuple[StepDecision, list[RunningRow]]:
        assert self.decode is not None and self.prefill is not None
        rows = self.decode.offer_rows()
        prompts = self.prefill.offer_prompts()
        limits = StepLimits(self.token_budget, self.cache.num_free, self.cache.block_size, self.seats.available,
                            max(1, self.cache.capacity // 100), rows_in_flight)
        decision = plan_step(rows, prompts, limits)
        if decision.preempt:  # a victim gives back only the blocks it holds alone: plan again with those counts
            rows = self.decode.offer_rows(exact_release=True)
            prompts = self.prefill.offer_prompts(exact_release=True)
            decision = plan_step(rows, prompts, limits)
        return decision, rows

    def compose(self, rows_in_flight: bool) -> ComposedStep | object | None:
        """Plan, apply and launch one step. None: nothing fits (wait for memory); WAIT_FOR_STEP: the
        decode rows fit only after the step in flight is read."""
        assert self.decode is not None and self.prefill is not None
        decision, rows = self.decide(rows_in_flight)
        if decision.wait_for_step:
            return WAIT_FOR_STEP
        running = {r.seq_id for r in rows}
        for seq_id in decision.preempt:
            if seq_id in running:  # back to prefill, to be recomputed: the sequence moves, not a copy
                self.prefill.requeue(self.decode.preempt_now(seq_id))
            else:
                self.prefill.preempt_now(seq_id)
        batch, chunks = self.decode.build_rows(decision.rows)
        prompt_chunks = self.prefill.build_chunks(decision.chunks)
        if not chunks and not prompt_chunks:
            return None
        self.mixed_steps += bool(chunks) and bool(prompt_chunks)
        first_prompt_row = sum(len(c.rows) for c in chunks)
        everything = chunks + prompt_chunks
        plan = build_step_plan(everything, self.cache.block_size, self.cache.state_slot_indices(everything),
                               self.cache.take_transfers(), self.cache.take_slot_changes())
        # Decode's lane: the next step's fed tokens are this step's rows, decode's first.
        step = self.executor.launch(plan, lane="decode" if chunks else "prefill")
        if self.trace.recording:
            self.trace.step_planned(step.number, step.lane, chunks, prompt_chunks, plan.num_tokens)
        if self.live is not None:
            self.live.step_launched(step, chunks, prompt_chunks, first_prompt_row)
        if prompt_chunks:
            self.prefill.granted(step, first_prompt_row)
        return ComposedStep(step, batch)
