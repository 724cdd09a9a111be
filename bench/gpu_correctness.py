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

TINY_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # tests/model_utils builds these


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
    """Ours over a paged KV cache on ``device`` (and state slot 1 for a hybrid model's recurrent layers): prefill
    then n greedy decode steps (same outputs as hf_greedy)."""
    from pipeline.models.attention import build_attention_metadata
    from pipeline.models.forward_context import ForwardContext, allocate_caches

    table = list(range(1, -(-(len(prompt) + n) // bs) + 1))
    caches = allocate_caches(model.cache_specs(model.model.embed_tokens.weight.dtype), len(table) + 1, bs, device,
                             num_state_slots=2)
    slots = torch.ones(1, dtype=torch.int32, device=device)

    def step(ids: list[int], start: int) -> torch.Tensor:
        meta = build_attention_metadata([len(ids)], [start + len(ids)], [table], bs, device)
        hidden = model(torch.tensor(ids, device=device), torch.arange(start, start + len(ids), device=device),
                       ForwardContext(meta, caches, state_slots=slots))
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


def hf_model(shape: dict, dtype: torch.dtype, device: str):
    """transformers' model of the shape's model_type with its own random init, built on ``device`` in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(shape["model_type"], **{k: v for k, v in shape.items()
                                                          if k not in ("model_type", "architectures", "torch_dtype")})
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def hf_vs_ours(a: argparse.Namespace, shape: dict, dtype: torch.dtype, prompt: list[int], n: int) -> dict:
    """transformers and ours built on the same random weights of `shape`, in `dtype`, compared."""
    from pipeline.models.config import ModelArchConfig
    from pipeline.models.registry import build_model

    hf = hf_model(shape, dtype, a.device)
    ours = build_model(ModelArchConfig.from_hf(hf.config.to_dict()), hf.state_dict().items(), dtype=dtype,
                       device=a.device)
    ref, mine = hf_greedy(hf, prompt, n, a.device), paged_greedy(ours, prompt, n, a.device)
    result = {**compare(ref, mine),
              "params": sum(p.numel() for p in hf.parameters()), "layers": shape["num_hidden_layers"],
              "model_type": shape["model_type"], "dtype": str(dtype), "prompt_tokens": len(prompt),
              "new_tokens": n}
    del ours
    free_device()
    if dtype != torch.float32 and "linear_num_value_heads" in shape:
        # random-weight hybrids amplify 16-bit rounding: set both against the fp32 forward of the same weights
        weights = {k: v.float() for k, v in hf.state_dict().items()}
        del hf
        free_device()
        hf = hf_model(shape, torch.float32, a.device)
        hf.load_state_dict(weights)
        del weights
        with torch.no_grad():
            truth = hf(input_ids=torch.tensor([prompt], device=a.device)).logits[0].float()
        result["prompt_vs_fp32_max_abs_diff"] = {"transformers": float((ref[0] - truth).abs().max()),
                                                 "ours": float((mine[0] - truth).abs().max())}
    del hf
    free_device()
    return result


def correctness(a: argparse.Namespace, shape: dict) -> dict:
    """transformers vs ours on the same random weights (the shape in bf16, a hybrid shape at 8 layers; its width at
    12 layers (hybrid: 4) in fp32, where rounding cannot hide an error), and the tiny model on CPU vs the device."""
    from tests.model_utils import conveyor_from_hf, make_tiny_hf_model

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    prompt = random.Random(0).choices(range(100, 150000), k=16 if a.quick else 64)
    n = 8 if a.quick else 32
    # a hybrid shape's transformers model runs its recurrent layers in torch and both models must fit at once:
    # 8 of its layers (two attention layers) in bf16, 4 in fp32
    bf16_layers = shape["num_hidden_layers"] if "linear_num_value_heads" not in shape or a.quick else 8
    result = {"hf_vs_ours": hf_vs_ours(a, {**shape, "num_hidden_layers": bf16_layers}, dtype, prompt, n),
              "params_shape": num_params(shape)}
    fp32_layers = 4 if "linear_num_value_heads" in shape else 2 if a.quick else 12
    result["hf_vs_ours_fp32"] = hf_vs_ours(a, {**shape, "num_hidden_layers": fp32_layers}, torch.float32, prompt, n)
    tiny = make_tiny_hf_model(shape["model_type"] if shape["model_type"] in TINY_TYPES else "qwen3")
    runs = [paged_greedy(conveyor_from_hf(tiny, torch.float32, dev), list(range(100, 130)), 16, dev)
            for dev in ("cpu", a.device)]
    result["tiny_cpu_vs_device_fp32"] = compare([t.cpu() if torch.is_tensor(t) else t for t in runs[0]],
                                                [t.cpu() if torch.is_tensor(t) else t for t in runs[1]])
    return result
