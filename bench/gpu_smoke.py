"""GPU smoke check for the engine (a first look before the GPU issue's full benchmark):
a tiny random Llama must give the same greedy tokens on CPU (fp32) and CUDA (fp32), and a
SmolLM2-shaped random model is timed on CUDA in bf16 through the whole pipeline. Prints JSON.

    python bench/gpu_smoke.py --tokenizer DIR [--out FILE]

DIR holds tokenizer.json/tokenizer_config.json (the SmolLM2 tokenizer); weights are random.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pipeline.config import EngineConfig  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.request import SamplingParams  # noqa: E402
from report import emit_json  # noqa: E402  (bench/ is on sys.path when run as a script)


def write_random_llama(directory: str, tokenizer_dir: str, **shape) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, **shape)
    LlamaForCausalLM(config).save_pretrained(directory)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), directory)
    return directory


async def greedy(model_dir: str, device: str, dtype: str, prompts: list[list[int]], tokens: int,
                 cuda_graphs: bool = True) -> list[list[int]]:
    engine = await Engine.create(EngineConfig(model=model_dir, device=device, dtype=dtype, num_kv_blocks=256,
                                              max_num_seqs=8, cuda_graphs=cuda_graphs))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    try:
        async def one(prompt):
            out = []
            async for delta in engine.generate(prompt_token_ids=prompt, params=params):
                out.extend(delta.token_ids)
            return out
        return list(await asyncio.gather(*[one(p) for p in prompts]))
    finally:
        await engine.shutdown()


async def timed(model_dir: str, concurrency: int, new_tokens: int, cuda_graphs: bool = True) -> dict:
    engine = await Engine.create(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16",
                                              max_num_seqs=max(16, concurrency), cuda_graphs=cuda_graphs))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    try:
        async def one(seed):
            prompt = [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(128)]
            first = None
            count = 0
            async for delta in engine.generate(prompt_token_ids=prompt, params=params):
                first = first or time.perf_counter()
                count += len(delta.token_ids)
            return first, count, time.perf_counter()
        await one(0)
        start = time.perf_counter()
        first, count, end = await one(1)
        b1 = (count - 1) / (end - first)
        start = time.perf_counter()
        results = await asyncio.gather(*[one(s) for s in range(concurrency)])
        wall = time.perf_counter() - start
        return {"batch1_decode_tok_s": b1, f"concurrent{concurrency}_output_tok_s": sum(r[1] for r in results) / wall}
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_random_llama(os.path.join(tmp, "tiny"), args.tokenizer, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024)
        prompts = [[(i * 31 + j * 17) % 40000 + 100 for j in range(5 + 7 * i)] for i in range(6)]
        cpu = asyncio.run(greedy(tiny, "cpu", "float32", prompts, 32))
        gpu = asyncio.run(greedy(tiny, "cuda", "float32", prompts, 32))
        eager = asyncio.run(greedy(tiny, "cuda", "float32", prompts, 32, cuda_graphs=False))
        report["tiny_cpu_equals_gpu"] = cpu == gpu
        report["tiny_cuda_graphs_equal_eager"] = gpu == eager
        report["tiny_first_divergence"] = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                           for x, y in zip(cpu, gpu)]
        smol = write_random_llama(os.path.join(tmp, "smol"), args.tokenizer, hidden_size=576, intermediate_size=1536,
                                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                  max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0)
        report["attention_and_ops_path"] = "torch_ref" if os.environ.get("CONVEYOR_DISABLE_TRITON") == "1" else "triton"
        report["smollm2_shape_bf16"] = asyncio.run(timed(smol, 16, 128))
        print(json.dumps(report), flush=True)
        report["smollm2_shape_bf16_eager"] = asyncio.run(timed(smol, 16, 128, cuda_graphs=False))
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
