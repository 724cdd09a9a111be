"""Scheduling policy: who runs next, under which token budget, and who is preempted.

Pure policy over plain values (no torch, no asyncio), so it can be reasoned about and tested on
its own. `plan_step` composes every device step from the stages' offers (pipeline/step_planner.py
applies it); the limits the stages share (seats, waiting admission) are small counters defined here.

Progress guarantee with a tiny pool: memory always goes to the earlier arrival. A row or the head
prompt that lacks blocks takes them from the latest arrivals holding blocks that came after it, and
prompts start strictly in arrival order. So the oldest unfinished sequence always gets memory,
provided one sequence fits the pool on its own (the engine caps max_model_len by the pool's capacity).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SeatPool:
    """Limit on sequences holding device state at once (max_num_seqs)."""

    capacity: int
    held: int = 0

    @property
    def available(self) -> int:
        return self.capacity - self.held

    def acquire(self, count: int) -> bool:
        if count > self.available:
            return False
        self.held += count
        return True

    def release(self, count: int = 1) -> None:
        if count > self.held:
            raise ValueError("released more seats than held")
        self.held -= count


@dataclass(slots=True)
class WaitingGauge:
    """Requests admitted but not yet started; intake refuses new ones past the limits (503)."""

    max_requests: int
    max_tokens: int
    requests: int = 0
    tokens: int = 0

    def refusal(self, prompt_tokens: int) -> str | None:
        if self.requests + 1 > self.max_requests:
            return f"too many waiting requests ({self.requests}, limit {self.max_requests})"
        if self.tokens + prompt_tokens > self.max_tokens:
            return f"too many waiting prompt tokens ({self.tokens} + {prompt_tokens}, limit {self.max_tokens})"
        return None

    def add(self, prompt_tokens: int) -> None:
        self.requests += 1
        self.tokens += prompt_tokens

    def remove(self, prompt_tokens: int) -> None:
        self.requests -= 1
        self.tokens -= prompt_tokens


@dataclass(frozen=True, slots=True)
class RunningRow:
    """A decoding sequence's part of the next step, as the planner sees it."""

    seq_id: int
    arrival: tuple[int, int]
    num_tokens: int  # tokens it feeds (1; later 1 + its drafts)
    blocks_needed: int  # blocks to add for them and its lookahead
    blocks_held: int  # what preempting it gives back: blocks it holds alone (a shared prefix block stays)


@dataclass(frozen=True, slots=True)
class WaitingPrompt:
    """A sequence whose prompt (or, after preemption, prompt and output) is still to be computed."""

    seq_id: int
    arrival: tuple[int, int]
    num_computed: int
    num_pending: int
    blocks_held: int
    num_samples: int  # seats it takes when it starts (n for a fresh parent)
    seated: bool  # started before: holds its seats (a preempted sequence keeps them)
    blocks_released: int | None = None  # what preempting it gives back (None: blocks_held, none of them shared)

    @property
    def gives_back(self) -> int:
        return self.blocks_held if self.blocks_released is None else self.blocks_released


@dataclass(frozen=True, slots=True)
class StepLimits:
    token_budget: int
    free_blocks: int
    block_size: int
    free_seats: int
    watermark_blocks: int  # kept free when a new sequence starts, for running ones to grow into
    rows_in_flight: bool  # a launched step still writes the running rows' blocks: do not preempt them


@dataclass(frozen=True, slots=True)
class PromptChunk:
    seq_id: int
    num_tokens: int
    new_blocks: int
    starts: bool  # its first chunk: it takes its seats now


@dataclass(frozen=True, slots=True)
class StepDecision:
    rows: tuple[int, ...]  # running rows in the step, in arrival order
    chunks: tuple[PromptChunk, ...]  # prompt chunks in the step, in arrival order
    preempt: tuple[int, ...]  # sequences that give their blocks back first (recomputed later)
    # the running rows fit only if some of them are preempted, and a step in flight still writes them
    wait_for_step: bool = False


