"""Prefix caching for a hybrid model (tiny random Qwen3.5-MoE: Gated DeltaNet + gated attention + MoE) through
the whole stage graph: a prefix resumes only from a recurrent-state snapshot, and every output equals the output
with caching off (greedy and seeded sampling, n > 1, chunked prompts, a snapshot pool small enough to evict),
hits happen where a snapshot was taken, and nothing leaks."""
from __future__ import annotations

import asyncio
import os
import random

import pytest

from pipeline.engine import Engine
from pipeline.request import SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BASE = [random.Random(9).randrange(100, 49000) for _ in range(37)]


@pytest.fixture(scope="module")
def hybrid_dir(make_model_dir):
    return make_model_dir("qwen3_5_moe_text", seed=5)


@pytest.fixture(scope="module")
def sizes(hybrid_dir) -> tuple[int, int]:
    """Bytes of one state snapshot and of one KV block of the tiny model (to size pools in units)."""
    async def probe() -> tuple[int, int]:
        engine = await Engine.create(config_for(hybrid_dir))
        try:
            return engine.loaded.runner.bytes_per_snapshot, engine.loaded.runner.bytes_per_block
        finally:
            await engine.shutdown()

    return run_async(probe())


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def sampled(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=seed, n=n, ignore_eos=True)


async def outputs(engine: Engine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    return [s.token_ids for s in await collect(engine, prompt_token_ids=prompt, params=params)]


async def scenario(model_dir, caching: bool, **overrides) -> tuple[list, dict]:
    engine = await Engine.create(config_for(model_dir, prefix_caching=caching, **overrides))
    try:
        results = [await outputs(engine, BASE, greedy())]  # snapshot where its last full block ends (36)
        results.append(await outputs(engine, BASE, greedy()))  # exact hit: the state restored, one token computed
        results.append(await outputs(engine, BASE[:32], greedy()))  # a prefix of it (interval snapshots only)
        results.append(await outputs(engine, BASE[:30] + [7, 8, 9], greedy()))  # diverges inside a block
        results.append(await outputs(engine, BASE + results[0][0] + [11, 12], greedy()))  # the next turn
        results.append(await outputs(engine, BASE, sampled(3)))
        results.append(await outputs(engine, BASE + [5], sampled(3, n=3)))
        together = await asyncio.gather(*[outputs(engine, BASE[:20 + 4 * i] + [i] * (i + 1), greedy())
                                          for i in range(5)])
        results.extend(together)
        await settle(engine)
        assert_no_leaks(engine)
        return results, engine.stats()
    finally:
        await engine.shutdown()


def test_hybrid_cache_on_equals_off_and_restores_snapshots(hybrid_dir):
    off, off_stats = run_async(scenario(hybrid_dir, False))
    on, stats = run_async(scenario(hybrid_dir, True))
    assert on == off
    assert off_stats["state_snapshots"] == {"enabled": False} and off_stats["prefix_cache"]["hit_tokens"] == 0
    snapshots = stats["state_snapshots"]
    assert snapshots["taken"] > 0 and snapshots["restored"] >= 3  # the exact hit, the next turn, the samples
    # the exact hit takes 36 of BASE's 37 tokens, the next turn at least those 36 again
    assert stats["prefix_cache"]["hit_tokens"] >= 36 + 36


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 8},
                                       {"num_kv_blocks": 30, "max_num_seqs": 2, "kv_offload_host_gib": 64 / 1024}])
def test_a_block_aligned_prompt_again_computes_only_its_last_token(hybrid_dir, overrides):
    """BASE[:36] ends at a block boundary: its first run snapshots the state one token before its end, and the same
    prompt again restores that state with a copy of its last block and computes one token: the same tokens as
    without caching (greedy, seeded, and the next turn after it). With a small pool other prompts evict its blocks
    first and they come back from the host tier."""
    prompt = BASE[:36]
    others = [[random.Random(80 + i).randrange(100, 49000) for _ in range(60)] for i in range(2)]

    async def main(caching: bool) -> tuple[list, int, dict]:
        engine = await Engine.create(config_for(hybrid_dir, prefix_caching=caching, **overrides))
        try:
            results = [await outputs(engine, prompt, greedy())]
            if "kv_offload_host_gib" in overrides:
                for other in others:
                    results.append(await outputs(engine, other, greedy()))
            before = engine.stats()["prefix_cache"]["hit_tokens"]
            results.append(await outputs(engine, prompt, greedy()))
            hit = engine.stats()["prefix_cache"]["hit_tokens"] - before
            results.append(await outputs(engine, prompt, sampled(4)))
            results.append(await outputs(engine, prompt, sampled(5, n=2)))  # siblings compute their own state
            results.append(await outputs(engine, prompt + results[0][0][:4], greedy()))
            await settle(engine)
            assert_no_leaks(engine)
            return results, hit, engine.stats()
        finally:
            await engine.shutdown()

    off, _, _ = run_async(main(False))
    on, hit, stats = run_async(main(True))
    assert on == off and hit == 35
    if "kv_offload_host_gib" in overrides:
        assert stats["kv_offload"]["restored_blocks"] >= 9


