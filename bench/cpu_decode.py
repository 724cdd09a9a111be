"""CPU benchmark of the embedded model: batch-1 decode and 16-request throughput, beside
transformers' generate() on the same prompts in the same run. Prints JSON; asserts nothing.

    .venv/bin/python bench/cpu_decode.py [--new-tokens 128] [--concurrency 16] [--skip-transformers]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pipeline.config import EngineConfig  # noqa: E402
from pipeline.embedded import embedded_model_path  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.request import SamplingParams  # noqa: E402
from report import emit_json  # noqa: E402  (bench/ is on sys.path when run as a script)

PROMPTS = [
    "Explain how a hash map works.", "Write a short poem about the sea.", "What is 17 times 23?",
    "List three uses of copper.", "Describe the water cycle.", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "What is a prime number?", "Summarize the plot of Hamlet.",
    "How do vaccines work?", "Write a Python function that reverses a string.", "What causes tides?",
    "Name the planets of the solar system.", "What is photosynthesis?", "Explain recursion simply.",
    "Tell me a fun fact about octopuses.",
]


async def engine_bench(new_tokens: int, concurrency: int, dtype: str, run_ahead: bool = True) -> dict:
    engine = await Engine.create(EngineConfig(dtype=dtype, max_num_seqs=max(16, concurrency), run_ahead=run_ahead))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    messages = lambda p: [{"role": "user", "content": p}]  # noqa: E731
    try:
        async def one(prompt: str) -> tuple[float, float, int]:
            start = time.perf_counter()
            first = None
            count = 0
            async for delta in engine.generate(messages=messages(prompt), params=params):
                if first is None:
                    first = time.perf_counter()
                count += len(delta.token_ids)
            return start, first or start, count, time.perf_counter()

        await one(PROMPTS[0])  # warm-up
        runs = [await one(PROMPTS[i]) for i in range(3)]
        decode_rates = [(n - 1) / (end - first) for start, first, n, end in runs]
        ttfts = [first - start for start, first, n, end in runs]
        start = time.perf_counter()
        results = await asyncio.gather(*[one(PROMPTS[i % len(PROMPTS)]) for i in range(concurrency)])
        wall = time.perf_counter() - start
        tokens = sum(r[2] for r in results)
        return {
            "batch1_decode_tok_s": max(decode_rates),
            "batch1_decode_tok_s_runs": decode_rates,
            "batch1_ttft_s": min(ttfts),
            f"concurrent{concurrency}_output_tok_s": tokens / wall,
            f"concurrent{concurrency}_wall_s": wall,
            "stats": {k: engine.stats()[k] for k in ("device_steps", "mixed_steps", "preemptions")},
        }
    finally:
        await engine.shutdown()


def transformers_bench(new_tokens: int, concurrency: int, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_path()
    directory, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()
    encode = lambda p: tokenizer.apply_chat_template([{"role": "user", "content": p}],  # noqa: E731
                                                     add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=tokenizer.eos_token_id)
    with torch.inference_mode():
        model.generate(**encode(PROMPTS[0]), **kwargs)  # warm-up
        rates = []
        for i in range(2):
            inputs = encode(PROMPTS[i])
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(**inputs, **kwargs)
            rates.append((new_tokens - 1) / (time.perf_counter() - start - prefill))
        tokenizer.padding_side = "left"
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                               add_generation_prompt=True, tokenize=False)
                 for i in range(concurrency)]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        model.generate(**batch, **kwargs)
        wall = time.perf_counter() - start
    return {"batch1_decode_tok_s": max(rates), "batch1_decode_tok_s_runs": rates,
            f"concurrent{concurrency}_output_tok_s": concurrency * new_tokens / wall,
            f"concurrent{concurrency}_wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--disable-run-ahead", action="store_true")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "cpu_decode",
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantized)",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
                   f"{torch.get_num_threads()}",
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "new_tokens": args.new_tokens,
        "conveyor": asyncio.run(engine_bench(args.new_tokens, args.concurrency, args.dtype,
                                             not args.disable_run_ahead)),
        "notes": "decode tok/s = (tokens - 1) / (time from first to last token); transformers: generate() "
                 "greedy, prefill time (a 1-token generate) subtracted; concurrent = 16 requests at once "
                 "(transformers: one left-padded batch)",
    }
    report["conveyor"]["dtype"] = args.dtype
    if not args.skip_transformers:
        key = f"concurrent{args.concurrency}_output_tok_s"
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            peer = transformers_bench(args.new_tokens, args.concurrency, dtype)
            peer["batch1_speedup"] = report["conveyor"]["batch1_decode_tok_s"] / peer["batch1_decode_tok_s"]
            peer["concurrent_speedup"] = report["conveyor"][key] / peer[key]
            report[f"transformers_{name}"] = peer
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
