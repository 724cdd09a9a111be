import pytest
import torch

from kernels.kv_cache import allocate_kv_cache, write_kv_ref
from pipeline.models.attention import build_attention_metadata


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_at_arbitrary_slots(dtype, block_size):
    gen = torch.Generator().manual_seed(0)
    nb, kvh, d, T = 17, 2, 8, 13
    cache = allocate_kv_cache(1, nb, block_size, kvh, d, dtype)[0]
    assert cache.shape == (2, nb, block_size, kvh, d) and cache.dtype == dtype
    slots = torch.randperm(nb * block_size, generator=gen)[:T]
    # key/value as strided views of a wider projection output, as the attention layer passes them
    packed = torch.randn(T, 3 * kvh * d, generator=gen).to(dtype)
    key = packed[:, : kvh * d].view(T, kvh, d)
    value = packed[:, 2 * kvh * d :].view(T, kvh, d)
    write_kv_ref(key, value, cache, slots)

    written = torch.zeros(nb * block_size, dtype=torch.bool)
    written[slots] = True
    for t in range(T):
        s = int(slots[t])
        blk, off = divmod(s, block_size)
        assert torch.equal(cache[0, blk, off], key[t])
        assert torch.equal(cache[1, blk, off], value[t])
    flat = cache.view(2, nb * block_size, kvh, d)
    assert not flat[:, ~written].any(), "slots not in slot_mapping must stay untouched"


def test_write_kv_overwrites_partially_filled_block():
    cache = allocate_kv_cache(1, 4, 4, 1, 2)[0]
    k1 = torch.ones(2, 1, 2)
    write_kv_ref(k1, -k1, cache, torch.tensor([8, 9]))  # block 2, offsets 0-1
    k2 = torch.full((2, 1, 2), 2.0)
    write_kv_ref(k2, -k2, cache, torch.tensor([10, 11]))  # the next chunk fills the rest of block 2
    assert torch.equal(cache[0, 2, :, 0, 0], torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert torch.equal(cache[1, 2, :, 0, 0], torch.tensor([-1.0, -1.0, -2.0, -2.0]))
    assert not cache[:, [0, 1, 3]].any()


def test_metadata_slot_mapping_follows_block_tables():
    # seq 0: 3 cached + 2 new with blocks [5, 2]; seq 1: decode at position 6 with blocks [7, 1]
    meta = build_attention_metadata([2, 1], [5, 7], [[5, 2], [7, 1]], block_size=4)
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 1 * 4 + 2]
    assert meta.query_start_loc.tolist() == [0, 2, 3] and meta.query_start_loc_host == [0, 2, 3]
    assert meta.seq_lens.tolist() == [5, 7] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[5, 2], [7, 1]] and meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64 and meta.query_start_loc.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len, meta.is_decode_only) == (2, 7, False)
    assert build_attention_metadata([1, 1], [3, 9], [[0], [4, 3, 6]], 4).is_decode_only
    with pytest.raises(ValueError):
        build_attention_metadata([1], [9], [[0, 1]], 4)  # table too short