def test_hybrid_chunks_interval_snapshots_and_a_tiny_snapshot_pool(hybrid_dir, sizes):
    """8-token chunks with an 8-token interval (a snapshot at every chunk end: BASE[:32] resumes at 28), then a
    pool of two snapshots (evictions while prompts wait on theirs), and a pool too small to hold one (caching
    off for the hybrid layers)."""
    off, _ = run_async(scenario(hybrid_dir, False, max_num_batched_tokens=8))
    on, stats = run_async(scenario(hybrid_dir, True, max_num_batched_tokens=8, state_snapshot_interval=8))
    assert on == off
    assert stats["state_snapshots"]["taken"] > 8 and stats["prefix_cache"]["hit_tokens"] > 36 + 28

    size = sizes[0]
    plain, _ = run_async(scenario(hybrid_dir, False))
    tiny, stats = run_async(scenario(hybrid_dir, True, state_snapshot_gib=2.5 * size / (1 << 30)))
    assert tiny == plain
    assert stats["state_snapshots"]["capacity"] == 2 and stats["state_snapshots"]["evictions"] > 0
    none, stats = run_async(scenario(hybrid_dir, True, state_snapshot_gib=0.5 * size / (1 << 30)))
    assert none == plain and stats["prefix_cache"]["enabled"] is False


def test_64_concurrent_prompts_sharing_prefixes_with_three_snapshots(hybrid_dir, sizes):
    """64 prompts at once on BASE's prefixes (its snapshot taken first) with room for three snapshots, and one
    more cancelled while it waits: the same tokens as without caching, and every block, state slot and snapshot
    pin given back."""
    rng = random.Random(4)
    batch = [BASE[:rng.randint(5, 37)] + [rng.randrange(100, 4000) for _ in range(3)] for _ in range(64)]

    async def main(caching: bool) -> tuple[list, dict]:
        engine = await Engine.create(config_for(hybrid_dir, prefix_caching=caching, max_num_seqs=8,
                                                state_snapshot_interval=8, max_num_batched_tokens=32,
                                                state_snapshot_gib=3.5 * size / (1 << 30)))
        try:
            await outputs(engine, BASE, greedy(2))
            jobs = [asyncio.ensure_future(outputs(engine, p, greedy(4))) for p in batch]
            doomed = asyncio.ensure_future(outputs(engine, BASE + [1, 2], greedy(50)))
            await asyncio.sleep(0)
            doomed.cancel()
            results = await asyncio.gather(*jobs)
            await asyncio.gather(doomed, return_exceptions=True)
            await settle(engine)
            assert_no_leaks(engine)
            return results, engine.stats()
        finally:
            await engine.shutdown()

    size = sizes[0]
    off, _ = run_async(main(False))
    on, stats = run_async(main(True))
    assert on == off
    snapshots = stats["state_snapshots"]
    assert snapshots["capacity"] == 3 and snapshots["pinned"] == 0 and snapshots["restored"] > 0


def test_hybrid_blocks_come_back_from_host_and_disk_to_a_snapshot(hybrid_dir, tmp_path, sizes):
    """A device pool that evicts BASE's blocks while four other prompts run: with a host tier (and a disk tier
    behind a small one) BASE resumes from its snapshot with its blocks copied back, the same tokens as without
    caching; a corrupt disk file is recomputed."""
    others = [[random.Random(60 + i).randrange(100, 49000) for _ in range(60)] for i in range(4)]

    async def main(corrupt: bool = False, **overrides) -> tuple[list, dict]:
        engine = await Engine.create(config_for(hybrid_dir, num_kv_blocks=30, max_num_seqs=2, **overrides))
        try:
            results = [await outputs(engine, BASE, greedy())]
            for prompt in others:
                results.append(await outputs(engine, prompt, greedy()))
            if corrupt:
                disk = engine.cache.offload.disk
                for name in os.listdir(disk.path):
                    with open(os.path.join(disk.path, name), "r+b") as handle:
                        handle.seek(-1, os.SEEK_END)
                        last = handle.read(1)
                        handle.seek(-1, os.SEEK_END)
                        handle.write(bytes([last[0] ^ 0xFF]))
            results.append(await outputs(engine, BASE, greedy()))
            results.append(await outputs(engine, BASE + results[0][0] + [11, 12], greedy()))
            await settle(engine)
            assert_no_leaks(engine)
            return results, engine.stats()
        finally:
            await engine.shutdown()

    off, _ = run_async(main(prefix_caching=False))
    host, stats = run_async(main(kv_offload_host_gib=64 / 1024))
    assert host == off and stats["kv_offload"]["restored_blocks"] > 0
    assert stats["state_snapshots"]["restored"] >= 2
    small = dict(kv_offload_host_gib=16 * sizes[1] / (1 << 30), kv_offload_dir=str(tmp_path),
                 kv_offload_disk_gib=64 / 1024)
    disk, stats = run_async(main(**small))
    assert disk == off and stats["kv_offload"]["disk_restored_blocks"] > 0
    corrupted, stats = run_async(main(corrupt=True, **small))
    assert corrupted == off and stats["kv_offload"]["tiers"]["disk"]["corrupt"] > 0


