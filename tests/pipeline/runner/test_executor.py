"""The device executor merges plans that wait together into one forward and routes rows back."""
import asyncio
import threading

import numpy as np
import pytest

from pipeline.runner.executor import DeviceExecutor
from pipeline.runner.sampler import SamplerOutput
from pipeline.runner.step_plan import ScheduledChunk, StepPlan
from tests.conftest import run_async


def plan_with(tag: int, rows: int) -> StepPlan:
    return StepPlan([ScheduledChunk([tag], 0, [1], [tag] * rows)])  # rows stand in for SamplingRows


def test_plans_waiting_together_run_as_one_step_and_get_their_own_rows():
    gate = threading.Event()
    seen: list[list[int]] = []

    def execute(plan: StepPlan) -> SamplerOutput:
        gate.wait()
        seen.append([c.token_ids[0] for c in plan.chunks])
        rows = [row for c in plan.chunks for row in c.rows]
        return SamplerOutput(token_ids=np.asarray(rows, dtype=np.int64), logprobs=None, top_ids=None,
                             top_logprobs=None)

    async def main():
        executor = DeviceExecutor(execute)
        try:
            first = asyncio.ensure_future(executor.submit(plan_with(1, 1)))
            await asyncio.sleep(0)  # let it reach the (blocked) device thread
            second = asyncio.ensure_future(executor.submit(plan_with(2, 2)))
            third = asyncio.ensure_future(executor.submit(plan_with(3, 0)))
            await asyncio.sleep(0)
            gate.set()
            return [f.token_ids.tolist() for f in await asyncio.gather(first, second, third)], executor
        finally:
            await asyncio.to_thread(executor.shutdown)

    outputs, executor = run_async(main())
    assert outputs == [[1], [2, 2], []]
    assert seen[0] == [1] or seen == [[1, 2, 3]]
    assert sum(len(s) for s in seen) == 3 and len(seen) <= 2
    assert executor.steps == len(seen)


def test_a_failing_step_fails_every_waiting_stage():
    def execute(plan: StepPlan) -> SamplerOutput:
        raise RuntimeError("device fell over")

    async def main():
        executor = DeviceExecutor(execute)
        try:
            with pytest.raises(RuntimeError, match="fell over"):
                await executor.submit(plan_with(1, 1))
        finally:
            await asyncio.to_thread(executor.shutdown)

    run_async(main())
