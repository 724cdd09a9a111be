"""Model loading for the engine: weights, tokenizer, limits, and the KV pool size."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kernels.dispatch import use_triton
from pipeline.config import EngineConfig
from pipeline.dist.comm import CommStage
from pipeline.dist.ranks import ParallelContext
from pipeline.memory.snapshot_tiers import snapshot_host_gib
from pipeline.model_family import family_chat_template
from pipeline.model_limits import ModelLimits, generation_defaults
from pipeline.models.config import ModelArchConfig
from pipeline.models.forward_context import PagedKVSpec, StateSlotSpec
from pipeline.models.dflash import ContextTap, DFlashDraftModel, dflash_arch, dflash_config
from pipeline.errors import CheckpointError
from pipeline.models.loader import iter_weights, load_generation_config, load_hf_config, resolve_model_path
from pipeline.models.quantization import ONLINE_FP8, checkpoint_scheme
from pipeline.models.quantized_weights import (CheckpointWeights, apply_kv_scales, checkpoint_weights,
                                               quantize_dummy_weights)
from pipeline.models.registry import build_model, finish_model
from pipeline.runner.model_runner import ModelRunner
from pipeline.spec.budget import KEPT_STATES_PER_ROW, MAX_DRAFT_ROWS
from pipeline.spec.drafter import Drafter
from pipeline.spec.drafter_factory import make_drafter
from pipeline.thinking import ThinkingTags
from pipeline.tokenizer import Tokenizer

@dataclass(slots=True)
class LoadedModel:
    path: str
    arch: ModelArchConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    limits: ModelLimits
    num_blocks: int
    dtype: torch.dtype
    device: torch.device
    drafter: Drafter | None = None  # speculation's drafter (pipeline/spec/), None without
    kv_dtype: torch.dtype | None = None  # the attention layers' KV cache (--kv-cache-dtype; None: dtype)
    weight_format: str = ""  # the weights' quantization, where there is one ("fp8 e4m3, 128x128 blocks (fp8)")


def cpu_has_native_bf16() -> bool:
    """bf16 math in hardware (AVX512-BF16 or AMX) and oneDNN able to use it: then bf16 serving on
    the CPU is ~1.6x faster than fp32 here; without it bf16 is emulated and slower."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "").split()
    except OSError:
        return False
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return native and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "fp16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(dtypes)}")
    return dtypes[name]


FP8_KV_MIN_CAPABILITY = (8, 9)  # Triton compiles the e4m3 type from sm_89 (Ada, Hopper) on


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: auto keeps the model's dtype; fp8 stores e4m3 blocks, which the torch attention paths and
    the CUDA kernels read and write (kernels/triton_fp8_kv.py). The kernels cannot compile for an older GPU: refused
    there in one line before anything loads."""
    if name == "auto":
        return dtype
    if use_triton(device):
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_KV_MIN_CAPABILITY:
            raise ValueError(f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later: the Triton "
                             f"attention and KV-write kernels read and write e4m3, which Triton compiles from sm_89 "
                             f"on; this GPU is sm_{capability[0]}{capability[1]} (leave it at auto)")
    return torch.float8_e4m3fn


def model_weights(config: EngineConfig, path: str, hf_config: dict, arch: ModelArchConfig, dtype: torch.dtype,
                  device: torch.device) -> tuple[CheckpointWeights | None, Callable[[torch.nn.Module], None], str]:
    """The weight stream (None: random weights), what runs on the loaded model before it is packed (the checkpoint's
    KV scales, or dummy weights rounded to FP8), and the weights' quantization in words ("" for none)."""
    if config.load_format == "dummy":
        try:
            fp8 = config.quantization == "fp8" or checkpoint_scheme(hf_config) is not None
        except CheckpointError:
            fp8 = False
        return None, quantize_dummy_weights if fp8 else (lambda model: None), ONLINE_FP8.describe() if fp8 else ""
    offset, count = arch.expert_shard.experts(arch.num_experts) if arch.num_experts else (0, 0)
    local = (offset, offset + count) if arch.num_experts and count < arch.num_experts else None
    weights = checkpoint_weights(path, hf_config, config.quantization, dtype, device, local)
    scheme = weights.scheme or weights.online
    return weights, lambda model: apply_kv_scales(model, weights.kv_scales), scheme.describe() if scheme else ""


