"""The host and disk KV tiers through the whole stage graph on a tiny random Llama, under a device pool small
enough that a prompt's cached blocks are evicted before it comes back: every output equals the output with
caching off, the blocks come back from host (or disk) instead of being recomputed, a corrupt disk file is
recomputed instead of served, and nothing leaks."""
from __future__ import annotations

import json
import os
import random

from pipeline.config import EngineConfig
from pipeline.engine import Engine
from pipeline.request import SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

BASE = [random.Random(8).randrange(100, 49000) for _ in range(37)]
OTHERS = [[random.Random(20 + i).randrange(100, 49000) for _ in range(60)] for i in range(4)]
BLOCK_SIZE = 4


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def block_bytes(model_dir) -> int:
    """One block across the tiny model's layers, fp32 (what a host slot holds)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK_SIZE * cfg["num_key_value_heads"] * head_dim * 4


def tiers_config(model_dir, host_blocks: int = 0, disk_dir=None, **overrides) -> EngineConfig:
    size = block_bytes(model_dir)
    tiers = dict(kv_offload_host_gib=host_blocks * size / (1 << 30)) if host_blocks else {}
    if disk_dir is not None:
        tiers.update(kv_offload_dir=str(disk_dir), kv_offload_disk_gib=1000 * (size + 256) / (1 << 30))
    # 30 blocks: one 60-token prompt with its output fills half the pool, so four of them evict BASE's blocks
    return config_for(model_dir, **{"num_kv_blocks": 30, "max_num_seqs": 2, **tiers, **overrides})


async def outputs(engine: Engine, prompt: list[int]) -> list[int]:
    return (await collect(engine, prompt_token_ids=prompt, params=greedy()))[0].token_ids


async def scenario(config: EngineConfig, between=None) -> tuple[list, dict]:
    """BASE, four other prompts (evicting BASE from the device), BASE again, then its next turn."""
    engine = await Engine.create(config)
    try:
        results = [await outputs(engine, BASE)]
        for prompt in OTHERS:
            results.append(await outputs(engine, prompt))
        if between is not None:
            between(engine)
        results.append(await outputs(engine, BASE))
        results.append(await outputs(engine, BASE + results[0] + [11, 12]))
        await settle(engine)
        assert_no_leaks(engine)
        return results, engine.stats()
    finally:
        await engine.shutdown()


def test_host_tier_restores_evicted_blocks_and_equals_caching_off(tiny_model_dir):
    off, _ = run_async(scenario(config_for(tiny_model_dir, num_kv_blocks=30, max_num_seqs=2, prefix_caching=False)))
    device_only, device_stats = run_async(scenario(tiers_config(tiny_model_dir)))
    on, stats = run_async(scenario(tiers_config(tiny_model_dir, host_blocks=200)))
    assert device_only == off and on == off
    offload = stats["kv_offload"]
    assert device_stats["kv_offload"] == {"enabled": False}
    assert offload["saved_blocks"] > 0 and offload["restored_blocks"] >= len(BASE) // BLOCK_SIZE
    assert offload["bytes_to_device"] == offload["restored_blocks"] * block_bytes(tiny_model_dir)
    assert offload["disk_restored_blocks"] == 0 and offload["dropped_blocks"] == 0
    # the host tier turns BASE's second run into a hit the device pool alone had evicted
    assert stats["prefix_cache"]["hit_tokens"] > device_stats["prefix_cache"]["hit_tokens"]


def test_disk_tier_takes_what_the_host_evicts_and_recomputes_corrupt_files(tiny_model_dir, tmp_path):
    off, _ = run_async(scenario(config_for(tiny_model_dir, num_kv_blocks=30, max_num_seqs=2, prefix_caching=False)))
    on, stats = run_async(scenario(tiers_config(tiny_model_dir, host_blocks=16, disk_dir=tmp_path)))
    assert on == off
    offload = stats["kv_offload"]
    assert offload["disk_restored_blocks"] > 0 and offload["tiers"]["disk"]["corrupt"] == 0
    assert os.listdir(tmp_path) == []  # the private directory went with the engine

    def corrupt_every_file(engine: Engine) -> None:
        disk = engine.cache.offload.disk
        for name in os.listdir(disk.path):
            path = os.path.join(disk.path, name)
            data = bytearray(open(path, "rb").read())
            data[-1] ^= 0xFF
            open(path, "wb").write(bytes(data))

    corrupted, stats = run_async(scenario(tiers_config(tiny_model_dir, host_blocks=16, disk_dir=tmp_path),
                                          between=corrupt_every_file))
    assert corrupted == off
    assert stats["kv_offload"]["tiers"]["disk"]["corrupt"] > 0


def test_a_host_tier_smaller_than_a_steps_evictions_keeps_prompts_first_blocks(tiny_model_dir, tmp_path):
    """Ten host slots and a 60-token prompt evicting 16 blocks in one step: the later evictions (a prefix's first
    blocks, the pool evicts its last ones first) take the slots of the earlier ones' queued saves, so BASE's first
    blocks reach disk and its return is a disk hit, not a tail of blocks no lookup reaches."""
    off, _ = run_async(scenario(config_for(tiny_model_dir, num_kv_blocks=30, max_num_seqs=2, prefix_caching=False)))
    on, stats = run_async(scenario(tiers_config(tiny_model_dir, host_blocks=10, disk_dir=tmp_path)))
    assert on == off
    offload = stats["kv_offload"]
    assert offload["dropped_blocks"] > 0 and offload["disk_restored_blocks"] > 0
    assert offload["tiers"]["disk"]["hits"] == offload["disk_restored_blocks"]  # a file is read only to be served
    assert stats["prefix_cache"]["hit_tokens"] >= offload["disk_restored_blocks"] * BLOCK_SIZE


def test_tiers_with_chunked_prefill_and_concurrent_prompts(tiny_model_dir, tmp_path):
    """Restores under an 8-token step budget (a prompt's restored blocks then its chunks), and prompts sharing
    BASE at once while the pool evicts: the same tokens as without caching, no leaks."""
    import asyncio

    async def together(config: EngineConfig) -> list:
        engine = await Engine.create(config)
        try:
            await outputs(engine, BASE)
            for prompt in OTHERS:
                await outputs(engine, prompt)
            results = await asyncio.gather(*[outputs(engine, BASE[:24 + 4 * i] + [i + 1]) for i in range(4)])
            await settle(engine)
            assert_no_leaks(engine)
            return list(results)
        finally:
            await engine.shutdown()

    for overrides in ({"max_num_batched_tokens": 8}, {"max_num_seqs": 4}):
        plain = config_for(tiny_model_dir, num_kv_blocks=30, prefix_caching=False,
                           **{"max_num_seqs": 2, **overrides})
        tiered = tiers_config(tiny_model_dir, host_blocks=6, disk_dir=tmp_path, **overrides)
        assert run_async(together(tiered)) == run_async(together(plain)), overrides


def test_tier_options_are_checked():
    import pytest

    for bad in (dict(kv_offload_host_gib=-1.0), dict(kv_offload_dir="/tmp"),
                dict(kv_offload_disk_gib=1.0, kv_offload_dir="/tmp"), dict(kv_offload_disk_gib=1.0)):
        with pytest.raises(ValueError):
            EngineConfig(**bad).validate()


def test_preempted_sequences_swap_to_host_and_back(tiny_model_dir):
    """Eight prompts generating 24 tokens in a pool where one fits: preemption swaps a sequence's blocks (the
    partial last one included) to the host tier and resuming takes them back, the same tokens as with room."""
    prompts = [[random.Random(40 + i).randrange(100, 49000) for _ in range(5 + 3 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def run(config: EngineConfig) -> tuple[list, dict]:
        import asyncio

        engine = await Engine.create(config)
        try:
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=params) for p in prompts])
            await settle(engine)
            assert_no_leaks(engine)
            return [r[0].token_ids for r in results], engine.stats()
        finally:
            await engine.shutdown()

    expected, _ = run_async(run(config_for(tiny_model_dir)))
    tight = dict(num_kv_blocks=25, max_num_batched_tokens=16, max_num_seqs=16)
    recomputed, plain = run_async(run(config_for(tiny_model_dir, **tight)))
    swapped, stats = run_async(run(tiers_config(tiny_model_dir, host_blocks=400, **tight)))
    assert recomputed == expected and swapped == expected
    assert plain["preemptions"] > 0 and stats["preemptions"] > 0
    offload = stats["kv_offload"]
    assert offload["swapped_out"] > 0 and offload["swapped_in"] > 0 and offload["dropped_blocks"] == 0