async def eight_prompts(model_dir, seed: int, **overrides) -> tuple[list, dict]:
    """Eight prompts of 5..26 tokens generating 24 greedy tokens at once: each one's tokens and the stats."""
    batch = [[random.Random(seed + i).randrange(100, 49000) for _ in range(5 + 3 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = await Engine.create(config_for(model_dir, **overrides))
    try:
        results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=params) for p in batch])
        await settle(engine)
        assert_no_leaks(engine)
        return [r[0].token_ids for r in results], engine.stats()
    finally:
        await engine.shutdown()


def test_hybrid_preempted_sequences_swap_out_and_back(hybrid_dir):
    """Eight prompts generating 24 tokens where one fits: with a host tier a preempted sequence's blocks go to
    host and its state into a snapshot, and it resumes at its last token; the same tokens as with room."""
    expected, _ = run_async(eight_prompts(hybrid_dir, 70))
    tight = dict(num_kv_blocks=25, max_num_batched_tokens=16, kv_offload_host_gib=64 / 1024)
    got, stats = run_async(eight_prompts(hybrid_dir, 70, **tight))
    assert got == expected and stats["preemptions"] > 0
    assert stats["kv_offload"]["swapped_out"] > 0 and stats["kv_offload"]["swapped_in"] > 0
    assert stats["state_snapshots"]["pinned"] == 0


def test_snapshots_the_device_evicts_come_back_from_host(hybrid_dir, sizes):
    """Room for one device snapshot: three conversations take turns, so each one's snapshot is evicted before its
    next turn. With a host tier for snapshots the next turn resumes from its snapshot, promoted back from host;
    without one it recomputes. The same tokens either way, and as with caching off."""
    convs = [BASE] + [[random.Random(80 + i).randrange(100, 49000) for _ in range(33)] for i in range(2)]

    async def main(**overrides) -> tuple[list, dict]:
        engine = await Engine.create(config_for(hybrid_dir, **overrides))
        try:
            first = [await outputs(engine, prompt, greedy()) for prompt in convs]
            hits_before = engine.stats()["prefix_cache"]["hit_tokens"]
            second = [await outputs(engine, prompt + reply[0] + [11, 12], greedy())
                      for prompt, reply in zip(convs, first)]
            await settle(engine)
            assert_no_leaks(engine)
            stats = engine.stats()
            return first + second, {**stats, "next_turn_hits": stats["prefix_cache"]["hit_tokens"] - hits_before}
        finally:
            await engine.shutdown()

    one = 1.5 * sizes[0] / (1 << 30)
    off, _ = run_async(main(prefix_caching=False))
    device_only, stats = run_async(main(state_snapshot_gib=one))
    assert device_only == off and stats["state_snapshots"]["capacity"] == 1
    assert stats["next_turn_hits"] <= 32  # only the last conversation's snapshot is still there
    host = dict(kv_offload_host_gib=64 / 1024, state_snapshot_host_gib=16 * sizes[0] / (1 << 30))
    tiered, stats = run_async(main(state_snapshot_gib=one, **host))
    assert tiered == off
    snapshots = stats["state_snapshots"]
    assert snapshots["host"]["demoted"] >= 2 and snapshots["host"]["promoted"] >= 2 and snapshots["pinned"] == 0
    assert stats["next_turn_hits"] >= 32 * 3  # every next turn resumed where its prompt's last full block ends


def test_preempted_hybrid_states_go_through_the_snapshot_host_tier(hybrid_dir, sizes):
    """Preemption with room for two device snapshots: the preempted sequences' states are demoted to host and
    promoted back when they resume; the same tokens as with room for everything."""
    expected, _ = run_async(eight_prompts(hybrid_dir, 90))
    tight = dict(num_kv_blocks=25, max_num_batched_tokens=16, kv_offload_host_gib=64 / 1024,
                 state_snapshot_gib=2.5 * sizes[0] / (1 << 30), state_snapshot_host_gib=32 * sizes[0] / (1 << 30))
    got, stats = run_async(eight_prompts(hybrid_dir, 90, **tight))
    assert got == expected and stats["preemptions"] > 0
    host = stats["state_snapshots"]["host"]
    assert stats["kv_offload"]["swapped_in"] > 0 and host["demoted"] > 0 and host["promoted"] > 0
    assert stats["state_snapshots"]["pinned"] == 0
