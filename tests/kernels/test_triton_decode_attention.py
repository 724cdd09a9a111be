"""The decode attention kernels (``kernels/triton_decode_attention.py``) against the torch reference (CPU: Triton
interpreter, tiny shapes; CUDA: @gpu), and speculative verify rows against plain decoding, bit for bit."""

import sys

import numpy as np
import pytest
import torch

from kernels.paged_attention import plan_paged_attention
from kernels.triton_decode_attention import (REDUCE_SHORT_SPLITS, decode_num_splits, decode_rows,
                                             paged_decode_attention_triton, paged_rows_attention_triton)
from kernels.triton_paged_attention import TritonAttentionPlan, paged_attention_triton
from pipeline.models.attention import AttentionMetadata, build_attention_metadata
from tests.kernels.test_triton_attention import DECODE_LENS, DEVICE, make_step, reference

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_ref(num_splits, group, block_size):
    query, cache, meta = make_step([1] * 5, DECODE_LENS, group=group, block_size=block_size, seed=group)
    assert meta.is_decode_only
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16)
    out = paged_decode_attention_triton(query, cache, meta, 0.3, plan)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, reference(query, cache, meta, 0.3), atol=1e-5, rtol=1e-5)


def test_decode_many_splits_and_default_plan():
    query, cache, meta = make_step([1, 1], [70, 5], group=2, block_size=16, seed=5)
    ref = reference(query, cache, meta, 0.25)
    for plan in (TritonAttentionPlan(num_splits=9, decode_block_n=16), None, plan_paged_attention(meta, 16)):
        torch.testing.assert_close(paged_attention_triton(query, cache, meta, 0.25, plan), ref, atol=1e-5, rtol=1e-5)


def test_decode_split_heuristic():
    assert decode_num_splits(256, 8, 8192) == 1  # B * KVH fills the GPU already
    assert decode_num_splits(4, 8, 100) == 1  # short contexts: one split, no reduce
    assert decode_num_splits(1, 8, 32768) == 33  # ~2 waves over 132 SMs
    assert decode_num_splits(1, 1, 1 << 20) == 128  # capped
    assert decode_num_splits(2, 4, 1024) == 4  # >= 256 keys per split

@pytest.mark.parametrize("short", [4, REDUCE_SHORT_SPLITS])
def test_reduce_of_the_used_splits(monkeypatch, short):
    """The reduce loads only the splits a row's length says hold keys, from the short tile when there are at most
    ``short`` of them (the 17-key rows: 2 splits of 16; the 70-key row: 5; the 300-key row: 19), else from the tile
    of every split: verify rows equal their decode rows and the reference; rows cut into one-tile splits by 19 and
    by 24 splits (both 32-split tiles) get the same bits."""
    import kernels.triton_decode_attention as module

    monkeypatch.setattr(module, "REDUCE_SHORT_SPLITS", short)
    q_lens, seq_lens = [1, 3, 1, 2, 1], [1, 17, 70, 300, 33]
    query, cache, meta = make_step(q_lens, seq_lens, group=2, block_size=16, seed=48)
    gate = gate_like(query, 49)
    rows = decode_rows(meta, query.shape[0])
    outs = [paged_rows_attention_triton(query, cache, meta, 0.3, TritonAttentionPlan(num_splits=n, decode_block_n=16),
                                        gate, rows) for n in (19, 24)]
    assert torch.equal(outs[0], outs[1])
    plan = TritonAttentionPlan(num_splits=19, decode_block_n=16)
    decode_meta = plain_decode_meta(meta, rows_of(q_lens, seq_lens), 16)
    assert torch.equal(outs[0], paged_decode_attention_triton(query, cache, decode_meta, 0.3, plan, gate))
    ref = reference(query, cache, meta, 0.3) * torch.sigmoid(gate.float())
    torch.testing.assert_close(outs[0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 8), (256, 8)])
