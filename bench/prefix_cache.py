"""Prefix caching against caching off, on one engine shape: what an agent client's repeated prompts cost.

    python3 bench/prefix_cache.py --shape qwen3-8b --commit $(git rev-parse --short HEAD) --out $OUT/prefix.json
    python3 bench/prefix_cache.py --quick --device cpu      # the control flow, on a tiny shape
    python3 bench/prefix_cache.py --quick --device cpu --model embedded --corrupt-disk-fraction 0.25

For caching on and off, each on a fresh engine with random weights (--load-format dummy):

* ``same_prompt``: one 8,192-token prompt, then the same again: the second TTFT against the first;
* ``shared_prefix``: 32 requests at once, a 4,096-token prefix shared and 64-token tails of their own, 32 tokens
  out each (the prefix computed once beforehand, as a system prompt would be): TTFT p50 and output tok/s;
* ``conversation``: 20 turns of an agent conversation, each prompt the last one plus its 64-token reply plus 1,536
  tokens of new tool output, growing to ~32k tokens: TTFT per turn, the last against the first;
* ``host_restore`` (its own engines, a device pool of about 1.1 prompts): an 8,192-token prompt, another one
  that evicts it from the device, then the first again: its TTFT with the blocks copied back from the host tier
  against the same run without a host tier (recomputed);
* ``snapshot_host`` (hybrid shapes, its own engines, room for 2.5 state snapshots on the device): four 8,192-token
  conversations, then each one's next turn (its reply and 1,536 new tokens): TTFT with its snapshot promoted back
  from the snapshots' host tier against the same run without a host tier (recomputed from the start);
* ``disk_corruption`` (``--corrupt-disk-fraction F``, its own engine; bench/prefix_cache_disk.py): prompts pushed
  down to the disk tier, a fraction F of their files damaged, the prompts again: the corrupt counter, the hits,
  whether the answers equal the undamaged run's.

``--sections`` runs a subset (``caching``: the first three, on and off); ``--corrupt-disk-fraction`` alone runs
``disk_corruption``. ``--model`` runs a real model (an HF directory, a .gguf, or ``embedded``) instead of the shape.

Greedy, ignore_eos, the loop guard off (random weights repeat themselves). Writes JSON; asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.config import EngineConfig  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.models.loader import load_hf_config, resolve_model_path  # noqa: E402

from gpu import engine_config, write_model_dir  # noqa: E402
from gpu_requests import run_one  # noqa: E402
from gpu_shapes import add_engine_args, chosen_shape  # noqa: E402
from gpu_util import pct, state_bytes_per_seq  # noqa: E402
from prefix_cache_disk import disk_corruption  # noqa: E402


def config(a: argparse.Namespace, model_dir: str | None, **kw) -> EngineConfig:
    """The engine config: --model's own weights when it names one (None: the embedded model), else random ones."""
    return engine_config(a, model_dir, **({"load_format": "auto"} if a.model else {}), **kw)


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def ttft_ms(result: dict) -> float:
    return (result["stamps"][0][0] - result["start"]) * 1e3


async def workloads(engine: Engine, sizes: dict) -> dict:
    rng = random.Random(7)
    await run_one(engine, tokens(sizes["same"], rng), 4)  # warm-up at the largest prefill: compiled, allocated
    out: dict = {}

    prompt = tokens(sizes["same"], rng)
    first, second = await run_one(engine, prompt, 1), await run_one(engine, list(prompt), 1)
    out["same_prompt"] = {"prompt_tokens": len(prompt), "first_ttft_ms": ttft_ms(first),
                          "second_ttft_ms": ttft_ms(second), "second_over_first": ttft_ms(second) / ttft_ms(first)}

    prefix = tokens(sizes["prefix"], rng)
    await run_one(engine, prefix + tokens(8, rng), 1)
    start = time.perf_counter()
    results = await asyncio.gather(*[run_one(engine, prefix + tokens(sizes["tail"], rng), sizes["shared_out"])
                                     for _ in range(sizes["requests"])])
    wall = time.perf_counter() - start
    ttfts = [ttft_ms(r) for r in results]
    out["shared_prefix"] = {"requests": sizes["requests"], "prefix_tokens": len(prefix), "tail_tokens": sizes["tail"],
                            "output_tokens": sizes["shared_out"], "ttft_ms_p50": pct(ttfts, 50),
                            "ttft_ms_max": max(ttfts), "output_tok_s": sum(len(r["ids"]) for r in results) / wall}

    history, turns = tokens(sizes["turn"], rng), []
    for _ in range(sizes["turns"]):
        result = await run_one(engine, history, sizes["reply"])
        turns.append({"prompt_tokens": len(history), "ttft_ms": ttft_ms(result)})
        history = history + result["ids"] + tokens(sizes["turn"], rng)
    out["conversation"] = {"turns": turns, "last_over_first": turns[-1]["ttft_ms"] / turns[0]["ttft_ms"]}
    return out