def eos_token_ids(tokenizer: Tokenizer, hf_config: dict, generation_config: dict) -> frozenset[int]:
    """Every eos id the model declares: tokenizer, config.json and generation_config.json."""
    ids: set[int] = set()
    for source in (hf_config.get("eos_token_id"), generation_config.get("eos_token_id"), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(x) for x in source)
    return frozenset(ids)


def num_snapshots(config: EngineConfig, runner: ModelRunner, memory_bytes: int | None = None) -> int:
    """Recurrent-state snapshots of a hybrid model with prefix caching (0 otherwise). ``memory_bytes``: what the KV
    blocks and snapshots share (CPU); snapshots take at most half of it, so the blocks they resume stay."""
    if not runner.bytes_per_snapshot or not config.prefix_caching:
        return 0
    budget = int(config.state_snapshot_gib * (1 << 30))
    if memory_bytes is not None:
        budget = min(budget, memory_bytes // 2)
    return max(0, budget) // runner.bytes_per_snapshot


def load_model(config: EngineConfig, progress: Callable[[str], None] | None = None,
               parallel: ParallelContext | None = None) -> LoadedModel:
    """``parallel``: this rank's place in an expert-parallel split (pipeline/dist/): the model holds its share of
    the experts, and every rank runs this in step (the GPU's profiling forwards sum over the ranks). Drafters live on
    the head only (the MTP head holds all its experts there)."""
    say = progress or (lambda message: None)
    path = resolve_model_path(config.model)
    device = parallel.device if parallel is not None else torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, device)
    head = parallel is None or parallel.is_head
    say(f"reading {path}")
    hf_config = load_hf_config(path)
    arch = ModelArchConfig.from_hf(hf_config)
    check_max_model_len(config.max_model_len, arch.max_position_embeddings, path)
    if parallel is not None:
        if not arch.num_experts:
            raise ValueError(f"{arch.model_type} has no experts: --ep-size needs a mixture-of-experts model")
        arch = replace(arch, expert_shard=parallel.group.shard)
        if arch.is_hybrid and split_linear_attention(config):
            arch = replace(arch, linear_head_shard=parallel.group.shard)
    tokenizer = Tokenizer.from_pretrained(path)
    generation_config = load_generation_config(path)
    dummy = config.load_format == "dummy"
    shard = f", experts {arch.expert_shard.experts(arch.num_experts)} of rank {parallel.rank}" if parallel else ""
    weights, after_weights, weight_format = model_weights(config, path, hf_config, arch, dtype, device)
    kept = use_triton(device)  # the GPU keeps FP8 weights as FP8 (pipeline/models/fp8_storage.py)
    quantized = f", {weight_format} {'kept in fp8' if kept else 'dequantized'}" if weight_format else ""
    say(f"{'building random' if dummy else 'loading'} {arch.model_type} weights ({arch.num_layers} layers{shard}"
        f"{quantized}) as {dtype} on {device}")
    model = build_model(arch, weights, dtype, device, mtp=config.speculative_method == "mtp" and head,
                        after_weights=after_weights)
    if parallel is not None:
        model.join_expert_group(parallel.group)
    draft_model = (load_draft_model(config, arch, dtype, device, say)
                   if config.speculative_method == "draft" and head else None)
    if config.speculative_method == "dflash" and head:
        draft_model = load_dflash_model(config, arch, dtype, device, say)
        model.layer_tap = ContextTap(draft_model, len(model.cache_specs(dtype)))
    # hybrid models with speculation: spare state slots that keep a verify row's state after each of its tokens, K a
    # sequence that may draft, up to KEPT_STATES_PER_ROW on average (pipeline/spec/budget.py)
    spare = (min(config.max_num_seqs, MAX_DRAFT_ROWS) * min(config.num_speculative_tokens, KEPT_STATES_PER_ROW)
             if config.speculative_method else 0)
    runner = ModelRunner(model, vocab_size=arch.vocab_size, block_size=config.block_size, dtype=dtype, device=device,
                         max_num_seqs=config.max_num_seqs + spare,
                         extra_cache_specs=draft_model.cache_specs(dtype) if draft_model is not None else (),
                         kv_dtype=kv_dtype)
    runner.rows_as_decode = config.exact_speculation  # verify rows as one-token decode rows (kernels/dispatch.py)
    cpu_memory = (int(config.kv_cache_memory_gib * (1 << 30)) - runner.state_bytes
                  if device.type != "cuda" and not config.num_kv_blocks else None)
    snapshots = num_snapshots(config, runner, cpu_memory)
    snapshot_bytes = snapshots * runner.bytes_per_snapshot
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    elif device.type == "cuda":
        say(f"profiling a {config.max_num_batched_tokens}-token step to size the KV cache")
        num_blocks = runner.kv_blocks_for_gpu(config.gpu_memory_utilization, config.max_num_batched_tokens,
                                              config.max_num_seqs, reserve_bytes=(1 << 30) + snapshot_bytes)
    else:
        num_blocks = max(2, (cpu_memory - snapshot_bytes) // runner.bytes_per_block)
    if parallel is not None:
        num_blocks = agree_on_caches(parallel, runner, num_blocks, snapshots)
    runner.allocate_caches(num_blocks)
    runner.allocate_snapshots(snapshots)
    pool_tokens = (num_blocks - 1) * config.block_size
    max_model_len = min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings, pool_tokens)
    if config.max_model_len and max_model_len < config.max_model_len:
        say(f"warning: --max-model-len {config.max_model_len} is more than the KV cache holds for one sequence "
            f"({pool_tokens} tokens in {num_blocks} blocks); serving {max_model_len} (raise the KV cache memory)")
    if device.type == "cuda" and config.cuda_graphs:
        say(f"capturing CUDA graphs for decode batches up to {config.cuda_graph_max_batch}")
        runner.capture_decode_graphs(config.cuda_graph_max_batch, max_model_len, config.num_speculative_tokens + 1)
    elif device.type == "cuda":
        runner.fix_decode_partition(config.cuda_graph_max_batch, max_model_len)
    limits = ModelLimits(
        max_model_len=max_model_len,
        vocab_size=arch.vocab_size,
        max_num_seqs=config.max_num_seqs,
        eos_token_ids=eos_token_ids(tokenizer, hf_config, generation_config),
        generation_defaults=generation_defaults(generation_config),
        chat_template=model_chat_template(config.chat_template, tokenizer, hf_config),
        repetition_detection=config.repetition_detection,
        thinking_tags=ThinkingTags(tuple(tokenizer.encode("<think>", add_special_tokens=False)),
                                   tuple(tokenizer.encode("</think>", add_special_tokens=False))),
    )
    if parallel is not None and head:
        runner.comm = CommStage(parallel.messages, None, len(shared_specs(runner, PagedKVSpec, parallel)),
                                len(shared_specs(runner, StateSlotSpec, parallel)))
    drafter = make_drafter(config, runner, draft_model) if head else None
    if device.type == "cuda" and config.cuda_graphs and hasattr(drafter, "capture_graphs"):
        say("capturing the drafter's CUDA graphs")
        drafter.capture_graphs(min(config.cuda_graph_max_batch, MAX_DRAFT_ROWS), max_model_len,
                               config.num_speculative_tokens + 1)
    if parallel is not None:
        parallel.set_timeout(parallel.step_timeout_s)  # every rank has loaded: serving
    say(f"ready: {num_blocks} KV blocks of {config.block_size} tokens, max model length {max_model_len}")
    return LoadedModel(path, arch, tokenizer, runner, limits, num_blocks, dtype, device, drafter, kv_dtype,
                       weight_format)


