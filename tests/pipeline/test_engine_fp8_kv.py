"""--kv-cache-dtype fp8 through the engine (e4m3 K/V with per-layer scales): the pool holds twice the bf16 blocks in the
same memory; every attention path reads the same fp8 blocks, so chunked prefill equals whole prompts and speculation
(verify rows) equals plain decoding, on a dense and a hybrid model; the host and disk tiers move fp8 blocks bit for
bit, so resuming from them equals recomputing; the MTP head's caches and the recurrent states keep the model dtype."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pipeline.engine import Engine
from pipeline.loading import load_model
from pipeline.memory.block_transfers import block_bytes, run_block_transfers
from pipeline.memory.kv_offload import KVOffload
from pipeline.memory.kv_tiers import DiskKVTier, HostKVTier
from pipeline.models.forward_context import PagedKVSpec, StateSlotSpec
from pipeline.request import SamplingParams
from pipeline.spec.replay import ReplayDrafter
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

pytestmark = pytest.mark.usefixtures("single_torch_thread")

FP8 = dict(kv_cache_dtype="fp8")
SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
PROMPTS = [[random.Random(30 + i).randrange(100, 49000) for _ in range(23 + 9 * i)] for i in range(3)]


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3_5_moe_text"])
def model_dir(request, make_model_dir):
    return make_model_dir(request.param, seed=21)


async def run(model_dir, drafter=None, **overrides) -> tuple[list[list[int]], dict]:
    engine = await Engine.create(config_for(model_dir, state_snapshot_interval=8, **overrides))
    if drafter is not None:
        engine.decode.drafter = drafter
    try:
        results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=greedy()) for p in PROMPTS])
        await settle(engine)
        assert_no_leaks(engine)
        return [r[0].token_ids for r in results], engine.stats()
    finally:
        await engine.shutdown()


def test_pool_holds_twice_the_blocks(tiny_model_dir):
    memory = dict(num_kv_blocks=None, kv_cache_memory_gib=1 / 64)
    bf16 = load_model(config_for(tiny_model_dir, dtype="bfloat16", **memory))
    fp8 = load_model(config_for(tiny_model_dir, dtype="bfloat16", **memory, **FP8))
    fp32 = load_model(config_for(tiny_model_dir, **memory))
    assert fp8.runner.bytes_per_block * 2 == bf16.runner.bytes_per_block
    assert fp8.num_blocks == 2 * bf16.num_blocks and fp8.num_blocks == 4 * fp32.num_blocks
    assert all(c.dtype == torch.float8_e4m3fn for c in fp8.runner.caches)
    assert fp8.kv_dtype == torch.float8_e4m3fn and bf16.kv_dtype == torch.bfloat16


def test_hybrid_and_mtp_caches_keep_the_model_dtype(make_model_dir):
    from tests.model_utils import add_mtp_weights

    directory = make_model_dir("qwen3_5_moe_text", seed=22)
    add_mtp_weights(directory, "qwen3_5_moe_text", seed=22)
    loaded = load_model(config_for(directory, speculative_method="mtp", num_speculative_tokens=2, **FP8))
    specs = loaded.runner.cache_specs
    attention = [s for s in specs if isinstance(s, PagedKVSpec)]
    assert [s.dtype for s in attention] == [torch.float8_e4m3fn, torch.float32, torch.float32]  # model, MTP K/V, hidden
    assert all(s.dtype == torch.float32 for s in specs if isinstance(s, StateSlotSpec))


def test_chunked_prefill_equals_whole_prompts(model_dir):
    whole, _ = run_async(run(model_dir, max_num_batched_tokens=256, prefix_caching=False, **FP8))
    chunked, _ = run_async(run(model_dir, max_num_batched_tokens=8, prefix_caching=False, **FP8))
    assert chunked == whole


def test_speculation_equals_plain_decoding(model_dir):
    plain, _ = run_async(run(model_dir, **FP8))
    expected = {tuple(p): out for p, out in zip(PROMPTS, plain)}
    spec, stats = run_async(run(model_dir, ReplayDrafter(expected, 0.3), **SPEC, **FP8))
    assert spec == plain and stats["speculation"]["accepted_tokens"] > 0


def fp8_caches(num_blocks: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(2, num_blocks, 4, 2, 8, generator=gen) * 100).to(torch.float8_e4m3fn),
            torch.randn(2, num_blocks, 4, 1, 16, generator=gen)]  # an fp8 attention cache beside an fp32 one


def test_tiers_round_trip_fp8_blocks_bitwise(tmp_path):
    kv = fp8_caches()
    before = [c.clone() for c in kv]
    size = block_bytes(kv)
    assert size == 2 * 4 * 2 * 8 * 1 + 2 * 4 * 16 * 4
    disk = DiskKVTier(tmp_path, 1 << 20, (size,), torch.uint8)
    tiers = KVOffload(HostKVTier(2 * size, (size,), torch.uint8, spill=disk), disk)
    for block in (1, 2, 3):  # the host holds two blocks: block 1 goes on to disk
        tiers.save(block, block.to_bytes(8, "little"))
        run_block_transfers(tiers.take_transfers(), kv)
    for c in kv:
        c.view(torch.uint8)[:, 1:4] = 0
    for block, target in ((1, 6), (3, 7)):
        assert tiers.restore(block.to_bytes(8, "little"), target)
        run_block_transfers(tiers.take_transfers(), kv)
    assert tiers.stats.disk_restored_blocks == 1 and tiers.stats.restored_blocks == 2
    for c, b in zip(kv, before):
        assert torch.equal(c[:, 6].view(torch.uint8), b[:, 1].view(torch.uint8))
        assert torch.equal(c[:, 7].view(torch.uint8), b[:, 3].view(torch.uint8))
    tiers.close()


def test_device_block_copies_move_fp8_bytes():
    """A full prefix hit copies its last block on the device (``BlockTransfers.copies``)."""
    from pipeline.memory.block_transfers import BlockTransfers

    kv = fp8_caches()
    before = [c.clone() for c in kv]
    transfers = BlockTransfers(host=None)
    transfers.copies.append((3, 5))
    run_block_transfers(transfers, kv)
    assert all(torch.equal(c[:, 5].view(torch.uint8), b[:, 3].view(torch.uint8)) for c, b in zip(kv, before))


def test_resuming_from_host_and_disk_equals_recomputing(tiny_model_dir, tmp_path):
    from tests.pipeline.test_engine_kv_tiers import scenario

    per_block = block_bytes(load_model(config_for(tiny_model_dir, num_kv_blocks=4, **FP8)).runner.caches)
    tiers = dict(kv_offload_host_gib=16 * per_block / (1 << 30), kv_offload_dir=str(tmp_path),
                 kv_offload_disk_gib=1000 * (per_block + 256) / (1 << 30))
    off, _ = run_async(scenario(config_for(tiny_model_dir, num_kv_blocks=30, max_num_seqs=2, prefix_caching=False,
                                           **FP8)))
    on, stats = run_async(scenario(config_for(tiny_model_dir, num_kv_blocks=30, max_num_seqs=2, **tiers, **FP8)))
    assert on == off
    offload = stats["kv_offload"]
    assert offload["restored_blocks"] > 0 and offload["disk_restored_blocks"] > 0
    assert offload["bytes_to_device"] == offload["restored_blocks"] * per_block


def test_fp8_kv_is_refused_only_where_the_cuda_kernels_cannot_compile(monkeypatch):
    """The Triton kernels read and write e4m3 from compute capability 8.9 on: an older GPU is refused in one line
    (unless the torch path runs there), a newer one and the CPU get the fp8 cache."""
    from kernels import dispatch
    from pipeline.loading import resolve_kv_dtype

    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later") as err:
        resolve_kv_dtype("fp8", torch.bfloat16, torch.device("cuda"))
    assert "sm_80" in str(err.value) and "\n" not in str(err.value)
    assert resolve_kv_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_dtype("fp8", torch.bfloat16, torch.device("cuda")) == torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e4m3", torch.float32, torch.device("cpu")) == torch.float8_e4m3fn
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setenv("CONVEYOR_DISABLE_TRITON", "1")  # the torch path reads fp8 on any GPU
    assert resolve_kv_dtype("fp8", torch.bfloat16, torch.device("cuda")) == torch.float8_e4m3fn


def with_kv_scales(monkeypatch, k_scale: float, v_scale: float) -> None:
    """Every attention layer gets these scales at load, as from a checkpoint's ``k_scale`` / ``v_scale``."""
    import pipeline.loading as loading
    from pipeline.models.self_attention import PagedAttention

    def apply(model, _checkpoint_scales) -> None:
        for module in model.modules():
            if isinstance(module, PagedAttention):
                module.k_scale, module.v_scale = k_scale, v_scale

    monkeypatch.setattr(loading, "apply_kv_scales", apply)


