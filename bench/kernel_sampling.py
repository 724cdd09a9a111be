"""Microbenchmark of the sort-free sampling cutoff (kernels/triton_sampling.py) against the sort-based reference on
CUDA (imports fine on CPU; call only with a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.kernel_attention import cuda_time_ms
from kernels.triton_sampling import topk_topp_minp_cutoff_ref, topk_topp_minp_cutoff_triton


def bench_cutoff(S: int, V: int = 151936, iters: int = 20) -> dict:
    """CUDA: mean ms of the Triton cutoff vs the sort-based reference on random logits, for top_p=0.9 alone
    (``triton_ms``, ``sort_ms``) and top_k=50 + top_p=0.9 (``triton_topk_ms``, ``sort_topk_ms``); ``sort_only_ms``
    times the bare descending sort, the floor of any sort-based filter. ``mismatched_rows``: kept sets that differ."""

    def mean_ms(fn: Callable[[], object]) -> float:
        return cuda_time_ms(fn, iters, warmup=3)

    dev = torch.device("cuda")
    logits = torch.randn(S, V, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    top_p = torch.full((S,), 0.9, device=dev)
    min_p = torch.zeros(S, device=dev)

    result: dict = {"S": S, "V": V, "mismatched_rows": 0}
    for tag, k in (("", 0), ("topk_", 50)):
        top_k = torch.full((S,), k, dtype=torch.long, device=dev)
        args = (logits, top_k, top_p, min_p)
        result[f"triton_{tag}ms"] = mean_ms(lambda args=args: topk_topp_minp_cutoff_triton(*args))
        result[f"sort_{tag}ms"] = mean_ms(lambda args=args: topk_topp_minp_cutoff_ref(*args))
        kept = logits >= topk_topp_minp_cutoff_triton(*args)[:, None]
        kept_ref = logits >= topk_topp_minp_cutoff_ref(*args)[:, None]
        result["mismatched_rows"] += int((kept != kept_ref).any(dim=-1).sum())
    result["sort_only_ms"] = mean_ms(lambda: logits.sort(dim=-1, descending=True))
    return result
