"""Output channels merge unread deltas per sample and report overflow past the byte cap."""
import asyncio

import pytest

from pipeline.output_channel import OutputChannel
from pipeline.request import FinishReason, OutputDelta
from tests.conftest import run_async


def delta(index: int, text: str, token: int, finish: FinishReason | None = None) -> OutputDelta:
    return OutputDelta("r", index, text, [token], finish_reason=finish)


def test_unread_deltas_are_merged_per_sample():
    async def main():
        channel = OutputChannel(num_samples=2, cap_bytes=1000)
        for i in range(5):
            channel.push(delta(0, f"a{i}", i))
        channel.push(delta(1, "b", 9, FinishReason.LENGTH))
        batch = await channel.next_batch()
        channel.push(delta(0, "!", 5, FinishReason.STOP))
        rest = await channel.next_batch()
        done = await channel.next_batch()
        return batch, rest, done, channel.finished

    batch, rest, done, finished = run_async(main())
    assert [(d.index, d.text, d.token_ids) for d in batch] == [(0, "a0a1a2a3a4", [0, 1, 2, 3, 4]), (1, "b", [9])]
    assert rest[0].finish_reason is FinishReason.STOP and done == [] and finished


def test_overflow_is_reported_once_and_failures_raise():
    async def main():
        channel = OutputChannel(num_samples=1, cap_bytes=10)
        results = [channel.push(delta(0, "x" * 6, i)) for i in range(3)]
        channel.fail(RuntimeError("boom"))
        await channel.next_batch()  # pending output is still delivered first
        with pytest.raises(RuntimeError, match="boom"):
            await channel.next_batch()
        return results

    assert run_async(main()) == [True, False, True]


def test_a_waiting_reader_wakes_on_push():
    async def main():
        channel = OutputChannel(num_samples=1, cap_bytes=100)
        reader = asyncio.ensure_future(channel.next_batch())
        await asyncio.sleep(0)
        assert not reader.done()
        channel.push(delta(0, "hi", 1))
        return await reader

    assert run_async(main())[0].text == "hi"