@pytest.mark.gpu
def test_gpu_fp8_kv_graphs_eager_speculation_and_the_torch_path(model_dir, monkeypatch):
    """On CUDA the Triton kernels write and read the fp8 cache (layer scales 0.03 / 0.01): in bf16, greedy tokens
    with CUDA graphs equal eager; in fp32, the kernels' tokens through the graphs equal the torch path's on the same
    device (CONVEYOR_DISABLE_TRITON, eager: its padded KV write syncs), and speculation (verify rows through the
    graphs) equals plain decoding."""
    with_kv_scales(monkeypatch, 0.03, 0.01)
    cuda = dict(device="cuda", num_kv_blocks=256, **FP8)
    graphs, _ = run_async(run(model_dir, dtype="bfloat16", cuda_graphs=True, **cuda))
    eager, _ = run_async(run(model_dir, dtype="bfloat16", cuda_graphs=False, **cuda))
    assert graphs == eager
    kernels, _ = run_async(run(model_dir, cuda_graphs=True, **cuda))
    expected = {tuple(p): out for p, out in zip(PROMPTS, kernels)}
    spec, stats = run_async(run(model_dir, ReplayDrafter(expected, 0.3), cuda_graphs=True, **SPEC, **cuda))
    assert spec == kernels and stats["speculation"]["accepted_tokens"] > 0
    monkeypatch.setenv("CONVEYOR_DISABLE_TRITON", "1")
    torch_path, _ = run_async(run(model_dir, cuda_graphs=False, **cuda))
    assert kernels == torch_path
