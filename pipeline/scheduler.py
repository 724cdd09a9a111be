"""Scheduling policy: who runs next, under which token budget, and who is preempted.

Pure policy over plain Python state (no torch, no asyncio), so it can be reasoned about and
tested on its own. The prefill and decode stages own their sequences and call into this module;
the limits they share (seats, waiting admission) are small counters defined here.

Progress guarantee with a tiny pool: prefill serves sequences strictly in arrival order and only
ever preempts its own sequences that arrived later than the head; decode preempts its latest
arrival first. So the oldest unfinished sequence always gets memory, provided one sequence fits the
pool on its own (the engine caps max_model_len by the pool's capacity).
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.sequence import Sequence


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


@dataclass(slots=True)
class PrefillChoice:
    seq: Sequence
    num_tokens: int
    new_blocks: int
    starts: bool  # first chunk of a sequence that holds no seat yet


def plan_prefill(
    waiting: list[Sequence],
    *,
    started: set[int],
    token_budget: int,
    free_blocks: int,
    block_size: int,
    seats_available: int,
    watermark_blocks: int,
) -> list[PrefillChoice]:
    """Pick prompt chunks for the next step, strictly first come first served.

    `waiting` is in arrival order; `started` holds seq_ids that already hold a seat. A sequence
    that cannot get a seat or a single block stops the scan (no overtaking, so no starvation).
    New sequences keep `watermark_blocks` free for running decodes to grow into.
    """
    choices: list[PrefillChoice] = []
    for seq in waiting:
        if token_budget <= 0:
            break
        starts = seq.seq_id not in started
        if starts and seq.num_samples > seats_available:
            break
        reserve = watermark_blocks if starts else 0
        usable_blocks = max(0, free_blocks - reserve)
        fit_tokens = (len(seq.block_ids) + usable_blocks) * block_size - seq.num_computed
        num_tokens = min(seq.num_pending, token_budget, fit_tokens)
        if num_tokens <= 0:
            break
        needed = -(-(seq.num_computed + num_tokens) // block_size) - len(seq.block_ids)
        choices.append(PrefillChoice(seq, num_tokens, max(0, needed), starts))
        free_blocks -= max(0, needed)
        token_budget -= num_tokens
        if starts:
            seats_available -= seq.num_samples
        if num_tokens < seq.num_pending:
            break  # the head is still incomplete: later prompts wait for it
    return choices


def prefill_victims(waiting: list[Sequence], blocks_needed: int, head: Sequence) -> list[Sequence]:
    """Later arrivals holding blocks, latest first, freeing at least `blocks_needed` for the head."""
    victims: list[Sequence] = []
    freed = 0
    for seq in sorted(waiting, key=lambda s: s.arrival, reverse=True):
        if freed >= blocks_needed or seq.arrival <= head.arrival:
            break
        if seq.block_ids:
            victims.append(seq)
            freed += len(seq.block_ids)
    return victims if freed >= blocks_needed else []


def decode_victim(running: list[Sequence]) -> Sequence:
    """The running sequence to preempt when decode runs out of blocks: the latest arrival."""
    return max(running, key=lambda s: s.arrival)