def check_max_model_len(requested: int | None, model_positions: int, path: object) -> None:
    """A context longer than the model was trained for is refused, not quietly cut to it: clients size their
    prompts from the length the server reports."""
    if requested and requested > model_positions:
        raise ValueError(f"--max-model-len {requested} is more than {path} supports ({model_positions} positions, "
                         f"max_position_embeddings); give at most {model_positions}")


def split_linear_attention(config: EngineConfig) -> bool:
    """Whether a hybrid model's ranks split the Gated DeltaNet heads: on by default (each rank reads half the
    recurrent states, which decode at large batches is bound by), off where a snapshot host tier is configured (the
    head's host copy of a snapshot would hold its own heads only); asking for it with such a tier is an error."""
    host_tier = snapshot_host_gib(config, True) > 0
    if config.ep_split_linear_attention is None:
        return not host_tier
    if config.ep_split_linear_attention and host_tier:
        raise ValueError("--ep-split-linear-attention keeps each rank's share of the recurrent states, which the "
                         "snapshots' host tier cannot hold: set --state-snapshot-host-gib 0 or leave the split off")
    return config.ep_split_linear_attention


def agree_on_caches(parallel: ParallelContext, runner: ModelRunner, num_blocks: int, snapshots: int) -> int:
    """The startup handshake of an expert-parallel split: every rank's caches must be the head's (a prefix of them:
    the head's drafter caches come after), with the same state slots and snapshots; all take the fewest blocks any
    rank has room for."""
    layouts = parallel.agree({"caches": [repr(spec) for spec in runner.cache_specs], "blocks": num_blocks,
                              "state_slots": runner.num_state_slots, "snapshots": snapshots})
    head = layouts[0]
    for rank, layout in enumerate(layouts):
        mine = layout["caches"]
        if head["caches"][:len(mine)] != mine or (layout["state_slots"], layout["snapshots"]) != (
                head["state_slots"], head["snapshots"]):
            raise ValueError(f"expert-parallel rank {rank} has caches {layout} unlike the head's {head}: the ranks "
                             "must run the same model and engine flags")
    parallel.shared_caches = min(len(layout["caches"]) for layout in layouts)
    return min(layout["blocks"] for layout in layouts)


