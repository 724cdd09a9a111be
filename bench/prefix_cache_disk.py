"""The disk tier's checks on a real run (bench/prefix_cache.py --corrupt-disk-fraction F): prompts whose cached
blocks the device pool and the host tier push down to disk, a fraction F of those spilled files damaged (truncated,
a payload byte flipped, the header's shape changed, the header overwritten, deleted, another block's file in its
place), then the prompts again, in passes, each pass followed by prompts that push everything down again.

A prompt's run of cached blocks stops at its first bad file: that file is read, counted corrupt, deleted and its
block computed with the rest of the prompt, so a pass reads at most one bad file a prompt and the next pass finds
the next. Reported for each pass: the corrupt counter's move against the prompts that had a bad file left, the
disk hits, the prompt tokens served from the cache, whether any prompt was served past its first bad file, and
whether every answer equals the undamaged run's (greedy).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from pipeline.engine import Engine
from pipeline.memory.block_hashes import extend_block_hashes
from pipeline.memory.kv_tiers import _FIXED

from gpu_requests import run_one
from gpu_util import layer_kinds, pct

BLOCK = 16


def kv_block_bytes(hf_config: dict, dtype_bytes: int) -> int:
    """One block of every attention layer's K and V: a host slot."""
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    layers = layer_kinds(hf_config).count("full_attention")
    return layers * 2 * BLOCK * hf_config["num_key_value_heads"] * head_dim * dtype_bytes


def _truncate(path: str, other: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _flip_payload_byte(path: str, other: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte ^ 0x40]))


def _wrong_shape(path: str, other: str) -> None:
    with open(path, "r+b") as f:
        f.seek(_FIXED.size)
        size = int.from_bytes(f.read(8), "little")
        f.seek(_FIXED.size)
        f.write((size + 1).to_bytes(8, "little"))


def _overwrite_header(path: str, other: str) -> None:
    with open(path, "r+b") as f:
        f.write(b"\0" * 16)


def _delete(path: str, other: str) -> None:
    os.remove(path)


def _another_blocks_file(path: str, other: str) -> None:
    shutil.copyfile(other, path)


DAMAGE: dict[str, Callable[[str, str], None]] = {
    "truncated": _truncate, "payload_byte_flipped": _flip_payload_byte, "header_wrong_shape": _wrong_shape,
    "header_overwritten": _overwrite_header, "deleted": _delete, "another_blocks_file": _another_blocks_file}


async def _push_down(engine: Engine, count: int, length: int, rng: random.Random) -> None:
    """Prompts of their own, enough blocks to move every earlier block below the host tier."""
    for _ in range(count):
        await run_one(engine, [rng.randrange(100, 30000) for _ in range(length)], 1)