async def host_restore(a: argparse.Namespace, model_dir: str, sizes: dict, host_gib: float) -> dict:
    """The evicted prompt's TTFT when it comes back (host tier of ``host_gib``; 0: none, recomputed)."""
    block = 16
    pool = sizes["same"] * 11 // 10 // block + 1  # room for one prompt and a bit, not two
    tiers = dict(kv_offload_host_gib=host_gib) if host_gib else {}
    engine = await Engine.create(config(a, model_dir, max_num_seqs=8, num_kv_blocks=pool, block_size=block,
                                        max_model_len=sizes["same"] + 64, **tiers))
    try:
        rng = random.Random(11)
        await run_one(engine, tokens(sizes["same"], rng), 4)  # warm-up
        prompt, other = tokens(sizes["same"], rng), tokens(sizes["same"], rng)
        first = await run_one(engine, prompt, 1)
        await run_one(engine, other, 1)  # evicts most of prompt's blocks from the device
        again = await run_one(engine, list(prompt), 1)
        stats = engine.stats()
        return {"host_gib": host_gib, "kv_blocks": pool, "first_ttft_ms": ttft_ms(first),
                "again_ttft_ms": ttft_ms(again), "kv_offload": stats["kv_offload"],
                "prefix_cache": stats["prefix_cache"]}
    finally:
        await engine.shutdown()


async def snapshot_host(a: argparse.Namespace, model_dir: str, sizes: dict, shape: dict, host: bool) -> dict:
    """Next turns of four conversations whose snapshots the device pool (2.5 of them) evicted: promoted back from
    the host tier (``host``) or recomputed."""
    room = 2.5 * state_bytes_per_seq(shape) / (1 << 30)
    tiers = dict(kv_offload_host_gib=sizes["host_gib"]) if host else {}
    engine = await Engine.create(config(a, model_dir, max_num_seqs=8, state_snapshot_gib=room,
                                        max_model_len=sizes["same"] + sizes["turn"] + 256, **tiers))
    try:
        rng = random.Random(13)
        await run_one(engine, tokens(sizes["same"], rng), 4)  # warm-up
        convs = [tokens(sizes["same"], rng) for _ in range(4)]
        replies = [await run_one(engine, prompt, sizes["reply"]) for prompt in convs]
        turns = [await run_one(engine, prompt + reply["ids"] + tokens(sizes["turn"], rng), 1)
                 for prompt, reply in zip(convs, replies)]
        stats = engine.stats()
        return {"host": host, "first_ttft_ms": [ttft_ms(r) for r in replies],
                "next_turn_ttft_ms": [ttft_ms(r) for r in turns], "state_snapshots": stats["state_snapshots"],
                "prefix_cache": stats["prefix_cache"]}
    finally:
        await engine.shutdown()


async def run(a: argparse.Namespace, model_dir: str, caching: bool, sizes: dict) -> dict:
    engine = await Engine.create(config(a, model_dir, prefix_caching=caching, max_num_seqs=64,
                                        max_model_len=sizes["max_model_len"]))
    try:
        result = await workloads(engine, sizes)
        result["prefix_cache_stats"] = engine.stats()["prefix_cache"]
        return result
    finally:
        await engine.shutdown()


