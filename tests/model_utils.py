"""Test helpers for the dense model family: tiny transformers configs/models, converting them to Conveyor
models, and driving a Conveyor model over a paged KV cache (prefill, chunked prefill, batches, greedy decode).

transformers is test-only: it is imported lazily inside the helpers that need it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipeline.models.attention import AttentionMetadata, build_attention_metadata
from pipeline.models.config import ModelArchConfig
from pipeline.models.forward_context import ForwardContext, allocate_caches
from pipeline.models.registry import build_model

SMOLLM2_VOCAB = 49152  # the SmolLM2 tokenizer's vocab size, so tiny models can share its tokenizer

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5_text": "Qwen3_5TextConfig",
    "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
}
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def tiny_config(model_type: str, **overrides):
    """A tiny transformers config: hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), intermediate 128,
    vocab 49152, eager attention. ``overrides`` are config kwargs (e.g. ``rope_parameters={...}``,
    ``tie_word_embeddings=True``, ``num_hidden_layers=3``)."""
    import transformers
    import transformers.models.qwen3_5
    import transformers.models.qwen3_5_moe

    try:
        name = _CONFIG_CLASSES[model_type]
        cls = getattr(transformers, name, None) or getattr(transformers.models.qwen3_5, name, None) or getattr(
            transformers.models.qwen3_5_moe, name)
    except KeyError:
        raise ValueError(f"no tiny config for {model_type!r}; known: {sorted(_CONFIG_CLASSES)}") from None
    kwargs = dict(
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    if model_type in ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        kwargs.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    if model_type in HYBRID_TYPES:  # 3 Gated DeltaNet layers, then gated full attention
        kwargs.update(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4)
    if model_type in ("qwen3_next", "qwen3_5_moe_text"):
        kwargs.update(shared_expert_intermediate_size=32)  # = moe_intermediate_size: folded into the experts
    if model_type == "qwen3_5_moe_text":
        kwargs.pop("intermediate_size")
    kwargs.update(overrides)
    cfg = cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def make_tiny_hf_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random transformers CausalLM (eager attention, eval). Every parameter is drawn from ``seed``
    (norm weights around 1, biases non-zero) so that logits are well separated and biases/norms matter."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model.to(dtype).eval()


def arch_of(hf_model) -> ModelArchConfig:
    return ModelArchConfig.from_hf(hf_model.config.to_dict())


def conveyor_from_hf(hf_model, dtype: torch.dtype = torch.float32, device="cpu"):
    """Build the Conveyor model for a transformers model, from its state_dict (HF names)."""
    return build_model(arch_of(hf_model), hf_model.state_dict().items(), dtype=dtype, device=device)


@torch.no_grad()
def hf_greedy(hf_model, prompt: Sequence[int], max_new_tokens: int = 0):
    """transformers reference -> (logits at every prompt position [L, V] float32, greedy continuation,
    the [V] logits each generated token was taken from)."""
    from transformers import DynamicCache

    ids = torch.tensor([list(prompt)], dtype=torch.long)
    out = hf_model(input_ids=ids, past_key_values=DynamicCache(config=hf_model.config), use_cache=True)
    prompt_logits = out.logits[0].float()
    generated: list[int] = []
    step_logits: list[torch.Tensor] = []
    last = prompt_logits[-1]
    for i in range(max_new_tokens):
        nxt = int(last.argmax())
        generated.append(nxt)
        step_logits.append(last)
        if i + 1 == max_new_tokens:
            break
        out = hf_model(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        last = out.logits[0, -1].float()
    return prompt_logits, generated, step_logits


@dataclass
class PagedRun:
    prompt_logits: list[torch.Tensor]  # per sequence: [prompt_len, V] float32
    generated: list[list[int]]  # per sequence: greedy tokens
    decode_logits: list[list[torch.Tensor]]  # per sequence: the [V] logits each generated token was taken from
    block_tables: list[list[int]]
    caches: list[torch.Tensor]  # by cache index, as model.cache_specs() declared them
    step_kinds: list[str] = field(default_factory=list)  # "decode" | "prefill" | "mixed" per forward step


def _chunk_sizes(chunks: int | Sequence[int] | None, n: int) -> list[int]:
    """Split a prompt of n tokens into chunks (sizes cycled; None = one chunk)."""
    if chunks is None:
        return [n]
    sizes = [chunks] if isinstance(chunks, int) else list(chunks)
    out, i = [], 0
    while sum(out) < n:
        out.append(min(sizes[i % len(sizes)], n - sum(out)))
        i += 1
    return out


def allocate_blocks(
    lengths: Sequence[int], block_size: int, num_blocks: int | None = None, shuffle: bool = True, seed: int = 0
) -> tuple[list[list[int]], int]:
    """Non-contiguous block tables covering each length, from a shuffled pool. -> (tables, num_blocks)."""
    need = [math.ceil(n / block_size) for n in lengths]
    total = num_blocks if num_blocks is not None else sum(need) + 3
    if total < sum(need):
        raise ValueError(f"{total} blocks cannot hold {sum(need)}")
    if shuffle:
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        order = list(range(total))
    tables, i = [], 0
    for k in need:
        tables.append(order[i : i + k])
        i += k
    return tables, total


def make_step_metadata(
    query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int
) -> AttentionMetadata:
    return build_attention_metadata(query_lens, seq_lens, block_tables, block_size)


@torch.no_grad()
def run_paged(
    model,
    token_ids_per_seq: Sequence[Sequence[int]],
    max_new_tokens: int = 0,
    *,
    block_size: int = 4,
    chunks: int | Sequence[int] | None = None,
    batched: bool = True,
    shuffle_blocks: bool = True,
    num_blocks: int | None = None,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> PagedRun:
    """Prefill (optionally chunked) then greedy decode, over a freshly allocated paged KV cache.

    batched=True runs all sequences in the same steps: each step holds the next prompt chunk of every sequence
    still prefilling and one decode token of every other unfinished sequence, so mixed lengths give mixed
    prefill+decode steps and the tail is decode-only. batched=False runs the sequences one after another.
    """
    prompts = [list(p) for p in token_ids_per_seq]
    tables, nb = allocate_blocks(
        [len(p) + max_new_tokens for p in prompts], block_size, num_blocks, shuffle_blocks, seed
    )
    dtype = model.model.embed_tokens.weight.dtype
    device = model.model.embed_tokens.weight.device  # the model's: a CUDA model runs its steps there
    n = len(prompts)
    specs = model.cache_specs(dtype) if kv_dtype is None else model.cache_specs(dtype, kv_dtype)  # K/V only
    caches = allocate_caches(specs, nb, block_size, device, num_state_slots=n + 2)
    # recurrent state slots: 1..n+1 shuffled (slot 0 is the null slot), so no sequence sits in slot order
    state_slot = (torch.randperm(n + 1, generator=torch.Generator().manual_seed(seed + 1)) + 1).tolist()
    plans = [_chunk_sizes(chunks, len(p)) for p in prompts]
    tokens = [list(p) for p in prompts]
    computed = [0] * n
    chunk_idx = [0] * n
    prompt_logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    generated: list[list[int]] = [[] for _ in range(n)]
    decode_logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    kinds: list[str] = []

    def unfinished(b: int) -> bool:
        return computed[b] < len(prompts[b]) or len(generated[b]) < max_new_tokens

    groups = [list(range(n))] if batched else [[b] for b in range(n)]
    for group in groups:
        while True:
            active = [b for b in group if unfinished(b)]
            if not active:
                break
            ids, pos, qlens, slens, prefilling = [], [], [], [], []
            for b in active:
                if computed[b] < len(prompts[b]):
                    q = plans[b][chunk_idx[b]]
                    chunk_idx[b] += 1
                    prefilling.append(True)
                else:
                    q = 1
                    prefilling.append(False)
                start = computed[b]
                ids += tokens[b][start : start + q]
                pos += list(range(start, start + q))
                qlens.append(q)
                slens.append(start + q)
            meta = build_attention_metadata(qlens, slens, [tables[b] for b in active], block_size, device=device)
            kinds.append("decode" if not any(prefilling) else ("prefill" if all(prefilling) else "mixed"))
            ctx = ForwardContext(meta, caches, state_slots=torch.tensor([state_slot[b] for b in active],
                                                                        dtype=torch.int32, device=device))
            hidden = model(torch.tensor(ids, dtype=torch.long, device=device),
                           torch.tensor(pos, dtype=torch.long, device=device), ctx)
            qsl = meta.query_start_loc_host
            for i, b in enumerate(active):
                if prefilling[i]:
                    logits = model.compute_logits(hidden[qsl[i] : qsl[i + 1]])
                    prompt_logits[b].append(logits)
                    last = logits[-1]
                else:
                    last = model.compute_logits(hidden[qsl[i + 1] - 1 : qsl[i + 1]])[0]
                computed[b] += qlens[i]
                if computed[b] >= len(prompts[b]) and len(generated[b]) < max_new_tokens:
                    nxt = int(last.argmax())
                    generated[b].append(nxt)
                    decode_logits[b].append(last)
                    tokens[b].append(nxt)
    return PagedRun(
        prompt_logits=[torch.cat(pl) for pl in prompt_logits],
        generated=generated,
        decode_logits=decode_logits,
        block_tables=tables,
        caches=caches,
        step_kinds=kinds,
    )


def add_mtp_weights(directory, model_type: str, seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """Give a tiny hybrid checkpoint an MTP head (``mtp.*``, as Qwen3-Next / Qwen3.5 checkpoints hold it; transformers
    builds none): its decoder layer is a full-attention layer of another random model of the same config, in
    transformers' names. Written as a second shard with an index; returns the tensors."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    directory = Path(directory)
    donor = make_tiny_hf_model(model_type, seed=seed + 1000, **overrides)
    config = donor.config
    layer = donor.model.layers[list(config.layer_types).index("full_attention")]
    tensors = {f"mtp.layers.0.{name}": t.contiguous() for name, t in layer.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    size = config.hidden_size
    tensors["mtp.fc.weight"] = torch.randn(size, 2 * size, generator=gen) / math.sqrt(2 * size)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # zero-centred: the scale is 1 + w
        tensors[f"mtp.{name}.weight"] = 0.2 * torch.randn(size, generator=gen)
    save_file(tensors, directory / "mtp.safetensors")
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        weight_map = {name: "model.safetensors" for name in handle.keys()}
    weight_map.update({name: "mtp.safetensors" for name in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def write_dflash_drafter(directory, target_config: dict, target_layer_ids: Sequence[int], seed: int = 0,
                         num_layers: int = 2, block_size: int = 6,
                         mask_token_id: int = 49000) -> dict[str, torch.Tensor]:
    """A tiny random DFlash drafter for a target, as the reference checkpoints hold it: a Qwen3 config with
    ``block_size`` and ``dflash_config``, weights named ``layers.N.*``, ``fc``, ``hidden_norm``, ``norm`` (no
    embedding or lm_head: the target's are used). Returns the tensors."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    size, heads, kv_heads, head_dim, inter = target_config["hidden_size"], 4, 2, 16, 96
    config = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=size, intermediate_size=inter,
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, vocab_size=target_config["vocab_size"], rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=1024, tie_word_embeddings=False, block_size=block_size,
                  num_target_layers=target_config["num_hidden_layers"],
                  dflash_config=dict(target_layer_ids=list(target_layer_ids), mask_token_id=mask_token_id))
    (directory / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=gen)

    tensors = {"fc.weight": matrix(size, len(target_layer_ids) * size), "hidden_norm.weight": norm(size),
               "norm.weight": norm(size)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": matrix(heads * head_dim, size),
                        p + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, size),
                        p + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, size),
                        p + "self_attn.o_proj.weight": matrix(size, heads * head_dim),
                        p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
                        p + "mlp.gate_proj.weight": matrix(inter, size), p + "mlp.up_proj.weight": matrix(inter, size),
                        p + "mlp.down_proj.weight": matrix(size, inter),
                        p + "input_layernorm.weight": norm(size), p + "post_attention_layernorm.weight": norm(size)})
    save_file(tensors, directory / "model.safetensors")
    return tensors
