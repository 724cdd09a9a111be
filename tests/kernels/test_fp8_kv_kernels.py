"""The Triton KV kernels with an fp8 (e4m3) cache against the torch references on the same cache: the writes (KV
write, fused qkv prologue) store exactly ``quantize_kv_ref``'s bytes, padding slots skipped; every attention kernel
(varlen prefill, chunked after a cached prefix, KV splits, split-KV decode, verify rows) equals the reference over
``dequantize_kv_ref`` of the cache, with scales != 1, GQA and partial blocks, and verify rows keep plain decoding's
bits. CPU: the Triton interpreter on tiny shapes; CUDA (@gpu): model shapes, 32k-token decode."""
import math

import pytest
import torch

from kernels import dispatch
from kernels.fp8 import FP8_E4M3_MAX, dequantize_kv_ref, quantize_kv_ref
from kernels.kv_cache import write_kv_ref
from kernels.paged_attention import paged_attention_ref
from kernels.triton_decode_attention import (decode_rows, paged_decode_attention_triton,
                                             paged_rows_attention_triton)
from kernels.triton_kv_cache import write_kv_padded_ref, write_kv_triton
from kernels.triton_paged_attention import TritonAttentionPlan, paged_attention_triton, paged_prefill_attention_triton
from kernels.triton_qkv_prologue import qkv_prologue_ref, qkv_prologue_triton
from pipeline.models.attention import build_attention_metadata
from tests.kernels.test_triton_attention import DEVICE, SMALL
from tests.kernels.test_triton_decode_attention import gate_like, plain_decode_meta, rows_of
from tests.kernels.test_triton_qkv_prologue import case as prologue_case

pytestmark = pytest.mark.usefixtures("single_torch_thread")

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.03, 0.4  # K / 0.03 reaches past 448 at 13.4: the clamp is exercised too


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def garbage_fp8_cache(nb: int, bs: int, kvh: int, d: int, gen: torch.Generator, device=DEVICE) -> torch.Tensor:
    """An e4m3 cache whose every slot holds large finite values (+-448 mostly) that would show if read unmasked."""
    return quantize_kv_ref(1e3 * torch.randn(2, nb, bs, kvh, d, generator=gen), 1.0).to(device)