def vs_off(report: dict) -> dict:
    """Each workload's figure with caching (or a tier) against without, for the sections that ran."""
    out: dict = {}
    if "on" in report:
        on, off = report["on"], report["off"]
        out["same_prompt_second_ttft"] = on["same_prompt"]["second_ttft_ms"] / off["same_prompt"]["second_ttft_ms"]
        out["shared_prefix_ttft_p50"] = on["shared_prefix"]["ttft_ms_p50"] / off["shared_prefix"]["ttft_ms_p50"]
        out["conversation_last_ttft"] = (on["conversation"]["turns"][-1]["ttft_ms"]
                                         / off["conversation"]["turns"][-1]["ttft_ms"])
    if "host_restore" in report:
        restore = report["host_restore"]
        out["host_restore_ttft"] = restore[0]["again_ttft_ms"] / restore[1]["again_ttft_ms"]
    if "snapshot_host" in report:
        tiered, device_only = report["snapshot_host"]
        out["snapshot_host_next_turn_ttft_p50"] = (pct(tiered["next_turn_ttft_ms"], 50)
                                                   / pct(device_only["next_turn_ttft_ms"], 50))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap, "prefix_cache.json")
    ap.add_argument("--sections", nargs="+", default=None,
                    choices=["host_restore", "snapshot_host", "caching", "disk_corruption"])
    ap.add_argument("--corrupt-disk-fraction", type=float, default=None,
                    help="disk_corruption: the share of the prompts' spilled block files damaged (0..1)")
    ap.add_argument("--model", default=None, help="an HF directory or .gguf, or 'embedded' (default: --shape)")
    a = ap.parse_args()
    if a.sections is None:
        a.sections = (["disk_corruption"] if a.corrupt_disk_fraction is not None else
                      ["host_restore", "snapshot_host", "caching"])
    fraction = 0.25 if a.corrupt_disk_fraction is None else a.corrupt_disk_fraction
    if not 0 <= fraction <= 1:
        ap.error("--corrupt-disk-fraction is a share of the files: between 0 and 1")
    sizes = (dict(same=256, prefix=128, tail=8, requests=8, shared_out=4, turn=48, reply=4, turns=5,
                  max_model_len=1024, host_gib=0.05) if a.quick else
             dict(same=8192, prefix=4096, tail=64, requests=32, shared_out=32, turn=1536, reply=64, turns=20,
                  max_model_len=40960, host_gib=4.0))
    # disk_corruption: the device pool holds 2.5 prompts, the host tier 1.5 (more than one prompt's evictions)
    sizes.update(dict(disk_prompt=128, disk_prompts=6, disk_out=4, disk_passes=3) if a.quick else
                 dict(disk_prompt=2048, disk_prompts=16, disk_out=16, disk_passes=3),
                 disk_pool_prompts=2.5, disk_host_prompts=1.5, disk_gib=4.0)
    if a.model is None:
        shape = chosen_shape(a.shape, a.quick)
        model_dir = write_model_dir(shape, a.tokenizer)
    else:
        model_dir = None if a.model == "embedded" else a.model
        shape = load_hf_config(resolve_model_path(model_dir))
    report: dict = {"shape": a.shape if a.model is None else None, "model": a.model, "quick": a.quick,
                    "commit": a.commit, "date": time.strftime("%Y-%m-%d %H:%M"), "sizes": sizes}
    try:
        import torch

        report["device"] = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
        if "host_restore" in a.sections:
            for host_gib in (sizes["host_gib"], 0.0):
                report.setdefault("host_restore", []).append(asyncio.run(host_restore(a, model_dir, sizes,
                                                                                      host_gib)))
        if "disk_corruption" in a.sections:
            report["disk_corruption"] = asyncio.run(disk_corruption(a, config, model_dir, shape, sizes, fraction))
            with open(a.out, "w") as handle:
                json.dump(report, handle, indent=1)
        if "snapshot_host" in a.sections and shape.get("linear_num_value_heads"):
            report["snapshot_host"] = [asyncio.run(snapshot_host(a, model_dir, sizes, shape, host))
                                       for host in (True, False)]
        for caching in (True, False) if "caching" in a.sections else ():
            report["on" if caching else "off"] = asyncio.run(run(a, model_dir, caching, sizes))
            with open(a.out, "w") as handle:
                json.dump(report, handle, indent=1)
    finally:
        if a.model is None:
            shutil.rmtree(model_dir, ignore_errors=True)
    report["vs_off"] = vs_off(report)
    with open(a.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print(json.dumps({k: report[k] for k in ("device", "shape", "model", "vs_off")}, indent=1))
    if "disk_corruption" in report:
        damage = report["disk_corruption"]
        print("disk_corruption: damaged", damage["damaged_files"], "of", damage["spilled_files"], "corrupt",
              damage["corrupt_total"], "answers match", damage["answers_match"], "served past a bad file",
              damage["served_past_bad_file"], "passes",
              [(p["corrupt_reads"], p["prompts_with_bad_file"], p["disk_hits"]) for p in damage["passes"]])
    for mode in ("on", "off") if "on" in report else ():
        r = report[mode]
        print(mode, "same 2nd/1st", round(r["same_prompt"]["second_over_first"], 3), "shared p50 ms",
              round(r["shared_prefix"]["ttft_ms_p50"], 1), "conv last/first",
              round(r["conversation"]["last_over_first"], 2))


if __name__ == "__main__":
    main()
