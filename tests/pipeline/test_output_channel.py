"""Output channels merge unread deltas per sample and report overflow past the byte cap; the stream
stage's push_all pushes a step's deltas and names the requests to abort."""
import asyncio

import pytest

from pipeline.output_channel import OutputChannel
from pipeline.request import FinishReason, OutputDelta
from tests.conftest import run_async


def delta(index: int, text: str, token: int, finish: FinishReason | None = None) -> OutputDelta:
    return OutputDelta("r", index, text, [token], finish_reason=finish)


async def read_all(channel: OutputChannel) -> list[OutputDelta]:
    out = []
    while (d := await channel.next_delta()) is not None:
        out.append(d)
    return out


def test_unread_deltas_are_merged_per_sample_and_read_lowest_sample_first():
    async def main():
        channel = OutputChannel(num_samples=2, cap_bytes=1000)
        for i in range(5):
            channel.push(delta(0, f"a{i}", i))
        channel.push(delta(1, "b", 9, FinishReason.LENGTH))
        first = await channel.next_delta()
        channel.push(delta(0, "!", 5, FinishReason.STOP))
        rest = await read_all(channel)
        return first, rest, channel.finished

    first, rest, finished = run_async(main())
    assert (first.index, first.text, first.token_ids) == (0, "a0a1a2a3a4", [0, 1, 2, 3, 4])
    assert [(d.index, d.text, d.finish_reason) for d in rest] == [(0, "!", FinishReason.STOP),
                                                                 (1, "b", FinishReason.LENGTH)]
    assert finished


def test_overflow_is_reported_once_and_failures_raise():
    async def main():
        channel = OutputChannel(num_samples=1, cap_bytes=10)
        results = [channel.push(delta(0, "x" * 6, i)) for i in range(3)]
        channel.fail(RuntimeError("boom"))
        assert (await channel.next_delta()).text == "x" * 18  # pending output is still delivered first
        with pytest.raises(RuntimeError, match="boom"):
            await channel.next_delta()
        return results

    assert run_async(main()) == [True, False, True]


def test_reading_frees_the_cap():
    async def main():
        channel = OutputChannel(num_samples=2, cap_bytes=10)
        pushed = [channel.push(delta(0, "x" * 6, 0)), channel.push(delta(1, "y" * 3, 1))]
        await channel.next_delta()  # sample 0's 6 bytes are read; 3 stay unread
        pushed.append(channel.push(delta(1, "z" * 6, 2)))  # 9 unread: under the cap
        pushed.append(channel.push(delta(1, "z" * 2, 3)))  # 11
        return pushed

    assert run_async(main()) == [True, True, True, False]


def test_a_waiting_reader_wakes_on_push():
    async def main():
        channel = OutputChannel(num_samples=1, cap_bytes=100)
        reader = asyncio.ensure_future(channel.next_delta())
        await asyncio.sleep(0)
        assert not reader.done()
        channel.push(delta(0, "hi", 1))
        return await reader

    assert run_async(main()).text == "hi"


def test_push_all_pushes_each_delta_and_returns_the_overflowed_requests():
    import types

    from pipeline.output_channel import push_all

    async def main():
        small, large = OutputChannel(num_samples=1, cap_bytes=4), OutputChannel(num_samples=2, cap_bytes=100)
        requests = [types.SimpleNamespace(channel=c) for c in (small, large, None)]
        batch = [(requests[0], delta(0, "abc", 1)), (requests[1], delta(1, "x", 2)), (requests[2], delta(0, "y", 3))]
        assert push_all(batch) == []
        batch = [(requests[0], delta(0, "de", 4)), (requests[1], delta(0, "z", 5, FinishReason.STOP))]
        assert push_all(batch) == [requests[0]]  # 5 unread bytes > 4
        assert push_all([(requests[0], delta(0, "f", 6))]) == []  # reported once
        assert (await small.next_delta()).text == "abcdef"
        assert [(d.index, d.text) for d in [await large.next_delta(), await large.next_delta()]] == [(0, "z"), (1, "x")]

    run_async(main())