def test_gpu_reduce_of_the_used_splits(d, group):
    """bf16 on CUDA, gated, 40 and 128 splits: rows using at most ``REDUCE_SHORT_SPLITS`` splits take the short tile
    (the same bits under both counts), longer rows the tile of every split; all close to the reference."""
    tile = 64 if d <= 128 else 32
    seq_lens = [1, tile - 1, tile + 1, REDUCE_SHORT_SPLITS * tile, REDUCE_SHORT_SPLITS * tile + 1, 40 * tile]
    query, cache, meta = make_step([1] * len(seq_lens), seq_lens, kvh=4, group=group, d=d, block_size=16,
                                   dtype=torch.bfloat16, device="cuda", seed=d)
    gate = gate_like(query, d)
    outs = [paged_decode_attention_triton(query, cache, meta, d**-0.5, TritonAttentionPlan(num_splits=n), gate)
            for n in (40, 128)]
    assert torch.equal(outs[0][:4], outs[1][:4])
    ref = reference(query, cache, meta, d**-0.5) * torch.sigmoid(gate.float())
    for out in outs:
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 4), (64, 1), (96, 8), (256, 2)])
def test_gpu_decode_bf16(d, group):
    seq_lens = [1, 15, 16, 17, 300, 1000, 4097, 2222]
    query, cache, meta = make_step([1] * 8, seq_lens, kvh=4, group=group, d=d, block_size=16,
                                   dtype=torch.bfloat16, device="cuda")
    ref = reference(query, cache, meta, d**-0.5)
    for plan in (None, TritonAttentionPlan(num_splits=1), TritonAttentionPlan(num_splits=7),
                 TritonAttentionPlan(num_splits=128)):  # the cap: the reduce runs 8 warps at head_dim 256
        out = paged_decode_attention_triton(query, cache, meta, d**-0.5, plan)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# ---- verify rows (speculative decoding): every token one decode row, bitwise the plain decode result ----

ROWS_CASES = [  # (new tokens per sequence, seq_lens): q = 1..5, the new tokens crossing blocks and splits
    # a whole 3-token prompt (its first token a 1-key row); positions 11..15 across a 4-block; 31, 32 across a
    # 16-key tile and block; 66..69 in the last of 3 splits
    ([3, 1, 5, 2, 4], [3, 7, 16, 33, 70]),
    # positions 12..16 across a 16-block and 3 splits' first cut; 47, 48: 3 splits of 16 keys, then of 32
    ([5, 4, 1, 2], [17, 20, 1, 49]),
]


def rows_of(q_lens: list[int], seq_lens: list[int]) -> list[tuple[int, int, int]]:
    """(sequence, seq_len = position + 1, new_from) of every token, in order: the pure-Python DecodeRows."""
    return [(b, s - q + i + 1, s - q) for b, (q, s) in enumerate(zip(q_lens, seq_lens)) for i in range(q)]


def plain_decode_meta(meta: AttentionMetadata, rows: list[tuple[int, int, int]], block_size: int
                      ) -> AttentionMetadata:
    """A decode-only step with one one-token row per entry of ``rows``: seq_len p + 1, the block-table row of the
    token's sequence (its whole padded row: entries past the context are never read)."""
    table = meta.block_tables.tolist()
    return build_attention_metadata([1] * len(rows), [n for _, n, _ in rows], [table[b] for b, _, _ in rows],
                                    block_size, meta.block_tables.device)


def gate_like(query: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(query.shape, generator=gen).to(device=query.device, dtype=query.dtype)


@pytest.mark.parametrize("case,block_size,gated", [(0, 4, False), (0, 16, True), (1, 16, True)])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_equal_decode(num_splits, group, case, block_size, gated):
    """Each token's output is bitwise what ``paged_decode_attention_triton`` gives it as a decode row (seq_len =
    its position + 1, its sequence's block table, the same plan; all tokens in one decode step here, alone in
    ``test_rows_equal_one_token_decode``, which also runs case 1 in blocks of 4), and close to the causal
    reference. The interpreter runs a program in ~10 ms: the grid is a sample, not the whole product."""
    q_lens, seq_lens = ROWS_CASES[case]
    query, cache, meta = make_step(q_lens, seq_lens, group=group, block_size=block_size, seed=40 + group + case)
    gate = gate_like(query, 41 + case) if gated else None
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16)
    out = paged_rows_attention_triton(query, cache, meta, 0.3, plan, gate)
    assert out.shape == query.shape and out.dtype == query.dtype
    decode_meta = plain_decode_meta(meta, rows_of(q_lens, seq_lens), block_size)
    assert torch.equal(out, paged_decode_attention_triton(query, cache, decode_meta, 0.3, plan, gate))
    ref = reference(query, cache, meta, 0.3)
    if gated:
        ref = ref * torch.sigmoid(gate.float())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", range(len(ROWS_CASES)))
