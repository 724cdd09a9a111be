import math

import pytest
import torch

from kernels.paged_attention import (
    paged_attention_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    plan_paged_attention,
)
from pipeline.models.attention import build_attention_metadata


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def naive_attention(q, keys, values, seq_len, scale):
    """Dense reference for one sequence in float64: q [ql, H, D] at positions seq_len-ql..seq_len-1 over
    keys/values [seq_len, KVH, D]; query head h reads KV head h // group; causal."""
    ql, H, D = q.shape
    kvh = keys.shape[1]
    group = H // kvh
    out = torch.empty(ql, H, D, dtype=torch.float64)
    for t in range(ql):
        p = seq_len - ql + t
        for h in range(H):
            k = keys[: p + 1, h // group].double()
            v = values[: p + 1, h // group].double()
            w = torch.softmax((k @ q[t, h].double()) * scale, dim=0)
            out[t, h] = w @ v
    return out


def make_case(q_lens, seq_lens, *, kvh=2, group=2, d=8, block_size=4, dtype=torch.float32, seed=0, spare=3):
    """Random dense K/V per sequence stored in a paged cache through shuffled block tables.

    Block 0 is never assigned (it is where padded block-table entries point) and, like every unassigned
    block, holds large garbage that would show up if it were read unmasked."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    nb = 1 + sum(need) + spare
    ids = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(ids[i : i + n])
        i += n
    cache = (1e3 * torch.randn(2, nb, block_size, kvh, d, generator=gen)).to(dtype)
    dense_k, dense_v = [], []
    for s, table in zip(seq_lens, tables):
        k = torch.randn(s, kvh, d, generator=gen).to(dtype)
        v = torch.randn(s, kvh, d, generator=gen).to(dtype)
        for p in range(s):
            blk, off = table[p // block_size], p % block_size
            cache[0, blk, off] = k[p]
            cache[1, blk, off] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    meta = build_attention_metadata(q_lens, seq_lens, tables, block_size)
    query = torch.randn(sum(q_lens), kvh * group, d, generator=gen).to(dtype)
    return query, cache, meta, dense_k, dense_v


def expected(query, meta, dense_k, dense_v, scale):
    qsl = meta.query_start_loc_host
    return torch.cat(
        [
            naive_attention(query[qsl[b] : qsl[b + 1]], dense_k[b], dense_v[b], s, scale)
            for b, s in enumerate(meta.seq_lens_host)
        ]
    )


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_fast_path_matches_dense(group, block_size):
    seq_lens = [1, 7, 16, 33, 5]
    query, cache, meta, dk, dv = make_case([1] * 5, seq_lens, group=group, block_size=block_size)
    assert meta.is_decode_only
    scale = 0.3
    plan = plan_paged_attention(meta, block_size)
    assert plan.is_decode_only and plan.decode.attend_mask is not None
    out = paged_decode_attention_ref(query, cache, meta, scale, plan)
    ref = expected(query, meta, dk, dv, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # dispatch, no plan, and the per-sequence path all agree
    torch.testing.assert_close(paged_attention_ref(query, cache, meta, scale), out, atol=0, rtol=0)
    torch.testing.assert_close(paged_prefill_attention_ref(query, cache, meta, scale), out, atol=1e-6, rtol=1e-6)


def test_decode_single_sequence_needs_no_mask():
    query, cache, meta, dk, dv = make_case([1], [23], block_size=4)
    plan = plan_paged_attention(meta, 4)
    assert plan.decode.attend_mask is None
    out = paged_attention_ref(query, cache, meta, 0.25, plan)
    torch.testing.assert_close(out.double(), expected(query, meta, dk, dv, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([9], [9]),  # plain prefill
        ([5], [14]),  # chunk after a cached prefix
        ([3, 1, 8, 1], [3, 20, 12, 2]),  # mixed prefill + decode
        ([4, 6], [11, 6]),
        ([1, 5, 1, 1, 7], [9, 5, 30, 2, 12]),  # decode tokens of different lengths around prefill chunks
    ],
)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_varlen_path_matches_dense(q_lens, seq_lens, group):
    query, cache, meta, dk, dv = make_case(q_lens, seq_lens, group=group, block_size=4, seed=len(q_lens) + group)
    assert not meta.is_decode_only
    out = paged_attention_ref(query, cache, meta, 0.35)
    torch.testing.assert_close(out.double(), expected(query, meta, dk, dv, 0.35), atol=1e-5, rtol=1e-5)


def test_mixed_plan_groups_single_token_sequences():
    query, cache, meta, dk, dv = make_case([1, 5, 1, 1, 7], [9, 5, 30, 2, 12], block_size=4)
    plan = plan_paged_attention(meta, 4)
    assert not plan.is_decode_only
    assert plan.decode.rows.tolist() == [0, 6, 7] and plan.decode.max_len == 30
    assert plan.decode.attend_mask.shape == (3, 1, 1, 30)
    assert plan.seq_index == [1, 4]
    assert plan.attend_masks[0] is None  # whole context new: plain causal
    assert plan.attend_masks[1].shape == (7, 12) and plan.attend_masks[1][0].sum() == 6


@pytest.mark.parametrize("decode", [True, False])
def test_bf16_accumulates_in_fp32(decode):
    q_lens = [1, 1, 1] if decode else [4, 1, 6]
    query, cache, meta, dk, dv = make_case(q_lens, [9, 30, 17], group=2, d=16, dtype=torch.bfloat16)
    out = paged_attention_ref(query, cache, meta, 0.25)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    torch.testing.assert_close(out.double(), expected(query, meta, dk, dv, 0.25), atol=2e-2, rtol=2e-2)


def test_plan_is_reusable_across_layers():
    query, cache, meta, dk, dv = make_case([3, 1], [10, 6], block_size=4)
    plan = plan_paged_attention(meta, 4)
    cache2 = cache.flip(-1).contiguous()  # a second "layer": same layout, other contents
    for c in (cache, cache2):
        torch.testing.assert_close(
            paged_attention_ref(query, c, meta, 0.3, plan), paged_attention_ref(query, c, meta, 0.3), atol=0, rtol=0
        )
