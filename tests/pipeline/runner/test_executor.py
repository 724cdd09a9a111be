"""The device executor runs each launch as one forward in launch order, gives each fetch its step's
results, and hands a lane's step the device tokens of that lane's previous step."""
import asyncio
import itertools
import threading

import numpy as np
import pytest
import torch

from pipeline.runner.executor import DeviceExecutor
from pipeline.runner.sampler import SamplerOutput
from pipeline.runner.step_plan import ScheduledChunk, StepPlan, build_step_plan
from tests.conftest import run_async


class FakeSample:
    def __init__(self, tokens: list[int]) -> None:
        self.token_ids = torch.tensor(tokens, dtype=torch.int64)

    def is_ready(self) -> bool:
        return False  # exercise the copy-waiter path

    def to_host(self) -> SamplerOutput:
        return SamplerOutput(token_ids=self.token_ids.numpy(), logprobs=None, top_ids=None, top_logprobs=None)


def plan_with(tag: int, rows: int, previous_row: int = -1) -> StepPlan:
    # rows stand in for SamplingRows; the fake device "samples" each row's tag
    return build_step_plan([ScheduledChunk([tag], 0, [1], [tag] * rows, previous_row=previous_row)], block_size=4)


def tags(plan: StepPlan) -> list[int]:
    """The chunks' first input tokens."""
    return plan.forward.input_ids[plan.forward.query_start_loc[:-1]].tolist()


def test_launches_run_in_order_one_forward_each_and_fetch_their_own_rows():
    gate = threading.Event()
    seen: list[list[int]] = []

    def launch(plan: StepPlan, previous, previous_host=None):
        gate.wait()
        seen.append(tags(plan))
        return FakeSample(list(plan.rows))

    async def main():
        executor = DeviceExecutor(launch)
        try:
            steps = [executor.launch(plan_with(1, 1), lane="a"), executor.launch(plan_with(2, 2), lane="b"),
                     executor.launch(plan_with(3, 0), lane="c")]
            gate.set()
            outputs = await asyncio.gather(*(executor.fetch(s) for s in steps))
            return [o.token_ids.tolist() for o in outputs], executor
        finally:
            await asyncio.to_thread(executor.shutdown)

    outputs, executor = run_async(main())
    assert outputs == [[1], [2, 2], []]
    assert seen == [[1], [2], [3]] and executor.steps == 3


def test_a_lane_step_feeds_on_that_lanes_previous_tokens():
    gate = threading.Event()
    launches: list[tuple[list[int], list[int] | None]] = []

    def launch(plan: StepPlan, previous, previous_host=None):
        gate.wait()
        launches.append((tags(plan), None if previous is None else previous.tolist()))
        return FakeSample([10 * tag + i for tag, group in itertools.groupby(plan.rows) for i, _ in enumerate(group)])

    async def main():
        executor = DeviceExecutor(launch)
        try:
            first = executor.launch(plan_with(1, 2), lane="decode")
            other = executor.launch(plan_with(5, 1), lane="prefill")
            second = executor.launch(plan_with(2, 1, previous_row=1), lane="decode")  # queued before any ran
            gate.set()
            return [(await executor.fetch(s)).token_ids.tolist() for s in (first, other, second)]
        finally:
            await asyncio.to_thread(executor.shutdown)

    outputs = run_async(main())
    assert outputs == [[10, 11], [50], [20]]
    assert launches == [([1], None), ([5], None), ([2], [10, 11])]  # decode's tokens, not prefill's


def test_a_failing_launch_fails_its_fetch():
    def launch(plan: StepPlan, previous, previous_host=None):
        raise RuntimeError("device fell over")

    async def main():
        executor = DeviceExecutor(launch)
        try:
            steps = [executor.launch(plan_with(1, 1), lane="a"), executor.launch(plan_with(2, 1), lane="b")]
            for step in steps:
                with pytest.raises(RuntimeError, match="fell over"):
                    await executor.fetch(step)
        finally:
            await asyncio.to_thread(executor.shutdown)

    run_async(main())


def test_feeding_without_a_previous_step_is_an_error():
    from pipeline.runner.token_feed import TokenFeed

    fed = plan_with(1, 1, previous_row=0).forward
    with pytest.raises(ValueError, match="no previous step"):
        TokenFeed.of(fed.feed_targets, fed.feed_sources, None)
    fed = plan_with(1, 1, previous_row=3).forward
    with pytest.raises(ValueError, match="row 3"):
        TokenFeed.of(fed.feed_targets, fed.feed_sources, torch.zeros(2))


@pytest.mark.parametrize("targets,sources", [([0, 1], [0, 1]), ([0, 2], [1, 0])])
def test_token_feed_writes_the_previous_tokens_into_the_inputs(targets, sources):
    from pipeline.runner.token_feed import TokenFeed

    ids = torch.tensor([7, 8, 9])
    TokenFeed(np.asarray(targets), np.asarray(sources), torch.tensor([40, 41])).apply(ids)
    expected = [7, 8, 9]
    for t, s in zip(targets, sources):
        expected[t] = 40 + s
    assert ids.tolist() == expected


def test_posted_jobs_run_before_later_launches_and_their_errors_stay_there(caplog):
    """A posted job (promised drafts) runs on the device thread before any step launched after it, nothing waits
    for it, and an error escaping one is logged without stopping the thread."""
    gate = threading.Event()
    order: list[str] = []

    def launch(plan: StepPlan, previous, previous_host=None):
        order.append(f"step {tags(plan)[0]}")
        return FakeSample(list(plan.rows))

    def first() -> None:
        gate.wait()
        order.append("posted")

    def broken() -> None:
        raise ValueError("broken job")

    async def main():
        executor = DeviceExecutor(launch)
        try:
            executor.post(first)
            executor.post(broken)
            step = executor.launch(plan_with(7, 1), lane="a")
            gate.set()
            return (await executor.fetch(step)).token_ids.tolist()
        finally:
            await asyncio.to_thread(executor.shutdown)

    assert run_async(main()) == [7]
    assert order == ["posted", "step 7"]
    assert "broken job" in caplog.text
