"""The model declares its caches (cache_specs) and layers read them through one ForwardContext: the
declared specs must match the arch and cost what the old per-layer K/V formula said, since the runner
sizes its block pool from them."""
import pytest
import torch

from pipeline.models.forward_context import ForwardContext, PagedKVSpec, allocate_caches, bytes_per_block
from tests.model_utils import arch_of, conveyor_from_hf, hf_greedy, make_tiny_hf_model, make_step_metadata


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_cache_specs_match_arch_and_old_block_cost(kv_dtype):
    hf = make_tiny_hf_model("qwen3", num_hidden_layers=3)
    arch = arch_of(hf)
    specs = conveyor_from_hf(hf).cache_specs(kv_dtype)
    assert specs == [PagedKVSpec(arch.num_kv_heads, arch.head_dim, kv_dtype)] * arch.num_layers
    block_size = 16
    element = torch.empty((), dtype=kv_dtype).element_size()
    old = 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element
    assert bytes_per_block(specs, block_size) == old
    caches = allocate_caches(specs, 5, block_size)
    assert len(caches) == arch.num_layers
    for cache in caches:
        assert cache.shape == (2, 5, block_size, arch.num_kv_heads, arch.head_dim) and cache.dtype == kv_dtype
        assert not cache.any()


def test_forward_through_context_matches_transformers():
    hf = make_tiny_hf_model("qwen2", seed=2)
    model = conveyor_from_hf(hf)
    ids = list(range(200, 211))
    block_size, table = 4, [2, 0, 1]
    caches = allocate_caches(model.cache_specs(torch.float32), 4, block_size)
    ctx = ForwardContext(make_step_metadata([len(ids)], [len(ids)], [table], block_size), caches)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), ctx)
    assert ctx.rope is not None and ctx.attention_plan is not None  # filled once by the model for every layer
    ref, _, _ = hf_greedy(hf, ids)
    torch.testing.assert_close(model.compute_logits(hidden), ref, atol=1e-4, rtol=1e-4)
    assert all(cache.abs().sum() > 0 for cache in caches)  # every layer wrote its own cache
