"""What a stage asks the device to do in one step, and what comes back.

A plan is a snapshot: the stage copies tokens into it, so the executor thread never reads state
that the event loop may change while the step runs. Block lists are shared, not copied (a copy per
sequence per step costs O(context)): a live sequence's block list only ever grows at its end, and
freeing rebinds it to a new list, so a plan always finds the blocks its positions need.

A decode chunk may name its token by the row that sampled it in the stage's previous step, when
that step is still in flight. Plans from several stages that are waiting at the same time are
concatenated into one forward (a mixed prefill + decode step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.runner.sampling_batch import SamplingRow
from pipeline.runner.sampler import SamplerOutput


@dataclass(slots=True)
class ScheduledChunk:
    token_ids: list[int]  # new tokens fed this step (a prompt chunk, or one decode token)
    start_pos: int  # position of token_ids[0]; K/V of positions < start_pos are already cached
    block_ids: list[int]  # covers start_pos + len(token_ids) tokens (the sequence's own list, shared)
    rows: list[SamplingRow]  # tokens to pick from the chunk's last position (0, 1 or n)
    # >= 0: the chunk's one token is still on the device, sampled in row `previous_row` of the
    # previous step its stage launched (token_ids holds a placeholder). One step ahead.
    previous_row: int = -1


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk]  # fixed once planned
    num_rows: int = field(init=False)  # sampled rows: read by both threads every step, so counted once

    def __post_init__(self) -> None:
        self.num_rows = sum(len(c.rows) for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


def merge_plans(plans: list[StepPlan]) -> StepPlan:
    """One forward's plan from the plans queued together; a lone plan is itself (plans are fixed once
    planned, and rebuilding one walks every chunk on the device thread, per step)."""
    if len(plans) == 1:
        return plans[0]
    return StepPlan([chunk for plan in plans for chunk in plan.chunks])


def slice_output(output: SamplerOutput, start: int, stop: int) -> SamplerOutput:
    def cut(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else array[start:stop]

    return SamplerOutput(
        token_ids=output.token_ids[start:stop],
        logprobs=cut(output.logprobs),
        top_ids=cut(output.top_ids),
        top_logprobs=cut(output.top_logprobs),
        num_logprobs=cut(output.num_logprobs),
    )
