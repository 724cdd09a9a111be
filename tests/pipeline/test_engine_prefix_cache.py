"""Prefix caching through the whole stage graph on a tiny random Llama: every output with the cache on equals the
output with it off (greedy and seeded sampling), the cache is hit where it should be, tenants are separated by
salt, and every path leaves the pool with no used block (cached free blocks are reported apart)."""
from __future__ import annotations

import asyncio
import random

from pipeline.engine import Engine
from pipeline.request import SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

BASE = [random.Random(5).randrange(100, 49000) for _ in range(37)]


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def sampled(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=seed, n=n, ignore_eos=True)


async def outputs(engine: Engine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    return [s.token_ids for s in await collect(engine, prompt_token_ids=prompt, params=params)]


async def scenario(model_dir, caching: bool, **overrides) -> tuple[list, dict]:
    """Prompts that hit the cache in every way, one after another, then some at once."""
    engine = await Engine.create(config_for(model_dir, prefix_caching=caching, **overrides))
    try:
        results = []
        results.append(await outputs(engine, BASE, greedy()))  # computes and keys the blocks
        results.append(await outputs(engine, BASE, greedy()))  # exact full-prompt hit: the last token recomputed
        results.append(await outputs(engine, BASE[:32], greedy()))  # a block-aligned prefix of it: cached whole
        results.append(await outputs(engine, BASE[:30] + [7, 8, 9], greedy()))  # diverges inside a block
        first = results[0][0]
        results.append(await outputs(engine, BASE + first + [11, 12], greedy()))  # the next turn: output blocks
        results.append(await outputs(engine, BASE, sampled(3)))
        results.append(await outputs(engine, BASE + [5], sampled(3, n=3)))  # n > 1 siblings share the hit
        results.append(await outputs(engine, BASE, sampled(3)))  # seeded: the same with a hit
        results.append(await outputs(engine, BASE[:32], sampled(4, n=3)))  # a whole-prompt hit with siblings
        together = await asyncio.gather(*[outputs(engine, BASE[:20 + 3 * i] + [i] * (i + 1), greedy())
                                          for i in range(6)])
        results.extend(together)
        await settle(engine)
        assert_no_leaks(engine)
        return results, engine.stats()
    finally:
        await engine.shutdown()


def test_cache_on_equals_cache_off_and_hits_where_it_should(tiny_model_dir):
    off, off_stats = run_async(scenario(tiny_model_dir, False))
    on, on_stats = run_async(scenario(tiny_model_dir, True))
    assert on == off
    assert on[5] == on[7]  # the seeded sample is the same with its prompt cached
    assert off_stats["prefix_cache"]["hit_tokens"] == 0 and off_stats["kv_blocks"]["cached_free"] == 0
    hits = on_stats["prefix_cache"]
    # block size 4: BASE (37) again takes 36, BASE[:32] 31 (a copy of its last block: only its last token
    # computed), the diverging one 28, the next turn at least BASE and most of its output (48 + 12 + 2 tokens)
    assert hits["hit_tokens"] >= 36 + 31 + 28 + 56
    assert on_stats["kv_blocks"]["cached_free"] > 0


def test_chunked_prefill_and_a_tiny_pool_give_the_same_tokens(tiny_model_dir):
    """Hits across a prefill-chunk boundary (8-token budget), and eviction under a pool of 40 blocks."""
    for overrides in ({"max_num_batched_tokens": 8}, {"num_kv_blocks": 40, "max_num_seqs": 4}):
        off, _ = run_async(scenario(tiny_model_dir, False, **overrides))
        on, stats = run_async(scenario(tiny_model_dir, True, **overrides))
        assert on == off, overrides
        assert stats["prefix_cache"]["hit_tokens"] > 0


def test_cache_salt_separates_tenants_and_usage_reports_cached_tokens(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            deltas = []
            for salt in ("tenant-a", "tenant-b", "tenant-a", None):
                samples = await collect(engine, prompt_token_ids=BASE, params=greedy(4, cache_salt=salt))
                deltas.append(samples[0].deltas[-1].cached_prompt_tokens)
            await settle(engine)
            assert_no_leaks(engine)
            return deltas
        finally:
            await engine.shutdown()

    assert run_async(main()) == [0, 0, 36, 0]


def test_64_concurrent_requests_with_shared_prefixes_leave_no_block_used(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, num_kv_blocks=160))
        try:
            rng = random.Random(9)
            jobs = [outputs(engine, BASE[:rng.randint(5, 37)] + [rng.randrange(100, 4000) for _ in range(3)],
                            greedy(rng.randint(1, 12))) for _ in range(64)]
            await asyncio.gather(*jobs)
            await settle(engine)
            assert_no_leaks(engine)
            return engine.stats()
        finally:
            await engine.shutdown()

    stats = run_async(main())
    assert stats["prefix_cache"]["hit_tokens"] > 0 and stats["kv_blocks"]["used"] == 0


async def until(condition, timeout_s: float = 30.0) -> None:
    """Poll an engine condition; the deadline only turns a hang into a failure."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout_s)


def test_a_waiting_prompt_holding_cached_blocks_gives_them_back_when_cancelled(tiny_model_dir):
    """One seat: a second request waits for it, having taken its cached prefix; aborting it frees those blocks."""
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, max_num_seqs=1))
        try:
            await outputs(engine, BASE, greedy(2))  # caches BASE's blocks
            running = asyncio.ensure_future(outputs(engine, [3, 4, 5], greedy(300)))
            await until(lambda: engine.stats()["running"] == 1)
            waiting = asyncio.ensure_future(outputs(engine, BASE + [9], greedy(4)))
            await until(lambda: engine.stats()["kv_blocks"]["cached_free"] < 9)  # the waiting prompt took them
            assert engine.stats()["running"] == 1 and not waiting.done()
            held = engine.stats()["kv_blocks"]["used"]
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await settle(engine)
            assert_no_leaks(engine)
            return held, engine.stats()["kv_blocks"]["cached_free"]
        finally:
            await engine.shutdown()

    held, cached = run_async(main())
    assert held >= 9 + 1  # the waiting prompt's 9 cached blocks and the running one's
    assert cached >= 9
