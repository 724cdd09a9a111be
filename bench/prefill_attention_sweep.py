"""Launch choices of the Triton prefill attention at one long-context shape; JSON out.

    python3 bench/prefill_attention_sweep.py --out $OUT/prefill_sweep.json [--prompt 1600 --prefix 30336]
    python3 bench/prefill_attention_sweep.py --compare --out $OUT/prefill_compare.json

Default shape: the last turn of ``bench/prefix_cache.py``'s conversation on the Qwen3-8B shape (1,600 new tokens after
30,336 cached, 32 query heads over 8 KV heads of 128, blocks of 16). Each variant is a ``TritonAttentionPlan``
(rows x keys a tile, warps, pipeline stages, KV splits); the default heuristic is the first row. TFLOP/s counts
4 x head_dim FLOPs a query-key pair a head, as ``bench/kernel_attention.py`` does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernel_attention import bench_prefill_attention  # noqa: E402
from kernels.triton_paged_attention import TritonAttentionPlan  # noqa: E402

# (BLOCK_M rows, BLOCK_N keys, warps, stages, splits); None: the heuristic's
VARIANTS = [(None, None, None, None, None), (128, 64, 8, 3, 2), (128, 64, 8, 3, 3), (128, 64, 8, 3, 4),
            (128, 128, 8, 3, 1), (128, 128, 8, 3, 3), (128, 64, 8, 2, 1), (128, 64, 8, 4, 1), (64, 64, 4, 3, 1),
            (64, 64, 4, 3, 3), (128, 32, 4, 3, 1), (256, 64, 8, 3, 1)]


# --compare: the default against the one before it (64 keys a tile, no split once the tiles fill the GPU) at
# (new tokens, cached tokens): the conversation's first and last turns, an 8k prompt, its last block after 8k cached
COMPARE = [(1600, 30336), (1536, 0), (8192, 0), (16, 8176), (4096, 4096)]


def before_default(prompt: int, prefix: int, heads: int, kv_heads: int, head_dim: int) -> TritonAttentionPlan:
    """The launch choices before 128-key tiles and wave splits (16-bit: 128 x 64, 64 x 32 for head_dim 256)."""
    from kernels.triton_paged_attention import PREFILL_MAX_SPLITS, PREFILL_SPLIT_KEYS

    block_m, block_n, stages = (128, 64, 3) if head_dim <= 128 else (64, 32, 2)
    programs = (prompt // max(1, block_m // (heads // kv_heads)) + 1) * kv_heads
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = 1 if programs >= sms else max(1, min(-(-2 * sms // programs), (prompt + prefix) // PREFILL_SPLIT_KEYS,
                                                  PREFILL_MAX_SPLITS))
    return TritonAttentionPlan(prefill_block_m=block_m, prefill_block_n=block_n, prefill_warps=8,
                               prefill_stages=stages, prefill_splits=splits)


def compare(a: argparse.Namespace) -> list[dict]:
    rows = []
    for prompt, prefix in COMPARE:
        before = before_default(prompt, prefix, a.heads, a.kv_heads, a.head_dim)
        for name, plan in (("before", before), ("default", None)):
            r = bench_prefill_attention(1, prompt, prefix, a.heads, a.kv_heads, a.head_dim, plan=plan)
            r["variant"] = name
            rows.append(r)
            print(prompt, prefix, name, round(r["time_ms"], 3), "ms", round(r["tflops"], 1), "TFLOP/s",
                  r["max_abs_err"], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1600)
    ap.add_argument("--prefix", type=int, default=30336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "prefill_sweep.json"))
    ap.add_argument("--compare", action="store_true", help="the default against the one before it (COMPARE)")
    a = ap.parse_args()
    rows = compare(a) if a.compare else []
    for bm, bn, warps, stages, splits in () if a.compare else VARIANTS:
        plan = TritonAttentionPlan(prefill_block_m=bm, prefill_block_n=bn, prefill_warps=warps,
                                   prefill_stages=stages, prefill_splits=splits)
        try:
            r = bench_prefill_attention(1, a.prompt, a.prefix, a.heads, a.kv_heads, a.head_dim, plan=plan)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
        r["variant"] = {"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "splits": splits}
        rows.append(r)
        print(r["variant"], round(r.get("time_ms", float("nan")), 3), "ms", round(r.get("tflops", 0.0), 1),
              "TFLOP/s", r.get("max_abs_err", r.get("error")), flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