def plan_step(running: list[RunningRow], waiting: list[WaitingPrompt], limits: StepLimits) -> StepDecision:
    """Compose one device step: every running row, then prompt chunks in arrival order under what is
    left of the token budget. When memory is short, the sequence being served takes blocks from the
    latest arrivals holding blocks (running or waiting) that arrived after it, never from earlier
    ones; a prompt that cannot start stops the scan (no overtaking). Pure: the same inputs give the
    same step."""
    free = limits.free_blocks
    holders: dict[int, tuple[tuple[int, int], int, bool]] = {  # seq_id -> (arrival, blocks held, running)
        w.seq_id: (w.arrival, w.gives_back, False) for w in waiting if w.blocks_held}
    holders.update((r.seq_id, (r.arrival, r.blocks_held, True)) for r in running if r.blocks_held)
    preempted: list[int] = []

    def take_back(arrival: tuple[int, int], deficit: int, allow_running: bool) -> list[int] | None:
        """Latest later arrivals freeing at least `deficit` blocks; None when they cannot."""
        victims, freed = [], 0
        for seq_id, (when, held, is_running) in sorted(holders.items(), key=lambda h: h[1][0], reverse=True):
            if freed >= deficit or when <= arrival:
                break
            if is_running and not allow_running:
                return None
            if not held:  # every block it holds is shared: preempting it frees nothing
                continue
            victims.append(seq_id)
            freed += held
        return victims if freed >= deficit else None

    def preempt(victims: list[int]) -> int:
        freed = 0
        for seq_id in victims:
            freed += holders.pop(seq_id)[1]
            preempted.append(seq_id)
        return freed

    rows: list[RunningRow] = []
    for row in sorted(running, key=lambda r: r.arrival):
        if row.seq_id in preempted:
            continue
        if row.blocks_needed > free:
            victims = take_back(row.arrival, row.blocks_needed - free, not limits.rows_in_flight)
            if victims is None:  # only running rows could make room: while a step runs, read it first
                if limits.rows_in_flight:
                    return StepDecision((), (), (), wait_for_step=True)
                victims = [row.seq_id]  # nobody later holds enough: this row itself goes back
            free += preempt(victims)
            if row.seq_id in preempted:
                continue
        rows.append(row)
        free -= row.blocks_needed
    rows = [r for r in rows if r.seq_id not in preempted]

    budget = max(1, limits.token_budget - sum(r.num_tokens for r in rows))
    seats = limits.free_seats
    chunks: list[PromptChunk] = []
    for prompt in sorted(waiting, key=lambda w: w.arrival):
        if budget <= 0 or prompt.seq_id in preempted:
            break
        starts = not prompt.seated
        if starts and prompt.num_samples > seats:
            break
        reserve = limits.watermark_blocks if starts else 0
        held = prompt.blocks_held if prompt.seq_id in holders else 0

        def fit() -> int:
            return (held + max(0, free - reserve)) * limits.block_size - prompt.num_computed

        if fit() <= 0 and not chunks:  # the head lacks memory: later arrivals give theirs back
            deficit = -(-(prompt.num_computed + 1) // limits.block_size) - held + reserve - free
            victims = take_back(prompt.arrival, deficit, not limits.rows_in_flight)
            if victims:
                free += preempt(victims)
                dropped = set(victims)
                free += sum(r.blocks_needed for r in rows if r.seq_id in dropped)  # reserved, never allocated
                rows = [r for r in rows if r.seq_id not in dropped]
        num_tokens = min(prompt.num_pending, budget, fit())
        if num_tokens <= 0:
            break
        needed = max(0, -(-(prompt.num_computed + num_tokens) // limits.block_size) - held)
        chunks.append(PromptChunk(prompt.seq_id, num_tokens, needed, starts))
        free -= needed
        budget -= num_tokens
        if starts:
            seats -= prompt.num_samples
        if num_tokens < prompt.num_pending:
            break  # the head is still incomplete: later prompts wait for it
    return StepDecision(tuple(r.seq_id for r in rows), tuple(chunks), tuple(preempted))
