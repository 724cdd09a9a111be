"""Choosing the CUDA defaults: the SERVE ladder per step token budget, OFF per (budget, seats), and
what each engine's start cost (KV profiling, CUDA graph capture).

    PYTHONUNBUFFERED=1 python3 bench/gpu_defaults.py [--budgets 512 2048 4096 8192] [--quick --device cpu]

Model: the Qwen3-8B shape with random bf16 weights, as bench/gpu.py. Writes $OUT/gpu_defaults.json
after every run and prints a summary. Asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu import engine_config, subprocess_json, write_model_dir  # noqa: E402
from gpu_requests import prompts, run_one  # noqa: E402
from gpu_shapes import QUICK, QWEN3_8B  # noqa: E402
from gpu_util import free_device, log, pct  # noqa: E402

from pipeline.engine import Engine  # noqa: E402


async def off_run(a: argparse.Namespace, model_dir: str, budget: int, seats: int) -> dict:
    """Engine start time, then OFF: all requests at once (one warm-up round first)."""
    started = time.perf_counter()
    engine = await Engine.create(engine_config(a, model_dir, max_num_seqs=seats, max_num_batched_tokens=budget))
    start_s = time.perf_counter() - started
    try:
        nreq, plen, n = (8, 64, 8) if a.quick else (a.off_requests, 512, 128)
        await asyncio.gather(*[run_one(engine, p, 8) for p in prompts(min(nreq, 32), plen, 2)])
        before, start = engine.stats(), time.perf_counter()
        res = await asyncio.gather(*[run_one(engine, p, n) for p in prompts(nreq, plen, 3)])
        wall, after = time.perf_counter() - start, engine.stats()
        out, ttft = sum(len(r["ids"]) for r in res), [r["stamps"][0][0] - start for r in res]
        graphs = engine.loaded.runner.graphs
        return {"max_num_batched_tokens": budget, "max_num_seqs": seats, "engine_start_s": round(start_s, 1),
                "graph_sizes": len(graphs.sizes) if graphs is not None else 0, "kv_blocks": engine.cache.capacity,
                "requests": nreq, "output_tok_s": round(out / wall, 1), "wall_s": round(wall, 2),
                "ttft_s": {"p50": pct(ttft, 50), "max": max(ttft)},
                **{k: after[k] - before[k] for k in ("device_steps", "mixed_steps", "preemptions")}}
    finally:
        await engine.shutdown()
        del engine
        free_device()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_defaults.json"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".peer", "tokenizer"))
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    ap.add_argument("--serve-seats", type=int, default=256)
    ap.add_argument("--off", nargs="+", default=["2048,64", "2048,256", "8192,256", "16384,256"],
                    help="OFF runs as BUDGET,SEATS")
    ap.add_argument("--off-requests", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    shape = {**QWEN3_8B, **QUICK} if a.quick else QWEN3_8B
    model_dir = write_model_dir(shape, a.tokenizer)
    report: dict = {"benchmark": "gpu_defaults", "date": time.strftime("%Y-%m-%d"), "shape": shape, "serve": [],
                    "off": [], "errors": []}
    if a.device == "cuda":
        import torch
        report["device"] = torch.cuda.get_device_name(0)
    write = lambda: open(a.out, "w").write(__import__("json").dumps(report, indent=1))  # noqa: E731
    for budget in a.budgets:
        serve_out = os.path.join(os.path.dirname(os.path.abspath(a.out)), f"serve-{budget}.json")
        cmd = [sys.executable, "bench/serve.py", "--model", model_dir, "--out", serve_out,
               "--server-args", f"--load-format dummy --dtype {'bfloat16' if a.device == 'cuda' else 'float32'} "
                                f"--device {a.device} --max-num-seqs {a.serve_seats} --max-num-batched-tokens {budget}",
               "--max-concurrency", "4" if a.quick else "64", "--prompt-tokens", "32" if a.quick else "512",
               "--output-tokens", "8" if a.quick else "128"]
        try:
            result = subprocess_json(cmd, serve_out, 300)
            os.remove(serve_out)
            report["serve"].append({"max_num_batched_tokens": budget, "max_num_seqs": a.serve_seats,
                                    "levels": result["levels"]})
            log(f"serve budget {budget}: " + " ".join(f"c{lv['concurrency']}={lv['output_tok_s']}"
                                                      for lv in result["levels"]))
        except Exception:  # noqa: BLE001 - one run failing must not lose the others
            report["errors"].append(traceback.format_exc())
        write()
    for pair in a.off:
        budget, seats = (int(x) for x in pair.split(","))
        try:
            row = asyncio.run(off_run(a, model_dir, budget, seats))
            report["off"].append(row)
            log(f"off {row}")
        except Exception:  # noqa: BLE001
            report["errors"].append(traceback.format_exc())
        write()
    shutil.rmtree(model_dir, ignore_errors=True)
    print(f"\n{'budget':>7s} {'seats':>5s} " + " ".join(f"{'c' + str(lv['concurrency']):>7s}"
                                                       for lv in (report['serve'] or [{'levels': []}])[0]['levels'])
          + "   ttft50@c64  itl99@c64")
    for row in report["serve"]:
        top = row["levels"][-1]
        print(f"{row['max_num_batched_tokens']:7d} {row['max_num_seqs']:5d} "
              + " ".join(f"{lv['output_tok_s']:7.0f}" for lv in row["levels"])
              + f"   {top['ttft_ms']['p50']:9} {top['itl_ms']['p99']:9}")
    for row in report["off"]:
        print(f"OFF budget {row['max_num_batched_tokens']:6d} seats {row['max_num_seqs']:4d}: "
              f"{row['output_tok_s']:8.0f} out tok/s, ttft p50 {row['ttft_s']['p50']:.2f}s, start "
              f"{row['engine_start_s']}s ({row['graph_sizes']} graphs), preemptions {row['preemptions']}")
    print(f"errors: {len(report['errors'])}")


if __name__ == "__main__":
    main()
