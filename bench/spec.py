"""Speculative decoding on one engine shape: decode throughput with the verify rows against plain decoding, at
chosen draft accuracies, and whether the tokens stay those of plain decoding on this device. JSON out.

    python3 bench/spec.py --shape qwen3-8b --commit $(git rev-parse --short HEAD) --out $OUT/spec.json
    python3 bench/spec.py --quick --device cpu      # the control flow, on a tiny shape

Random weights make n-gram drafts useless, so the drafts replay the plain run's own output (pipeline/spec/
replay.py), each wrong with probability ``error``: for each batch size, a plain run (one token a step, one step
ahead), then K drafts a row for each K and error. Per run: decode tok/s (output tokens after the first over the
time from each request's first token to its last, summed over requests at once: the batch's rate), the drafts'
acceptance, and per request the first output position where the tokens differ from the plain run's (None: equal
throughout; on a GPU the verify rows' kernels differ from one-token rows', so bf16 near-ties may go either way).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.engine import Engine  # noqa: E402
from pipeline.spec.replay import ReplayDrafter  # noqa: E402

from gpu import engine_config, prompts, run_one, write_model_dir  # noqa: E402
from gpu_shapes import add_engine_args, chosen_shape  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


async def batch_run(engine: Engine, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    results = await asyncio.gather(*[run_one(engine, p, new_tokens) for p in batch])
    first = min(r["stamps"][0][0] for r in results)
    last = max(r["stamps"][-1][0] for r in results)
    tokens = sum(len(r["ids"]) - 1 for r in results)
    return [r["ids"] for r in results], tokens / (last - first)


async def workloads(engine: Engine, sizes: dict, ks: list[int], errors: list[float]) -> list[dict]:
    decode, out = engine.decode, []
    drafter = decode.drafter
    await batch_run(engine, prompts(2, sizes["prompt"], 1), 16)  # warm-up
    for batch_size in sizes["batches"]:
        batch = prompts(batch_size, sizes["prompt"], 100 + batch_size)
        decode.drafter = None  # plain decoding, one step ahead
        plain, plain_rate = await batch_run(engine, batch, sizes["new"])
        out.append({"batch": batch_size, "k": 0, "tok_s": plain_rate})
        continuations = {tuple(p): ids for p, ids in zip(batch, plain)}
        for k in ks:
            for error in errors:
                decode.drafter = ReplayDrafter(continuations, error)
                decode.draft_budget.k = k
                before = dataclasses.replace(decode.spec, accepted_per_row=list(decode.spec.accepted_per_row))
                ids, rate = await batch_run(engine, batch, sizes["new"])
                spec = decode.spec
                drafted = spec.drafted_tokens - before.drafted_tokens
                accepted = spec.accepted_tokens - before.accepted_tokens
                rows = spec.verify_rows - before.verify_rows
                out.append({"batch": batch_size, "k": k, "error": error, "tok_s": rate, "vs_plain": rate / plain_rate,
                            "verify_rows": rows, "acceptance": accepted / drafted if drafted else None,
                            "tokens_per_row": (accepted + rows) / rows if rows else None,
                            "first_difference": [first_difference(a, b) for a, b in zip(ids, plain)]})
                print(json.dumps(out[-1]))
    decode.drafter = drafter
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap, "spec.json")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 7])
    ap.add_argument("--errors", type=float, nargs="+", default=[0.0, 0.3])
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    a = ap.parse_args()
    shape = chosen_shape(a.shape, a.quick)
    sizes = dict(prompt=32, new=24, batches=[1, 4]) if a.quick else dict(prompt=128, new=256, batches=[1, 16, 64])
    sizes["batches"] = a.batches or sizes["batches"]
    model_dir = write_model_dir(shape, a.tokenizer)
    report: dict = {"shape": a.shape, "quick": a.quick, "commit": a.commit, "date": time.strftime("%Y-%m-%d %H:%M"),
                    "sizes": sizes}
    try:
        import torch

        report["device"] = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"

        async def run() -> list[dict]:
            # prefix caching off: a repeated prompt would start from its cached blocks, its first token computed
            # by a one-token row instead of the prompt's last, which on a GPU is a different bf16 sum
            engine = await Engine.create(engine_config(a, model_dir, max_num_seqs=max(sizes["batches"]),
                                                       max_model_len=1024, speculative_method="ngram",
                                                       num_speculative_tokens=max(a.ks), prefix_caching=False))
            try:
                return await workloads(engine, sizes, a.ks, a.errors)
            finally:
                await engine.shutdown()

        report["runs"] = asyncio.run(run())
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    with open(a.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
