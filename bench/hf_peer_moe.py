"""The transformers peer on the MoE shapes, random bf16 weights: Qwen3MoeForCausalLM (Qwen3-30B-A3B-shaped) or
Qwen3_5MoeForCausalLM (Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults).

    python3 bench/hf_peer_moe.py --out $OUT/hf_peer_moe.json [--shape qwen3.5-35b-a3b] [--off-requests 64]
                                 [--skip-static] [--layers 4]

The method of the dense peer (../shared/tools/hf_peer.py, the Qwen3-8B shape) carried over to the MoE model
(61 GB in bf16, built directly on the GPU: an H200). In order, each in its own try (a failure lands in "errors",
the rest still run) and the JSON rewritten after each:
  ceilings : copy bandwidth (bytes read + written) and the bf16 matmul rate
  B1       : batch-1 greedy decode, 128-token prompt, 256 new tokens, as transformers runs it by default: a dynamic KV
             cache, then a static one (generate compiles the decode step; its warm-up is a full run)
  B1 pinned: the dynamic cache again with each other experts implementation held for prefill and decode alike
             (hf_b1_dynamic_tok_s_<impl>)
  OFF      : generate_batch (continuous batching, paged sdpa), N requests of 512 prompt / 128 new tokens
  BATCH    : the hybrid shape (its recurrent layers have no paged cache for generate_batch): one generate() call on
             N prompts of 512 tokens, 128 new tokens each (equal lengths: no padding), output tok/s
The B1 limit is copy bandwidth / the bytes one decode step reads at batch 1 (active_bytes_per_token: attention,
router, top-k experts, norms and lm_head of the config, one embedding row).

Experts implementations (transformers 5.24, integrations/moe.py ExpertsInterface): "eager" (the model's loop over the
experts hit), "grouped_mm" (torch grouped GEMM over all experts with offsets), "batched_mm" (gathers each token's
top-k expert weights, then bmm), and "deepgemm" / "sonicmoe" (hub kernels through the `kernels` package: not
measured, the device has no network). A model built without one gets "grouped_mm"; generate() on a non-CPU device
then switches to "batched_mm" for its decode steps (GenerationMixin._optimize_model_for_decode), so the default B1
prefills with grouped_mm and decodes with batched_mm; the pinned runs turn that switch off.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
import traceback
from collections.abc import Callable, Iterator

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from gpu_util import state_bytes_per_seq  # noqa: E402 (bench/ is on sys.path when run as bench/hf_peer_moe.py)

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)
# --tiny: the control flow on the CPU in seconds (no ceilings, no static cache)
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=1024)
QWEN3_5_35B_A3B = dict(model_type="qwen3_5_moe_text")  # the config class's defaults are the 35B-A3B shape
TINY_HYBRID = dict(QWEN3_5_35B_A3B, vocab_size=512, hidden_size=64, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   max_position_embeddings=1024)
SHAPES = {"qwen3-30b-a3b": (QWEN3_30B_A3B, TINY), "qwen3.5-35b-a3b": (QWEN3_5_35B_A3B, TINY_HYBRID)}
PINNED = ("grouped_mm", "eager")  # measured after the default, fastest expected first
T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[hf_peer_moe {time.perf_counter() - T0:6.1f}s] {message}", flush=True)


def ceilings() -> dict:
    """Copy bandwidth of a 2 GiB bf16 tensor (read + write) and the bf16 rate of an 8192^3 matmul, CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def ms(fn: Callable[[], object], iters: int = 10) -> float:
        for _ in range(3):
            fn()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    copy_GBps = 2 * x.numel() * x.element_size() / ms(lambda x=x, y=y: y.copy_(x)) / 1e6
    del x, y
    n = 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    tflops = 2 * n**3 / ms(lambda: a @ b) / 1e9
    return {"copy_GBps": copy_GBps, "bf16_TFLOPs": tflops}


def is_moe_layer(c: Qwen3MoeConfig, layer: int) -> bool:
    return layer not in c.mlp_only_layers and c.num_experts > 0 and (layer + 1) % c.decoder_sparse_step == 0


def layer_params(c: Qwen3MoeConfig, layer: int, experts: int) -> int:
    """One decoder layer's parameters with `experts` of its experts (a dense-MLP layer: its whole MLP)."""
    h, d = c.hidden_size, c.head_dim
    attention = h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 2 * d  # q k v o, q/k norms
    mlp = experts * 3 * h * c.moe_intermediate_size + c.num_experts * h if is_moe_layer(c, layer) \
        else 3 * h * c.intermediate_size  # experts' gate/up/down + the router; or a dense MLP
    return attention + mlp + 2 * h  # + the two RMSNorms


def config_params(c: Qwen3MoeConfig) -> int:
    layers = sum(layer_params(c, i, c.num_experts) for i in range(c.num_hidden_layers))
    return c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + layers + c.hidden_size


