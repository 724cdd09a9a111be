"""Perplexity of the embedded SmolLM2-135M (a Q4_1 GGUF, loaded dequantized into float) on a fixed public-domain text,
for each weight and KV format: fp32, bf16, --quantization fp8 (block FP8 of the dequantized GGUF weights) and
--kv-cache-dtype fp8 (the GGUF has no KV scales: 1.0), each FP8 variant beside the 16/32-bit compute it runs in. The
text goes through the model as the engine loads it, in prefill chunks over the paged KV cache (so every chunk's
attention reads the earlier ones' K/V from the cache, fp8 where the variant says). Prints JSON (with --out, also into
that file); asserts nothing.

    .venv/bin/python bench/perplexity.py [--chunk 512] [--variants fp32,bf16,...] [--out bench/results/...json]
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pipeline.config import EngineConfig  # noqa: E402
from pipeline.loading import LoadedModel, load_model  # noqa: E402
from pipeline.models.attention import build_attention_metadata  # noqa: E402
from pipeline.models.forward_context import ForwardContext  # noqa: E402
from report import emit_json  # noqa: E402  (bench/ is on sys.path when run as a script)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "tests", "data", "alice-wonderland-opening.txt")
BLOCK_SIZE = 16
# name -> (dtype, --quantization, --kv-cache-dtype, the variant it is compared with)
VARIANTS: dict[str, tuple[str, str | None, str, str | None]] = {
    "fp32": ("float32", None, "auto", None),
    "bf16": ("bfloat16", None, "auto", "fp32"),
    "fp8-weights-fp32": ("float32", "fp8", "auto", "fp32"),
    "fp8-weights-bf16": ("bfloat16", "fp8", "auto", "bf16"),
    "fp8-kv-fp32": ("float32", None, "fp8", "fp32"),
    "fp8-kv-bf16": ("bfloat16", None, "fp8", "bf16"),
}


def read_text(path: str) -> tuple[str, str]:
    """(provenance header line, the text after it)."""
    with open(path, encoding="utf-8") as handle:
        header, _, body = handle.read().partition("\n")
    return header.lstrip("# ").strip(), body


@torch.inference_mode()
def negative_log_likelihoods(loaded: LoadedModel, ids: list[int], chunk: int) -> torch.Tensor:
    """-log p(token i | tokens before it) for i = 1 .. len(ids) - 1, prompt chunks of ``chunk`` tokens over the
    paged cache (blocks 1 .. n in order; block 0 is the null block)."""
    model, caches = loaded.runner.model, loaded.runner.caches
    table = list(range(1, 1 + -(-len(ids) // BLOCK_SIZE)))
    losses = []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        meta = build_attention_metadata([end - start], [end], [table], BLOCK_SIZE)
        context = ForwardContext(meta, caches, state_slots=torch.zeros(1, dtype=torch.int32))
        hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), context)
        logits = model.compute_logits(hidden).float()
        targets = torch.tensor(ids[start + 1:end + 1])
        losses.append(torch.nn.functional.cross_entropy(logits, targets, reduction="none"))
    return torch.cat(losses)


def measure(name: str, text: str, chunk: int, threads: int) -> dict:
    dtype, quantization, kv_dtype, _ = VARIANTS[name]
    config = EngineConfig(device="cpu", dtype=dtype, quantization=quantization, kv_cache_dtype=kv_dtype,
                          block_size=BLOCK_SIZE, num_kv_blocks=4096 // BLOCK_SIZE + 2, cpu_threads=threads)
    started = time.monotonic()
    loaded = load_model(config.resolved())
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > (config.num_kv_blocks - 1) * BLOCK_SIZE:
        raise ValueError(f"the text is {len(ids)} tokens, more than the {config.num_kv_blocks - 1} blocks hold")
    nll = negative_log_likelihoods(loaded, ids, chunk)
    return {"dtype": dtype, "quantization": quantization, "kv_cache_dtype": str(loaded.kv_dtype).removeprefix("torch."),
            "weights": loaded.weight_format or "as loaded", "tokens_scored": int(nll.numel()),
            "mean_nll": float(nll.mean()), "perplexity": math.exp(float(nll.mean())),
            "seconds": round(time.monotonic() - started, 1)}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per forward)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    provenance, text = read_text(args.text)
    names = [n for n in args.variants.split(",") if n]
    results = {name: measure(name, text, args.chunk, args.threads) for name in names}
    for name, result in results.items():
        baseline = VARIANTS[name][3]
        if baseline in results:
            ratio = result["perplexity"] / results[baseline]["perplexity"]
            result["vs"] = {"variant": baseline, "perplexity_ratio": ratio, "change_percent": 100 * (ratio - 1)}
    emit_json({"bench": "perplexity", "model": "embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float)",
               "text": {"path": os.path.relpath(args.text, ROOT), "provenance": provenance},
               "chunk": args.chunk, "commit": commit(), "machine": platform.processor() or platform.machine(),
               "threads": args.threads, "results": results}, args.out)


if __name__ == "__main__":
    main()