async def _idle(engine: Engine, timeout_s: float = 60.0) -> dict:
    """The engine's stats once nothing runs (the last request's blocks are freed a step after its last token), or
    at the deadline."""
    deadline = time.monotonic() + timeout_s
    stats = engine.stats()
    while (stats["running"] or stats["prefilling"] or stats["kv_blocks"]["used"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
        stats = engine.stats()
    return stats


async def disk_corruption(a: argparse.Namespace, config: Callable[..., Any], model_dir: str | None,
                          hf_config: dict, sizes: dict, fraction: float) -> dict:
    """``config(a, model_dir, **overrides)``: the engine config; ``hf_config``: the model's, for the block size."""
    rng = random.Random(17)
    length, count, out = sizes["disk_prompt"], sizes["disk_prompts"], sizes["disk_out"]
    per_prompt = -(-(length + out) // BLOCK)
    pool = int(sizes["disk_pool_prompts"] * per_prompt) + 1
    block_bytes = kv_block_bytes(hf_config, 2 if a.device == "cuda" else 4)
    host_blocks = int(sizes["disk_host_prompts"] * per_prompt)
    directory = tempfile.mkdtemp(prefix="conveyor-bench-kv-")
    engine = await Engine.create(config(a, model_dir, max_num_seqs=2, num_kv_blocks=pool, block_size=BLOCK,
                                        max_model_len=length + out + BLOCK,
                                        kv_offload_host_gib=host_blocks * block_bytes / (1 << 30),
                                        kv_offload_dir=directory, kv_offload_disk_gib=sizes["disk_gib"]))
    try:
        offload = engine.cache.offload
        fillers = -(-(pool + offload.host.capacity_blocks) // (length // BLOCK)) + 1
        prompts = [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(count)]
        first = [await run_one(engine, prompt, out) for prompt in prompts]
        await _push_down(engine, fillers, length, rng)
        keys = [extend_block_hashes([], prompt, BLOCK, (length - 1) // BLOCK, None) for prompt in prompts]
        path = lambda key: os.path.join(offload.disk.path, key.hex())  # noqa: E731
        spilled = [key for run in keys for key in run if key in offload.disk]
        damaged = rng.sample(spilled, round(fraction * len(spilled)))
        mine = set(spilled)
        others = [name for name in os.listdir(offload.disk.path) if bytes.fromhex(name) not in mine]
        kinds: dict[str, int] = {}
        for i, key in enumerate(damaged):
            kind = list(DAMAGE)[i % len(DAMAGE)]
            DAMAGE[kind](path(key), os.path.join(offload.disk.path, others[i % len(others)]))
            kinds[kind] = kinds.get(kind, 0) + 1
        bad = set(damaged)  # the damaged files not read yet

        passes = []
        for _ in range(sizes["disk_passes"]):
            left = [next((j for j, key in enumerate(run) if key in bad and key in offload.disk), None) for run in keys]
            before = engine.stats()
            hits, ttfts, matched, served_past = [], [], 0, 0
            for prompt, run, expected, stop in zip(prompts, keys, first, left):
                start = engine.stats()["prefix_cache"]["hit_tokens"]
                result = await run_one(engine, prompt, out)
                hit = engine.stats()["prefix_cache"]["hit_tokens"] - start
                hits.append(hit)
                ttfts.append((result["stamps"][0][0] - result["start"]) * 1e3)
                matched += result["ids"] == expected["ids"]
                served_past += stop is not None and hit > stop * BLOCK
                bad = {key for key in bad if key in offload.disk}  # a bad file read is gone (a later one is good)
            after = engine.stats()
            disk_before, disk_after = before["kv_offload"]["tiers"]["disk"], after["kv_offload"]["tiers"]["disk"]
            passes.append({
                "prompts_with_bad_file": sum(stop is not None for stop in left),
                "corrupt_reads": disk_after["corrupt"] - disk_before["corrupt"],
                "disk_hits": disk_after["hits"] - disk_before["hits"],
                "disk_restored_blocks": (after["kv_offload"]["disk_restored_blocks"]
                                         - before["kv_offload"]["disk_restored_blocks"]),
                "hit_tokens": hits, "prompts_served_past_bad_file": served_past,
                "answers_match": matched == len(prompts), "answers_matched": matched,
                "bad_files_left": sum(key in offload.disk for key in bad), "ttft_ms_p50": pct(ttfts, 50)})
            await _push_down(engine, fillers, length, rng)
        stats = await _idle(engine)
        return {"model": a.model or a.shape, "fraction": fraction, "block_size": BLOCK, "kv_blocks": pool,
                "host_blocks": offload.host.capacity_blocks, "block_bytes": offload.host.block_nbytes,
                "prompts": count, "prompt_tokens": length, "output_tokens": out, "fillers_per_push": fillers,
                "spilled_files": len(spilled), "looked_up_blocks": sum(len(run) for run in keys),
                "damaged_files": len(damaged), "damage": kinds,
                "first_ttft_ms_p50": pct([(r["stamps"][0][0] - r["start"]) * 1e3 for r in first], 50),
                "passes": passes, "corrupt_total": stats["kv_offload"]["tiers"]["disk"]["corrupt"],
                "answers_match": all(p["answers_match"] for p in passes),
                "served_past_bad_file": sum(p["prompts_served_past_bad_file"] for p in passes),
                "idle": stats["kv_blocks"]["used"] == 0 and stats["running"] == 0,
                "kv_offload": stats["kv_offload"], "prefix_cache": stats["prefix_cache"]}
    finally:
        await engine.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