def active_bytes_per_token(model: torch.nn.Module, element_size: int = 2) -> int:
    """Weight bytes one batch-1 decode step reads: every parameter but the experts not chosen (each MoE layer reads
    top-k of its experts), and of the embedding one row (untied: lm_head is read whole)."""
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    unused = experts * (c.num_experts - c.num_experts_per_tok) // c.num_experts
    embedding = model.get_input_embeddings().weight.numel()
    return element_size * (total - unused - embedding + c.hidden_size)


def build(shape: dict, device: str) -> torch.nn.Module:
    """Random weights (transformers' own init), created on `device` in bf16: no host copy of 61-70 GB."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if shape.get("model_type", "qwen3_moe") == "qwen3_moe":
                return Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape)).eval()
            config = AutoConfig.for_model(**shape)
            return AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)


class ExpertsSeen:
    """A pre-hook on one experts module: which implementation ran, for calls on several tokens (prefill, batches)
    and on one (batch-1 decode)."""

    def __init__(self, model: Qwen3MoeForCausalLM) -> None:
        self.seen: dict[str, set[str]] = {"tokens>1": set(), "tokens=1": set()}
        experts = next(m for m in model.modules() if type(m).__name__.endswith("MoeExperts"))
        self.handle = experts.register_forward_pre_hook(self.hook)

    def hook(self, module: torch.nn.Module, args: tuple) -> None:
        phase = "tokens=1" if args[0].shape[0] == 1 else "tokens>1"
        self.seen[phase].add(str(module.config._experts_implementation))

    def remove(self) -> dict[str, list[str]]:
        self.handle.remove()
        return {k: sorted(v) for k, v in self.seen.items()}


@contextlib.contextmanager
def pinned(model: Qwen3MoeForCausalLM, impl: str) -> Iterator[None]:
    """`impl` for every experts call, generate()'s decode-time switch to batched_mm turned off."""
    before = model.get_experts_implementation()
    model.set_experts_implementation(impl)
    model._optimize_model_for_decode = contextlib.nullcontext  # instance attribute shadows the GenerationMixin method
    try:
        yield
    finally:
        del model._optimize_model_for_decode
        model.set_experts_implementation(before)


def b1_tok_s(model: Qwen3MoeForCausalLM, prompt: torch.Tensor, new_tokens: int, warmup_tokens: int,
             **generation: object) -> float:
    """Greedy decode of exactly `new_tokens` after a warm-up generate of `warmup_tokens`: new tokens / wall time."""
    def config(n: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0, **generation)

    with torch.inference_mode():
        model.generate(prompt, generation_config=config(warmup_tokens))
        sync(model)
        start = time.perf_counter()
        out = model.generate(prompt, generation_config=config(new_tokens))
        sync(model)
        wall = time.perf_counter() - start
    return (out.shape[1] - prompt.shape[1]) / wall


def sync(model: torch.nn.Module) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def off(model: Qwen3MoeForCausalLM, requests: list[list[int]], new_tokens: int) -> dict:
    """generate_batch (paged sdpa): a warm-up on 8 requests, then all at once; output and total tok/s."""
    model.set_attn_implementation("sdpa")  # paged by generate_batch: 5.24 deprecates the "paged|" prefix of sdpa
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=requests[:8], generation_config=config)  # not under inference_mode: breaks it
    sync(model)
    start = time.perf_counter()
    outs = model.generate_batch(inputs=requests, generation_config=config)
    sync(model)
    wall = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outs.values())
    prompt_tokens = sum(len(r) for r in requests)
    return {"hf_off_out_tok_s": produced / wall, "hf_off_total_tok_s": (produced + prompt_tokens) / wall,
            "off_wall_s": wall, "off_output_tokens": produced, "off_prompt_tokens": len(requests[0]),
            "off_new_tokens": new_tokens}


