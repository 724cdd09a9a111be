"""FP8 against bf16 on the GPU, end to end: B1, OFF and SERVE c = 64 with random weights of the real shapes, and B1
after a long prompt with an fp8 KV cache.

    PYTHONUNBUFFERED=1 python3 bench/fp8.py --commit $(git rev-parse --short HEAD) [--shapes qwen3-8b ...]
        [--skip serve kv] [--quick]

For each shape, one engine with bf16 weights and one with `--quantization fp8` (dummy weights rounded to block FP8
and kept as FP8 on the GPU). Each B1 figure stands beside its bytes limit computed in the same run: the measured
copy bandwidth over the bytes one decode token reads, counted from the loaded model's own tensors (a MoE layer's
experts scaled by the share a token routes to, the embedding a row, a hybrid layer's recurrent state read and
written). Writes $OUT/fp8.json after every section: a list with one object per shape (the issue's fields) and
prints a table. Asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from pipeline.config import EngineConfig  # noqa: E402
from pipeline.engine import Engine  # noqa: E402

from gpu import ceilings, write_model_dir  # noqa: E402
from gpu_requests import itl_stats, off_run, prompts, run_one  # noqa: E402
from gpu_shapes import SHAPES, chosen_shape  # noqa: E402
from gpu_util import free_device, log, state_bytes_per_seq  # noqa: E402

SECTIONS = ("b1", "off", "serve", "kv")


def decode_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode token reads: every tensor once, except a MoE block's expert tensors (the
    share of experts a token uses) and the token embedding (one row)."""
    from pipeline.models.moe import SparseMoeBlock

    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            experts = [t for _, t in list(module.named_parameters(recurse=False)) +
                       list(module.named_buffers(recurse=False)) if t is not None and t.dim() >= 1]
            count = max(t.shape[0] for t in experts)
            used = module.top_k + (1 if count > module.num_local_experts else 0)  # a folded shared expert
            for t in experts:
                seen.add(id(t))
                total += t.numel() * t.element_size() * (used / count if t.shape[0] == count else 1)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        total += nbytes // t.shape[0] if "embed_tokens" in name else nbytes
    return int(total)


def engine_config(model_dir: str, quantization: str | None, **kw) -> EngineConfig:
    return EngineConfig(**{**dict(model=model_dir, device="cuda", dtype="bfloat16", load_format="dummy",
                                  max_num_seqs=256, max_num_batched_tokens=8192, quantization=quantization), **kw})


async def b1_off(a: argparse.Namespace, model_dir: str, shape: dict, quantization: str | None, copy_gbps: float,
                 out: dict) -> None:
    """Fills ``out`` as it goes: a section that fails keeps the ones before it."""
    engine = await Engine.create(engine_config(model_dir, quantization), progress=lambda m: log(f"  engine: {m}"))
    out.update(weights=quantization or "bf16", kv_blocks=engine.cache.capacity)
    try:
        model = engine.loaded.runner.model
        nbytes = decode_bytes_per_token(model) + 2 * state_bytes_per_seq(shape)
        out.update(b1_bytes=nbytes, b1_limit_tok_s=copy_gbps * 1e9 / nbytes,
                   weight_bytes=sum(t.numel() * t.element_size() for t in model.parameters()))
        if "b1" not in a.skip:
            plen, n = (32, 16) if a.quick else (128, 256)
            ps = prompts(4, plen, 1)
            await run_one(engine, ps[0], n)
            runs = [itl_stats(await run_one(engine, p, n)) for p in ps[1:]]
            best = max(runs, key=lambda r: r["tok_s"])
            out["b1"] = {**best, "runs_tok_s": [r["tok_s"] for r in runs], "frac_of_limit":
                         best["tok_s"] / out["b1_limit_tok_s"]}
            log(f"  B1 {best['tok_s']:.1f} tok/s of {out['b1_limit_tok_s']:.0f} ({quantization or 'bf16'})")
        if "off" not in a.skip:
            nreq, plen, n = (8, 64, 8) if a.quick else (256, 512, 128)
            await asyncio.gather(*[run_one(engine, p, 8) for p in prompts(min(nreq, 32), plen, 2)])
            off = await off_run(engine, {"shape": shape}, nreq, plen, n, seed=3)
            out["off"] = {k: off[k] for k in ("requests", "prompt_tokens", "output_tokens", "wall_s", "output_tok_s",
                                              "total_tok_s", "ttft_s", "device_steps", "mixed_steps", "preemptions")}
            log(f"  OFF {off['output_tok_s']:.0f} output tok/s ({quantization or 'bf16'})")
    finally:
        await engine.shutdown()
        del engine
        free_device()


async def b1_long_kv(a: argparse.Namespace, model_dir: str, kv_dtype: str) -> dict:
    """B1 after a long prompt: the step reads the prompt's K/V every token, so the KV dtype shows."""
    plen = 1024 if a.quick else 32768
    engine = await Engine.create(engine_config(model_dir, None, kv_cache_dtype=kv_dtype, max_num_seqs=8))
    try:
        await run_one(engine, prompts(1, plen, 8)[0], 16)
        runs = [itl_stats(await run_one(engine, prompts(1, plen, 9 + i)[0], 256)) for i in range(2)]
        best = max(runs, key=lambda r: r["tok_s"])
        log(f"  B1 after {plen} tokens, KV {kv_dtype}: {best['tok_s']:.1f} tok/s")
        return {**best, "prompt_tokens": plen, "kv_cache_dtype": kv_dtype, "kv_blocks": engine.cache.capacity}
    finally:
        await engine.shutdown()
        del engine
        free_device()


