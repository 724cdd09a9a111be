"""Expert parallelism with an FP8 mixture-of-experts checkpoint (block FP8, experts one tensor each): each rank reads
only its own experts' weights and scales, and two ranks (gloo on the CPU) give one rank's tokens, which are those of
the plain checkpoint holding the dequantized weights, through batches, chunked prefill and a prefix-cache hit."""
from __future__ import annotations

import pytest
import torch

from pipeline.models.loader import load_hf_config
from pipeline.models.quantized_weights import checkpoint_weights
from tests.conftest import run_async
from tests.fp8_checkpoints import dequantized_checkpoint, to_block_fp8
from tests.pipeline.dist.test_engine_ep import run_engine, tiers_workload

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def fp8_moe(make_model_dir, tmp_path_factory):
    directory = make_model_dir("qwen3_moe", seed=13, num_experts=8, hidden_size=200)
    dequantized = to_block_fp8(directory)
    return directory, dequantized_checkpoint(directory, dequantized, tmp_path_factory.mktemp("dequantized"))


def test_a_rank_reads_its_own_experts(fp8_moe):
    directory = str(fp8_moe[0])
    weights = checkpoint_weights(directory, load_hf_config(directory), None, torch.float32, torch.device("cpu"),
                                 experts=(4, 8))
    experts = {int(name.split(".")[5]) for name, _ in weights if ".mlp.experts." in name}
    assert experts == {4, 5, 6, 7}


def test_two_ranks_give_one_ranks_tokens(fp8_moe):
    fp8_dir, plain_dir = fp8_moe
    one, _ = run_async(run_engine(fp8_dir))
    two, stats = run_async(run_engine(fp8_dir, ep_size=2))
    assert two == one
    assert stats["expert_parallel"]["size"] == 2 and stats["prefix_cache"]["hit_tokens"] > 0
    assert one == run_async(run_engine(plain_dir))[0]


def test_two_ranks_with_fp8_kv_and_tiers(fp8_moe, tmp_path):
    """fp8 KV blocks the head restores from its tiers reach the worker as bytes (gloo has no float8)."""
    fp8_dir, _ = fp8_moe
    off, _ = run_async(tiers_workload(fp8_dir, prefix_caching=False, kv_cache_dtype="fp8"))
    tiers = dict(kv_offload_host_gib=1 / 1024, kv_offload_dir=str(tmp_path), kv_offload_disk_gib=64 / 1024)
    two, stats = run_async(tiers_workload(fp8_dir, ep_size=2, kv_cache_dtype="fp8", **tiers))
    assert two == off
    assert stats["kv_offload"]["restored_blocks"] > 0