def dequantized(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    return torch.stack([dequantize_kv_ref(cache[0], k_scale, torch.float32),
                        dequantize_kv_ref(cache[1], v_scale, torch.float32)])


def make_fp8_step(q_lens, seq_lens, *, kvh=2, group=2, d=16, block_size=4, dtype=torch.float32, seed=0,
                  device=DEVICE, k_scale=K_SCALE, v_scale=V_SCALE, spare=3):
    """``test_triton_attention.make_step`` with an e4m3 cache written by ``write_kv_ref`` with the layer's scales."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    nb = 1 + sum(need) + spare
    ids = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    tables = [ids[sum(need[:i]): sum(need[: i + 1])] for i in range(len(need))]
    cache = garbage_fp8_cache(nb, block_size, kvh, d, gen, device)
    whole = build_attention_metadata(seq_lens, seq_lens, tables, block_size, device)
    T = sum(seq_lens)
    keys = torch.randn(T, kvh, d, generator=gen).to(device)
    values = torch.randn(T, kvh, d, generator=gen).to(device)
    write_kv_ref(keys, values, cache, whole.slot_mapping, k_scale, v_scale)
    meta = build_attention_metadata(q_lens, seq_lens, tables, block_size, device)
    query = torch.randn(sum(q_lens), kvh * group, d, generator=gen).to(device=device, dtype=dtype)
    return query, cache, meta


def reference(query, cache, meta, scale, k_scale=K_SCALE, v_scale=V_SCALE):
    """The torch reference in float32 over the dequantized cache."""
    return paged_attention_ref(query.float(), dequantized(cache, k_scale, v_scale), meta, scale)


# ---- writes: the bytes of quantize_kv_ref ----


def rounding_cases() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties: to even) and the floats either side of
    them, subnormals, past 448 (clamped), infinities, fp32 subnormals and signed zeros."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    edges = torch.tensor([449.0, 464.0, 1e6, float("inf"), 2.0**-10, 3 * 2.0**-11, 1e-40, 0.0, -0.0])
    return torch.cat([values, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), edges, -edges])


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_store_rounds_as_torch_casts(scale):
    """The kernels' e4m3 rounding (integer arithmetic on the fp32 bits) gives torch's bytes on every case."""
    x = rounding_cases() * scale
    x = torch.cat([x, torch.zeros(-x.numel() % 16)]).view(-1, 1, 16).to(DEVICE)
    cache = quantize_kv_ref(torch.zeros(2, x.shape[0], 1, 1, 16), 1.0).to(DEVICE)
    write_kv_triton(x, -x, cache, torch.arange(x.shape[0], device=DEVICE), scale, scale)
    assert torch.equal(fp8_bytes(cache[0]).view(x.shape), fp8_bytes(quantize_kv_ref(x, scale)))
    assert torch.equal(fp8_bytes(cache[1]).view(x.shape), fp8_bytes(quantize_kv_ref(-x, scale)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_the_reference_bytes(dtype):
    """Strided K/V views of a fused projection, a padding slot, slots across partial blocks; the slots not written
    keep their bytes; the torch path through ``dispatch.write_kv`` writes the same."""
    gen = torch.Generator().manual_seed(1)
    t, kvh, d = 6, 2, 24  # head_dim off a power of two: masked lanes
    kv = (torch.randn(t, 2 * kvh * d, generator=gen) * 8).to(dtype).to(DEVICE)
    key, value = kv[:, : kvh * d].view(t, kvh, d), kv[:, kvh * d:].view(t, kvh, d)
    slots = torch.tensor([5, -1, 0, 11, 6, 2], device=DEVICE)
    base = garbage_fp8_cache(4, 3, kvh, d, gen)
    ours, ref, routed = base.clone(), base.clone(), base.clone()
    write_kv_triton(key, value, ours, slots, K_SCALE, V_SCALE)
    write_kv_padded_ref(key, value, ref, slots, K_SCALE, V_SCALE)
    dispatch.write_kv(key, value, routed, slots, K_SCALE, V_SCALE)
    assert torch.equal(fp8_bytes(ours), fp8_bytes(ref)) and torch.equal(fp8_bytes(routed), fp8_bytes(ref))
    flat = fp8_bytes(ours).view(2, -1, kvh, d)
    written = slots[slots >= 0]
    assert torch.equal(flat[0, written], fp8_bytes(quantize_kv_ref(key[slots >= 0], K_SCALE)))
    assert torch.equal(flat[1, written], fp8_bytes(quantize_kv_ref(value[slots >= 0], V_SCALE)))
    assert (ours[0].float().abs().view(-1, kvh, d)[written] == FP8_E4M3_MAX).any()  # clamped, not NaN
    untouched = [s for s in range(12) if s not in written.tolist()]
    assert torch.equal(flat[:, untouched], fp8_bytes(base).view(2, -1, kvh, d)[:, untouched])


@pytest.mark.parametrize("norm,dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_prologue_stores_the_bytes_of_its_own_k(norm, dtype):
    """The fused prologue's cache holds ``quantize_kv_ref`` of the k it rotated (left in place) and of v, with the
    layer's scales; q and k equal the reference's as with a 16-bit cache, the cache within one e4m3 step of it."""
    t, h, kvh, d, rot = 3, 4, 2, 32, 16  # partial rotary: the tail is stored too
    outs = []
    for fn in (qkv_prologue_ref, qkv_prologue_triton):
        qkv, q, k, v, (qw, kw), cos, sin, slots = prologue_case(t, h, kvh, d, rot, dtype, norm)
        cache = quantize_kv_ref(torch.zeros(2, 8, 4, kvh, d), 1.0).to(DEVICE)
        fn(q, k, v, qw, kw, 1e-6, cos, sin, True, cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
        outs.append((qkv, k, v, slots, cache))
    (qkv_ref, _, _, _, cache_ref), (qkv_tri, k_tri, v_tri, slots, cache_tri) = outs
    expected = quantize_kv_ref(torch.zeros(2, 8, 4, kvh, d), 1.0).to(DEVICE)
    write_kv_padded_ref(k_tri, v_tri, expected, slots, K_SCALE, V_SCALE)
    assert torch.equal(fp8_bytes(cache_tri), fp8_bytes(expected))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(qkv_tri.float(), qkv_ref.float(), atol=tol, rtol=tol)
    step = dequantized(cache_ref, K_SCALE, V_SCALE).abs() * 2.0 ** -3 + 2.0 ** -9 * V_SCALE  # one e4m3 step
    assert bool(((dequantized(cache_tri, K_SCALE, V_SCALE) - dequantized(cache_ref, K_SCALE, V_SCALE)).abs()
                 <= step).all())


def test_dispatch_prologue_passes_the_scales():
    """The torch path (``dispatch.qkv_prologue`` off CUDA) quantizes with the scales it is given."""
    qkv, q, k, v, (qw, kw), cos, sin, slots = prologue_case(2, 2, 1, 16, 16, torch.float32, True)
    cache = quantize_kv_ref(torch.zeros(2, 8, 4, 1, 16), 1.0)
    dispatch.qkv_prologue(q, k, v, qw, kw, 1e-6, cos, sin, True, cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    flat = fp8_bytes(cache).view(2, -1, 1, 16)
    assert torch.equal(flat[0, slots[0]], fp8_bytes(quantize_kv_ref(k[0], K_SCALE)))
    assert torch.equal(flat[1, slots[0]], fp8_bytes(quantize_kv_ref(v[0], V_SCALE)))


# ---- reads: attention over the dequantized cache ----

PREFILL_CASES = [  # (q_lens, seq_lens, group, block_size)
    ([9], [9], 2, 4),  # a whole prompt
    ([17, 5], [17, 5], 4, 16),  # tiles straddling sequences, partial blocks
    ([20], [45], 1, 4),  # a chunk after a cached prefix
    ([3, 1, 18, 1], [3, 20, 40, 70], 2, 16),  # decode tokens around prefill chunks
]


@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_reads_fp8(case):
    q_lens, seq_lens, group, block_size = PREFILL_CASES[case]
    query, cache, meta = make_fp8_step(q_lens, seq_lens, group=group, block_size=block_size, seed=case)
    out = paged_prefill_attention_triton(query, cache, meta, 0.35, SMALL, K_SCALE, V_SCALE)
    torch.testing.assert_close(out, reference(query, cache, meta, 0.35), atol=1e-5, rtol=1e-5)


def test_prefill_kv_splits_read_fp8():
    """A few tokens after a cached prefix, keys split in 3 (the output scale on each partial) and reduced."""
    query, cache, meta = make_fp8_step([4, 1], [45, 30], group=2, block_size=4, seed=7)
    plan = TritonAttentionPlan(prefill_block_m=16, prefill_block_n=16, prefill_splits=3)
    out = paged_attention_triton(query, cache, meta, 0.35, plan, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, reference(query, cache, meta, 0.35), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits,group,dtype", [(1, 1, torch.float32), (3, 4, torch.float32),
                                                    (3, 2, torch.bfloat16)])
def test_decode_reads_fp8(num_splits, group, dtype):
    """Split-KV decode, gated (the Qwen3-Next output gate after the V scale), bf16 queries over an fp8 cache too."""
    query, cache, meta = make_fp8_step([1] * 4, [1, 7, 33, 70], group=group, block_size=4, dtype=dtype,
                                       seed=10 + group)
    gate = gate_like(query, 11)
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16)
    out = paged_decode_attention_triton(query, cache, meta, 0.3, plan, gate, K_SCALE, V_SCALE)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = reference(query, cache, meta, 0.3) * torch.sigmoid(gate.float())
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_verify_rows_read_fp8_as_decode_rows(num_splits):
    """Verify rows over an fp8 cache: each token bitwise its one-token decode row, both close to the reference."""
    q_lens, seq_lens = [3, 1, 5], [3, 17, 33]
    query, cache, meta = make_fp8_step(q_lens, seq_lens, group=2, block_size=4, seed=20)
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    out = paged_rows_attention_triton(query, cache, meta, 0.3, plan, rows=decode_rows(meta, query.shape[0]), **scales)
    decode_meta = plain_decode_meta(meta, rows_of(q_lens, seq_lens), 4)
    assert torch.equal(out, paged_decode_attention_triton(query, cache, decode_meta, 0.3, plan, **scales))
    torch.testing.assert_close(out, reference(query, cache, meta, 0.3), atol=1e-5, rtol=1e-5)


def test_a_16_bit_cache_ignores_the_scales():
    """Scales belong to an fp8 cache: another cache's results keep their bits whatever the layer's scales."""
    from tests.kernels.test_triton_attention import make_step

    query, cache, meta = make_step([1, 1], [9, 20], group=2, block_size=4, seed=3)
    plan = TritonAttentionPlan(num_splits=2, decode_block_n=16)
    assert torch.equal(paged_attention_triton(query, cache, meta, 0.3, plan, k_scale=0.5, v_scale=3.0),
                       paged_attention_triton(query, cache, meta, 0.3, plan))


def test_e5m2_caches_are_refused():
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=torch.float8_e5m2, device=DEVICE)
    with pytest.raises(ValueError, match="e4m3"):
        write_kv_triton(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), cache, torch.zeros(1, dtype=torch.int64))


# ---- CUDA: model shapes ----


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_writes_store_the_reference_bytes(d):
    """bf16, 8 KV heads, 3,000 tokens (a padding slot among them), blocks of 16: KV write and prologue."""
    gen = torch.Generator().manual_seed(d)
    t, h, kvh = 3000, 32, 8
    kv = (torch.randn(t, 2 * kvh * d, generator=gen) * 4).to(torch.bfloat16).cuda()
    key, value = kv[:, : kvh * d].view(t, kvh, d), kv[:, kvh * d:].view(t, kvh, d)
    slots = torch.randperm(4096, generator=gen)[:t].cuda()
    slots[17] = -1
    base = garbage_fp8_cache(256, 16, kvh, d, gen, "cuda")
    ours, ref = base.clone(), base.clone()
    write_kv_triton(key, value, ours, slots, K_SCALE, V_SCALE)
    write_kv_padded_ref(key, value, ref, slots, K_SCALE, V_SCALE)
    assert torch.equal(fp8_bytes(ours), fp8_bytes(ref))
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=gen)).to(torch.bfloat16).cuda()
    q, k, v = qkv[:, : h * d].view(t, h, d), qkv[:, h * d:(h + kvh) * d].view(t, kvh, d), qkv[:, (h + kvh) * d:].view(
        t, kvh, d)
    from pipeline.models.rope import RotaryEmbedding

    rope = RotaryEmbedding(d, d, 40960, 1e6, dtype=torch.bfloat16, device="cuda").step_rope(
        torch.randint(0, 40000, (t,), generator=gen).cuda())
    weights = [(1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16).cuda() for _ in range(2)]
    cache = base.clone()
    qkv_prologue_triton(q, k, v, *weights, 1e-6, rope.cos_table, rope.sin_table, True, cache, slots, rope.positions,
                        K_SCALE, V_SCALE)
    expected = base.clone()
    write_kv_padded_ref(k, v, expected, slots, K_SCALE, V_SCALE)
    assert torch.equal(fp8_bytes(cache), fp8_bytes(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 4), (256, 8)])
def test_gpu_prefill_reads_fp8(d, group):
    """Whole prompts, a chunk after 3,000 cached tokens and decode tokens in one step; the default plan."""
    q_lens, seq_lens = [1, 700, 1, 333, 1024, 5], [50, 700, 3000, 3333, 1024, 5]
    query, cache, meta = make_fp8_step(q_lens, seq_lens, kvh=2, group=group, d=d, block_size=16,
                                       dtype=torch.bfloat16, device="cuda", seed=d)
    out = paged_attention_triton(query, cache, meta, d**-0.5, None, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float(), reference(query, cache, meta, d**-0.5), atol=2e-2, rtol=2e-2)
    plan = TritonAttentionPlan(prefill_splits=4)  # the split partials and their reduce
    out = paged_attention_triton(query, cache, meta, d**-0.5, plan, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float(), reference(query, cache, meta, d**-0.5), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 4), (256, 8)])
def test_gpu_decode_reads_fp8_at_32k(d, group):
    """Batch of 4 up to 32k keys, 8 KV heads, gated; the heuristic's splits, one split and the cap."""
    seq_lens = [32768, 1, 4097, 20000]
    query, cache, meta = make_fp8_step([1] * 4, seq_lens, kvh=8, group=group, d=d, block_size=16,
                                       dtype=torch.bfloat16, device="cuda", seed=d)
    gate = gate_like(query, d)
    ref = reference(query, cache, meta, d**-0.5) * torch.sigmoid(gate.float())
    for plan in (None, TritonAttentionPlan(num_splits=1), TritonAttentionPlan(num_splits=128)):
        out = paged_decode_attention_triton(query, cache, meta, d**-0.5, plan, gate, K_SCALE, V_SCALE)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 4), (256, 2)])
def test_gpu_verify_rows_read_fp8_as_decode_rows(d, group):
    q_lens, seq_lens = [16, 1, 7, 16, 5], [16, 15, 4097, 300, 2222]
    query, cache, meta = make_fp8_step(q_lens, seq_lens, kvh=4, group=group, d=d, block_size=16,
                                       dtype=torch.bfloat16, device="cuda", seed=d + 1)
    gate = gate_like(query, d + 2)
    rows = decode_rows(meta, query.shape[0])
    decode_meta = plain_decode_meta(meta, rows_of(q_lens, seq_lens), 16)
    ref = reference(query, cache, meta, d**-0.5) * torch.sigmoid(gate.float())
    for num_splits in (1, 7, 128):
        plan = TritonAttentionPlan(num_splits=num_splits)
        out = paged_rows_attention_triton(query, cache, meta, d**-0.5, plan, gate, rows, K_SCALE, V_SCALE)
        plain = paged_decode_attention_triton(query, cache, decode_meta, d**-0.5, plan, gate, K_SCALE, V_SCALE)
        assert torch.equal(out, plain), f"{num_splits} splits"
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