def test_rows_equal_one_token_decode(case):
    """Token by token, each alone in a one-token decode step; the rows built once and passed in."""
    q_lens, seq_lens = ROWS_CASES[case]
    query, cache, meta = make_step(q_lens, seq_lens, group=2, block_size=4, seed=43 + case)
    gate = gate_like(query, 44 + case)
    plan = TritonAttentionPlan(num_splits=3, decode_block_n=16)
    out = paged_rows_attention_triton(query, cache, meta, 0.3, plan, gate, decode_rows(meta, query.shape[0]))
    for t, row in enumerate(rows_of(q_lens, seq_lens)):
        one = plain_decode_meta(meta, [row], 4)
        expected = paged_decode_attention_triton(query[t : t + 1], cache, one, 0.3, plan, gate[t : t + 1])
        assert torch.equal(out[t : t + 1], expected), f"token {t} (sequence {row[0]}, position {row[1] - 1})"


def test_rows_many_splits_and_default_plan():
    """More splits than a short row has keys (empty splits in the reduce); no plan: the decode heuristic over the
    step's sequences (interpreter: its cap of 1 split for contexts under 256 keys)."""
    q_lens, seq_lens = [4, 1, 3], [70, 5, 20]
    query, cache, meta = make_step(q_lens, seq_lens, group=2, block_size=16, seed=45)
    ref = reference(query, cache, meta, 0.25)
    plan = TritonAttentionPlan(num_splits=9, decode_block_n=16)
    out = paged_rows_attention_triton(query, cache, meta, 0.25, plan)
    assert torch.equal(out, paged_decode_attention_triton(query, cache, plain_decode_meta(
        meta, rows_of(q_lens, seq_lens), 16), 0.25, plan))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_rows_attention_triton(query, cache, meta, 0.25, None), ref, atol=1e-5, rtol=1e-5)


def test_decode_rows_values():
    q_lens, seq_lens = [1, 16, 3, 1, 5, 2], [1, 40, 3, 9, 1000, 17]
    _, _, meta = make_step(q_lens, seq_lens, block_size=16)
    rows = decode_rows(meta, sum(q_lens))
    for got in (rows.seq, rows.seq_len, rows.new_from):
        assert got.dtype == torch.int32 and got.device == meta.seq_lens.device and got.shape == (sum(q_lens),)
    assert list(zip(rows.seq.tolist(), rows.seq_len.tolist(), rows.new_from.tolist())) == rows_of(q_lens, seq_lens)


def test_rows_shape_checks():
    query, cache, meta = make_step([2, 3], [5, 9], seed=46)
    plan = TritonAttentionPlan(num_splits=2, decode_block_n=16)
    with pytest.raises(ValueError, match="rows"):
        paged_rows_attention_triton(query, cache, meta, 0.3, plan, rows=decode_rows(meta, 4))
    with pytest.raises(ValueError, match="gate"):
        paged_rows_attention_triton(query, cache, meta, 0.3, plan, gate_like(query, 1)[:, :1])