def serve_c64(a: argparse.Namespace, model_dir: str, quantization: str | None, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"serve_{quantization or 'bf16'}.json")
    args = "--load-format dummy --dtype bfloat16 --device cuda --max-num-seqs 64" + (
        f" --quantization {quantization}" if quantization else "")
    c = "4" if a.quick else "64"
    cmd = [sys.executable, "bench/serve.py", "--model", model_dir, "--out", out, "--server-args", args,
           "--min-concurrency", c, "--max-concurrency", c, "--prompt-tokens", "32" if a.quick else "512",
           "--output-tokens", "8" if a.quick else "128"]
    subprocess.run(cmd, cwd=ROOT, timeout=420, check=True)
    with open(out) as handle:
        level = json.load(handle)["levels"][-1]
    log(f"  SERVE c={c}: {level['output_tok_s']} tok/s ({quantization or 'bf16'})")
    return level


def main() -> None:
    out_dir = os.environ.get("OUT", ".")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(out_dir, "fp8.json"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".peer", "tokenizer"))
    ap.add_argument("--shapes", nargs="*", default=["qwen3-8b", "qwen3.5-35b-a3b"], choices=sorted(SHAPES))
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    ap.add_argument("--quick", action="store_true", help="tiny shapes and workloads (the control flow)")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/fp8.py needs a CUDA device; nothing to do here")
        return
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT).stdout.strip()
    gpu = torch.cuda.get_device_name(0)
    copy_gbps = ceilings(argparse.Namespace(quick=a.quick, device="cuda"))["copy_GBps"]
    log(f"copy bandwidth {copy_gbps:.0f} GB/s")
    results: list[dict] = []

    def write() -> None:
        with open(a.out, "w") as handle:
            json.dump(results, handle, indent=1)

    for name in a.shapes:
        shape = chosen_shape(name, a.quick)
        model_dir = write_model_dir(shape, a.tokenizer)
        entry: dict = {"shape": name, "commit": commit, "gpu": gpu, "copy_GBps": copy_gbps,
                       "command": " ".join(["python3", "bench/fp8.py", *sys.argv[1:]]), "errors": {}}
        results.append(entry)
        hybrid = bool(shape.get("linear_num_value_heads"))
        steps = [(f"{fmt}", lambda fmt=fmt: b1_off_entry(a, entry, model_dir, shape, fmt, copy_gbps))
                 for fmt in ("bf16", "fp8") if not {"b1", "off"} <= set(a.skip)]
        if hybrid and "serve" not in a.skip:
            steps += [(f"serve_{fmt}", lambda fmt=fmt: entry.__setitem__(
                f"serve_c64_{fmt}", serve_c64(a, model_dir, None if fmt == "bf16" else "fp8", out_dir)))
                      for fmt in ("bf16", "fp8")]
        if not hybrid and "kv" not in a.skip:
            steps += [(f"kv_{kv}", lambda kv=kv: entry.__setitem__(
                f"b1_long_kv_{kv}", asyncio.run(b1_long_kv(a, model_dir, kv)))) for kv in ("auto", "fp8")]
        for label, fn in steps:
            log(f"== {name} {label}")
            started = time.perf_counter()
            try:
                fn()
            except Exception:  # noqa: BLE001 - one section failing must not lose the others
                entry["errors"][label] = traceback.format_exc()
                log(f"{label} FAILED:\n{entry['errors'][label]}")
            free_device()
            entry.setdefault("seconds", {})[label] = round(time.perf_counter() - started, 1)
            write()
        summarize(entry)
        write()
        shutil.rmtree(model_dir, ignore_errors=True)
    for entry in results:
        print(json.dumps({k: v for k, v in entry.items() if k not in ("errors", "detail")}))
    log(f"wrote {a.out}")


def b1_off_entry(a: argparse.Namespace, entry: dict, model_dir: str, shape: dict, fmt: str, copy_gbps: float) -> None:
    out = entry.setdefault("detail", {}).setdefault(fmt, {})
    asyncio.run(b1_off(a, model_dir, shape, None if fmt == "bf16" else "fp8", copy_gbps, out))


def summarize(entry: dict) -> None:
    """The issue's fields, from the detail of each run."""
    detail = entry.get("detail", {})
    for fmt in ("bf16", "fp8"):
        run = detail.get(fmt, {})
        entry[f"b1_{fmt}_tok_s"] = run.get("b1", {}).get("tok_s")
        entry[f"b1_{fmt}_limit_tok_s"] = run.get("b1_limit_tok_s")
        entry[f"off_{fmt}_tok_s"] = run.get("off", {}).get("output_tok_s")
    entry["b1_fp8_limit_tok_s"] = detail.get("fp8", {}).get("b1_limit_tok_s")
    for fmt in ("bf16", "fp8"):
        if f"serve_c64_{fmt}" in entry:
            entry[f"serve_c64_{fmt}_tok_s"] = entry[f"serve_c64_{fmt}"].get("output_tok_s")


if __name__ == "__main__":
    main()