def batch_generate(model: torch.nn.Module, requests: list[list[int]], new_tokens: int) -> dict:
    """One generate() over all requests (equal prompt lengths, so no padding), after a warm-up on 2 of them."""
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    ids = torch.tensor(requests, device=model.device)
    with torch.inference_mode():
        model.generate(ids[:2], generation_config=config)
        sync(model)
        start = time.perf_counter()
        out = model.generate(ids, generation_config=config)
        sync(model)
        wall = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"hf_batch_out_tok_s": produced / wall, "batch_wall_s": wall, "batch_requests": len(requests),
            "batch_prompt_tokens": ids.shape[1], "batch_new_tokens": new_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--off-requests", type=int, default=64, help="OFF requests (0: skip OFF)")
    ap.add_argument("--new-tokens", type=int, default=256, help="B1 new tokens")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (a quick check)")
    ap.add_argument("--skip-static", action="store_true", help="no static-cache B1 (its compile takes minutes)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # CPU dry run of the control flow
    a = ap.parse_args()
    tiny = a.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny else "cuda"
    full, small = SHAPES[a.shape]
    shape = dict(small if tiny else full)
    hybrid = a.shape == "qwen3.5-35b-a3b"
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    new_tokens, prompt_len, off_requests = (8, 16, min(a.off_requests, 2)) if tiny else \
        (a.new_tokens, 128, a.off_requests)
    off_prompt, off_new = (32, 8) if tiny else (512, 128)
    res: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "transformers": transformers.__version__, "torch": torch.__version__, "shape": shape,
                 "tiny": tiny, "b1_prompt_tokens": prompt_len, "b1_new_tokens": new_tokens,
                 "off_requests": off_requests, "errors": {}, "seconds": {}}

    def write() -> None:
        if a.out:
            with open(a.out, "w") as handle:
                json.dump(res, handle, indent=1, default=str)

    def step(name: str, fn: Callable[[], dict | None]) -> None:
        log(f"== {name}")
        t, got = time.perf_counter(), {}
        try:
            got = fn() or {}
            res.update(got)
        except Exception:  # noqa: BLE001 - one measurement failing must not lose the others
            res["errors"][name] = traceback.format_exc()
            log(f"{name} FAILED:\n{res['errors'][name]}")
        res["seconds"][name] = round(time.perf_counter() - t, 1)
        log(f"{name} done in {res['seconds'][name]}s {json.dumps(got)}")
        write()

    if device == "cuda":
        step("ceilings", ceilings)
    try:
        model = build(shape, device)
    except Exception:  # nothing else can run: keep the ceilings and the reason, then fail
        res["errors"]["build"] = traceback.format_exc()
        write()
        raise
    c = model.config
    res["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    if not hybrid:
        res["config_weight_bytes"] = 2 * config_params(c)  # the formula beside the model's own count
    res["active_bytes_per_token"] = active_bytes_per_token(model)
    res["state_bytes_per_token"] = 2 * state_bytes_per_seq(c.to_dict())  # read and written once a token
    if "copy_GBps" in res:
        res["b1_limit_tok_s"] = res["copy_GBps"] * 1e9 / (res["active_bytes_per_token"] + res["state_bytes_per_token"])
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    default_impl = c._experts_implementation
    res["experts"] = {"offered": ["eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys())], "default": default_impl}
    res["experts_implementation"] = default_impl
    log(f"model built: {res['weight_bytes'] / 1e9:.1f} GB, {res['active_bytes_per_token'] / 1e9:.2f} GB read per "
        f"decoded token, experts {default_impl}")
    write()

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, c.vocab_size, (1, prompt_len), generator=g).to(device)
    warmup = min(16, new_tokens)

    def b1_default() -> dict:
        seen = ExpertsSeen(model)
        try:
            tok_s = b1_tok_s(model, prompt, new_tokens, warmup)
        finally:
            res["experts"]["b1_default_ran"] = seen.remove()
        return {"hf_b1_dynamic_tok_s": tok_s}

    step("b1_dynamic", b1_default)
    # the warm-up compiles the decode step; a shorter one would size another cache
    if not (a.skip_static or tiny or hybrid):
        step("b1_static", lambda: {"hf_b1_static_tok_s": b1_tok_s(model, prompt, new_tokens, new_tokens,
                                                                   cache_implementation="static")})
    decode_default = (res["experts"].get("b1_default_ran", {}).get("tokens=1") or [default_impl])[-1]
    for impl in () if hybrid else PINNED:  # the hybrid's B1 is minutes a run: the default only
        if impl == default_impl and impl == decode_default:
            continue  # the default run already ran it throughout

        def b1_pinned(impl: str = impl) -> dict:
            with pinned(model, impl):
                return {f"hf_b1_dynamic_tok_s_{impl}": b1_tok_s(model, prompt, new_tokens, warmup)}

        step(f"b1_dynamic_{impl}", b1_pinned)
    if off_requests > 0:
        requests = [torch.randint(0, c.vocab_size, (off_prompt,), generator=g).tolist() for _ in range(off_requests)]

        def off_seen() -> dict:
            seen = ExpertsSeen(model)
            try:
                return off(model, requests, off_new)
            finally:
                res["experts"]["off_ran"] = seen.remove()

        step("batch" if hybrid else "off", lambda: batch_generate(model, requests, off_new) if hybrid else off_seen())
    res["seconds"]["total"] = round(time.perf_counter() - T0, 1)
    write()
    print(json.dumps({k: v for k, v in res.items() if k != "errors"}, indent=1, default=str))
    if res["errors"]:
        log(f"errors in: {sorted(res['errors'])}")
    log(f"wrote {a.out}" if a.out else "done (no --out)")


if __name__ == "__main__":
    main()
