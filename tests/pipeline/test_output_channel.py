"""Output channels merge unread deltas per sample, report overflow past the byte cap, and can hand
each delta straight to a listener."""
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


def test_a_listener_gets_unread_output_first_then_every_push_in_order():
    async def main():
        channel = OutputChannel(num_samples=2, cap_bytes=5)
        seen = []
        channel.push(delta(1, "b0", 0))
        channel.push(delta(0, "a0", 1))
        channel.push(delta(0, "a1", 2))
        delivered = channel.deliver_to(lambda d: seen.append((d.index, d.text)))
        assert seen == [(0, "a0a1"), (1, "b0")]
        assert all(channel.push(delta(0, "long text past the cap", 3)) for _ in range(3))  # nothing is held
        channel.push(delta(1, "b1", 4, FinishReason.STOP))
        assert not delivered.done()
        channel.push(delta(0, "a2", 5, FinishReason.LENGTH))
        await delivered
        channel.push(delta(0, "late", 6))  # after the end: dropped
        return seen, await channel.next_delta()

    seen, after = run_async(main())
    assert seen == [(0, "a0a1"), (1, "b0")] + [(0, "long text past the cap")] * 3 + [(1, "b1"), (0, "a2")]
    assert after is None


def test_a_listener_of_a_finished_or_failed_channel():
    async def main():
        done = OutputChannel(num_samples=1, cap_bytes=100)
        done.push(delta(0, "x", 0, FinishReason.STOP))
        seen = []
        await done.deliver_to(seen.append)
        failed = OutputChannel(num_samples=1, cap_bytes=100)
        failed.fail(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await failed.deliver_to(seen.append)
        listening = OutputChannel(num_samples=1, cap_bytes=100)
        future = listening.deliver_to(seen.append)
        listening.fail(RuntimeError("later"))
        with pytest.raises(RuntimeError, match="later"):
            await future
        return [d.text for d in seen]

    assert run_async(main()) == ["x"]


def test_a_failing_listener_fails_the_channel_not_the_pusher():
    async def main():
        channel = OutputChannel(num_samples=1, cap_bytes=100)

        def listener(d: OutputDelta) -> None:
            raise ConnectionResetError("client gone")

        future = channel.deliver_to(listener)
        assert channel.push(delta(0, "x", 0))  # the stream stage goes on
        with pytest.raises(ConnectionResetError):
            await future
        assert channel.push(delta(0, "y", 1)) and channel.finished
        with pytest.raises(ConnectionResetError):
            await channel.next_delta()

    run_async(main())


def test_stop_delivering_returns_to_pulling():
    async def main():
        channel = OutputChannel(num_samples=1, cap_bytes=100)
        seen = []
        channel.deliver_to(seen.append)
        channel.push(delta(0, "a", 0))
        channel.stop_delivering()
        channel.push(delta(0, "b", 1, FinishReason.STOP))
        return [d.text for d in seen], await read_all(channel)

    seen, rest = run_async(main())
    assert seen == ["a"] and [d.text for d in rest] == ["b"]


def test_push_all_equals_pushing_each_delta():
    """The stream stage's batch push (a listened channel's non-final delta straight to its listener) has
    push's results on random steps over listened, pulled, failing and finished channels: the same
    deliveries, overflows, failures and finished states."""
    import random
    import types

    from pipeline.output_channel import push_all

    def scenario(rng: random.Random, batched: bool) -> list:
        log: list = []
        requests = []
        for r in range(6):
            channel = None if r == 5 else OutputChannel(num_samples=2, cap_bytes=12)
            requests.append(types.SimpleNamespace(channel=channel, name=r))

        def listener(r: int):
            def listen(d: OutputDelta) -> None:
                if d.text == "boom" and r == 2:
                    raise ConnectionResetError("client gone")
                log.append((r, d.index, d.text, d.finish_reason))
            return listen

        futures = {}
        for step in range(40):
            for r in (0, 1, 2):
                channel = requests[r].channel
                if step == 3 * r + 1:
                    futures[r] = channel.deliver_to(listener(r))
                if r == 1 and step == 30:
                    channel.stop_delivering()
            batch = []
            for r in rng.sample(range(6), 4):
                index = rng.randrange(2)
                finish = FinishReason.STOP if rng.random() < 0.05 else None
                text = rng.choice(["a", "bb", "boom", "", "cccc"])
                batch.append((requests[r], OutputDelta("r", index, text, [step], finish_reason=finish)))
            if batched:
                overflowed = [request.name for request in push_all(batch)]
            else:
                overflowed = [request.name for request, d in batch if request.channel is not None and not request.channel.push(d)]
            log.append(("overflowed", overflowed))
            log.append(("state", [(c.finished, c.overflowed, c.direct is not None) if (c := q.channel) else None
                                  for q in requests]))
        log.append(("futures", sorted((r, f.done() and (f.exception() is not None)) for r, f in futures.items())))
        return log

    async def main():
        for seed in range(30):
            assert scenario(random.Random(seed), True) == scenario(random.Random(seed), False), seed

    run_async(main())
