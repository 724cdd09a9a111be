"""bench/gpu.py's correctness section: our model against transformers on the same GPU and the same
weights (logits and greedy tokens in the engine's paged step layout)."""
from __future__ import annotations

import argparse
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from gpu_util import free_device, num_params  # noqa: E402


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int, device: str) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """transformers: prompt logits [L, V], greedy ids, the [n, V] logits they were taken from."""
    out = hf(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    prompt_logits, last, ids, steps = out.logits[0].float(), out.logits[0, -1].float(), [], []
    for i in range(n):
        ids.append(int(last.argmax()))
        steps.append(last)
        if i + 1 < n:
            out = hf(input_ids=torch.tensor([[ids[-1]]], device=device), past_key_values=out.past_key_values,
                     use_cache=True)
            last = out.logits[0, -1].float()
    return prompt_logits, ids, torch.stack(steps)


@torch.no_grad()
def paged_greedy(model, prompt: list[int], n: int, device: str, bs: int = 16):
    """Ours over a paged KV cache on ``device``: prefill then n greedy decode steps (same outputs as hf_greedy)."""
    from pipeline.models.attention import build_attention_metadata
    from pipeline.models.forward_context import ForwardContext, allocate_caches

    table = list(range(1, -(-(len(prompt) + n) // bs) + 1))
    caches = allocate_caches(model.cache_specs(model.model.embed_tokens.weight.dtype), len(table) + 1, bs, device)

    def step(ids: list[int], start: int) -> torch.Tensor:
        meta = build_attention_metadata([len(ids)], [start + len(ids)], [table], bs, device)
        hidden = model(torch.tensor(ids, device=device), torch.arange(start, start + len(ids), device=device),
                       ForwardContext(meta, caches))
        return model.compute_logits(hidden).float()

    prompt_logits = step(prompt, 0)
    last, ids, steps = prompt_logits[-1], [], []
    for i in range(n):
        ids.append(int(last.argmax()))
        steps.append(last)
        if i + 1 < n:
            last = step([ids[-1]], len(prompt) + i)[0]
    return prompt_logits, ids, torch.stack(steps)


def compare(ref, ours) -> dict:
    """Max |logit diff| (prompt, decode steps before any divergence), first divergence and margins there."""
    (rp, rids, rs), (op, oids, os_) = ref, ours
    div = next((i for i, (x, y) in enumerate(zip(rids, oids)) if x != y), None)
    upto = len(rids) if div is None else div + 1  # step `div` still has identical inputs
    top2 = lambda v: (lambda t: float(t[0] - t[1]))(v.topk(2).values)  # noqa: E731
    return {"prompt_max_abs_diff": float((rp - op).abs().max()), "ref_logit_std": float(rp.std()),
            "decode_max_abs_diff": float((rs[:upto] - os_[:upto]).abs().max()),
            "greedy_identical": div is None, "first_divergence": div,
            "ref_margin_at_divergence": None if div is None else top2(rs[div]),
            "nan": bool(torch.isnan(op).any() or torch.isnan(os_).any() or torch.isnan(rp).any()),
            "ref_tokens": rids[:8], "ours_tokens": oids[:8]}


def hf_vs_ours(a: argparse.Namespace, shape: dict, dtype: torch.dtype, prompt: list[int], n: int) -> dict:
    """transformers and ours built on the same random weights of `shape`, in `dtype`, compared."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.models.config import ModelArchConfig
    from pipeline.models.registry import build_model

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
            "rms_norm_eps", "bos_token_id", "eos_token_id")
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(a.device):
            hf = Qwen3ForCausalLM(Qwen3Config(**{k: shape[k] for k in keys})).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    ours = build_model(ModelArchConfig.from_hf(hf.config.to_dict()), hf.state_dict().items(), dtype=dtype,
                       device=a.device)
    result = {**compare(hf_greedy(hf, prompt, n, a.device), paged_greedy(ours, prompt, n, a.device)),
              "params": sum(p.numel() for p in hf.parameters()), "layers": shape["num_hidden_layers"],
              "dtype": str(dtype), "prompt_tokens": len(prompt), "new_tokens": n}
    del hf, ours
    free_device()
    return result


def correctness(a: argparse.Namespace, shape: dict) -> dict:
    """transformers vs ours on the same random weights (8B shape in bf16; its width at 12 layers in fp32,
    where rounding cannot hide an error), and the tiny model on CPU vs the device."""
    from tests.model_utils import conveyor_from_hf, make_tiny_hf_model

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    prompt = random.Random(0).choices(range(100, 150000), k=16 if a.quick else 64)
    n = 8 if a.quick else 32
    result = {"hf_vs_ours": hf_vs_ours(a, shape, dtype, prompt, n), "params_shape": num_params(shape)}
    fp32_layers = 2 if a.quick else 12
    result["hf_vs_ours_fp32"] = hf_vs_ours(a, {**shape, "num_hidden_layers": fp32_layers}, torch.float32, prompt, n)
    tiny = make_tiny_hf_model("qwen3")
    runs = [paged_greedy(conveyor_from_hf(tiny, torch.float32, dev), list(range(100, 130)), 16, dev)
            for dev in ("cpu", a.device)]
    result["tiny_cpu_vs_device_fp32"] = compare([t.cpu() if torch.is_tensor(t) else t for t in runs[0]],
                                                [t.cpu() if torch.is_tensor(t) else t for t in runs[1]])
    return result