def _early_reads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Under the interpreter, replace the split kernel's ``pdl_wait`` by a probe that looks at the kernel's frame at
    the wait: one entry a program, True when a value it holds already is NaN (a key this step writes, read early).
    (The reduce kernel's wait, in the same module, is let through.)"""
    import kernels.triton_decode_attention as module

    found: list[bool] = []

    def probe(*_args, **_kwargs) -> None:
        frame = sys._getframe(1)
        if frame.f_code.co_name != "_decode_split_kernel":
            return
        held = [v.handle.data for v in frame.f_locals.values() if hasattr(v, "handle")
                and isinstance(getattr(v.handle, "data", None), np.ndarray)]
        assert any(np.issubdtype(a.dtype, np.floating) for a in held), "no loaded tile in the kernel's frame"
        found.append(any(np.isnan(a).any() for a in held if np.issubdtype(a.dtype, np.floating)))

    monkeypatch.setattr(module, "pdl_wait", probe)
    return found


@pytest.mark.skipif(DEVICE != "cpu", reason="probes the interpreter")
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("rows", [True, False])
def test_step_keys_read_after_the_wait(monkeypatch, rows, num_splits):
    """Under dependent launch the kernel reads its first key tile before ``pdl_wait``, while the kernel before it
    may still be writing this step's keys: none of them (a row's own and the earlier tokens' of its sequence, all
    at positions >= new_from) may be among the early reads. The step's keys are NaN here, so an early read shows
    in the tile the kernel holds at the wait (the results, merged after the wait, would not show it)."""
    q_lens, seq_lens = ([3, 5, 1, 4], [3, 18, 7, 33]) if rows else ([1] * 4, [1, 18, 7, 33])
    query, cache, meta = make_step(q_lens, seq_lens, group=2, block_size=4, seed=47)
    kvh, d = cache.shape[-2:]
    for half in cache:  # K, then V: NaN at every slot this step writes
        half.view(-1, kvh, d)[meta.slot_mapping] = float("nan")
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16)
    found = _early_reads(monkeypatch)
    with np.errstate(invalid="ignore"):  # NaN keys: the outputs are not looked at
        if rows:
            paged_rows_attention_triton(query, cache, meta, 0.3, plan)
        else:
            paged_decode_attention_triton(query, cache, meta, 0.3, plan)
    assert len(found) == query.shape[0] * kvh * num_splits and not any(found)


@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 4), (256, 2)])
def test_gpu_rows_equal_decode_bf16(d, group):
    """bf16 on CUDA: up to 16 tokens a sequence over 8 sequences, each token bitwise the one-token decode row,
    gated, through the direct store and reduces of 3, 7 and 128 splits."""
    q_lens = [16, 1, 7, 16, 2, 16, 5, 11]
    seq_lens = [16, 15, 40, 300, 1000, 4097, 2222, 129]
    query, cache, meta = make_step(q_lens, seq_lens, kvh=4, group=group, d=d, block_size=16,
                                   dtype=torch.bfloat16, device="cuda", seed=d)
    gate = gate_like(query, d + 1)
    rows = decode_rows(meta, query.shape[0])
    expected_rows = rows_of(q_lens, seq_lens)
    assert list(zip(rows.seq.tolist(), rows.seq_len.tolist(), rows.new_from.tolist())) == expected_rows
    decode_meta = plain_decode_meta(meta, expected_rows, 16)
    qsl = meta.query_start_loc_host
    some = sorted({t for b in range(len(q_lens)) for t in (qsl[b], qsl[b + 1] - 1)})  # alone in a decode step
    ref = reference(query, cache, meta, d**-0.5) * torch.sigmoid(gate.float())
    for num_splits in (1, 3, 7, 128):
        plan = TritonAttentionPlan(num_splits=num_splits)
        out = paged_rows_attention_triton(query, cache, meta, d**-0.5, plan, gate, rows)
        plain = paged_decode_attention_triton(query, cache, decode_meta, d**-0.5, plan, gate)
        differ = (out != plain).flatten(1).any(1).nonzero().flatten().tolist()
        assert not differ, f"{num_splits} splits: tokens {differ} differ from their decode rows"
        for t in some:
            one = plain_decode_meta(meta, [expected_rows[t]], 16)
            assert torch.equal(out[t : t + 1], paged_decode_attention_triton(
                query[t : t + 1], cache, one, d**-0.5, plan, gate[t : t + 1]))
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