def shared_specs(runner: ModelRunner, kind: type, parallel: ParallelContext) -> list:
    """The head's caches of ``kind`` that every rank holds (the first ``parallel.shared_caches`` caches)."""
    return [spec for spec in runner.cache_specs[:parallel.shared_caches] if isinstance(spec, kind)]


def load_draft_model(config: EngineConfig, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                     say: Callable[[str], None]) -> torch.nn.Module:
    """--speculative-model for --speculative-method draft: a smaller model over the target's vocabulary."""
    assert config.speculative_model is not None
    path = resolve_model_path(config.speculative_model)
    draft_arch = ModelArchConfig.from_hf(load_hf_config(path))
    if draft_arch.vocab_size != arch.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_arch.vocab_size}) is not the target's "
                         f"({arch.vocab_size}): a draft model needs the same tokenizer")
    if draft_arch.is_hybrid:
        raise ValueError(f"{draft_arch.model_type}: a hybrid draft model is not supported (use mtp, or a "
                         "transformer draft model)")
    dummy = config.load_format == "dummy"
    say(f"{'building random' if dummy else 'loading'} draft model {draft_arch.model_type} "
        f"({draft_arch.num_layers} layers)")
    weights, after_weights, _ = model_weights(config, path, load_hf_config(path), draft_arch, dtype, device)
    return build_model(draft_arch, weights, dtype, device, after_weights=after_weights)


def load_dflash_model(config: EngineConfig, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                      say: Callable[[str], None]) -> DFlashDraftModel:
    """--speculative-model for --speculative-method dflash: a DFlash block drafter trained on this target."""
    assert config.speculative_model is not None
    path = resolve_model_path(config.speculative_model)
    hf = load_hf_config(path)
    draft = DFlashDraftModel(dflash_arch(hf), dflash_config(hf, arch), dtype, device)
    dummy = config.load_format == "dummy"
    say(f"{'building random' if dummy else 'loading'} DFlash drafter ({draft.arch.num_layers} layers, "
        f"target layers {list(draft.config.target_layer_ids)})")
    weights = None if dummy else ((name.removeprefix("model."), tensor) for name, tensor in iter_weights(path))
    finish_model(draft, weights)
    return draft


def model_chat_template(override: str | None, tokenizer: Tokenizer, hf_config: dict) -> str | None:
    """--chat-template, else the tokenizer's own, else the model family's built-in one (Qwen3.5 checkpoints
    converted without a template still chat)."""
    return chat_template_override(override) or tokenizer.chat_template or family_chat_template(hf_config)


def chat_template_override(value: str | None) -> str | None:
    """--chat-template: a path to a template file, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            return handle.read()
    if "{" not in value:
        raise FileNotFoundError(f"chat template file not found: {value}")
    return value
