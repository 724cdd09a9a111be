"""The Gated DeltaNet causal conv kernels (``kernels/triton_gdn_conv.py``) against ``causal_conv1d_varlen_ref``.

Under the Triton interpreter on CPU (tests/conftest.py), for real on a GPU: the varlen kernel over prompt mixes that
cross its tiles, the decode kernel over single-token rows (slots out of order with gaps, rows that start fresh,
empty rows), both in bf16 and fp32, with and without bias and activation; slots outside the batch stay untouched.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kernels.gdn import causal_conv1d_varlen_ref
from kernels.triton_compat import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

pytestmark = [pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                 reason="needs triton (GPU or TRITON_INTERPRET=1)"),
              pytest.mark.usefixtures("single_torch_thread")]


def conv_case(lens: list[int], C: int, K: int, dtype: torch.dtype, seed: int, init: list[bool] | None = None,
              bias: bool = True, activation: str | None = "silu", strided: bool = True,
              max_query_len: int | None = None) -> None:
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    wide = torch.randn(T, C + 24, generator=gen).to(device=DEVICE, dtype=dtype)
    x = wide[:, 8:8 + C] if strided else wide[:, :C].contiguous()  # strided: a column slice of a projection
    weight = torch.randn(C, K, generator=gen).to(device=DEVICE, dtype=dtype)
    b = torch.randn(C, generator=gen).to(device=DEVICE, dtype=dtype) if bias else None
    slots = (torch.randperm(11, generator=gen)[:len(lens)] + 1).to(device=DEVICE, dtype=torch.int32)
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
    init_t = torch.tensor(init if init is not None else [i % 3 != 1 for i in range(len(lens))], device=DEVICE)
    states = torch.randn(12, C, K - 1, generator=gen).to(device=DEVICE, dtype=dtype)
    mine, ref = states.clone(), states.clone()
    y = causal_conv1d_varlen_triton(x, weight, b, mine, slots, qsl, init_t, activation, max_query_len=max_query_len)
    keep = [i for i, n in enumerate(lens) if n > 0]  # the reference cannot take an empty row
    keep_qsl = torch.tensor([0, *itertools.accumulate(lens[i] for i in keep)], dtype=torch.int32, device=DEVICE)
    ref_y = causal_conv1d_varlen_ref(x, weight, b, ref, slots[keep], keep_qsl, init_t[keep], activation=activation)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(y, ref_y, **tol)
    assert torch.equal(mine, ref), "conv states differ"
    others = torch.ones(12, dtype=torch.bool, device=DEVICE)
    others[slots.long()] = False
    assert torch.equal(mine[others], states[others]), "slots outside the batch changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 3, 4])
def test_varlen_conv_matches_reference(K, dtype):
    conv_case([1, 3, 17, 70, 130], 40, K, dtype, seed=K)


def test_varlen_conv_short_chunks_keep_older_state_and_options():
    conv_case([1, 2, 1, 2, 5], 40, 4, torch.bfloat16, seed=7, init=[True, True, False, False, True])
    conv_case([2, 1, 3], 520, 4, torch.float32, seed=8, init=[True, True, True], bias=False, activation=None,
              strided=False)
    conv_case([2, 0, 3], 24, 4, torch.float32, seed=9)  # an empty row keeps its slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_update_conv_matches_reference(K, dtype):
    conv_case([1] * 7, 300, K, dtype, seed=10 + K, max_query_len=1)  # channels over two programs


def test_update_conv_fresh_rows_empty_rows_and_options():
    conv_case([1, 1, 1, 1], 40, 4, torch.bfloat16, seed=3, init=[False, True, False, True], max_query_len=1)
    conv_case([1, 0, 1], 24, 4, torch.float32, seed=4, bias=False, activation=None, max_query_len=1)


def test_decode_rows_through_both_kernels_agree_bitwise():
    """The same single-token batch through the varlen and the decode kernel: same outputs and states."""
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    gen = torch.Generator().manual_seed(5)
    C, K, B = 72, 4, 5
    x = torch.randn(B, C, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(C, K, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    states = torch.randn(8, C, K - 1, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    slots = torch.tensor([3, 1, 7, 2, 5], dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, False, True, True, False], device=DEVICE)
    a, b = states.clone(), states.clone()
    ya = causal_conv1d_varlen_triton(x, w, None, a, slots, qsl, init, max_query_len=1)
    yb = causal_conv1d_varlen_triton(x, w, None, b, slots, qsl, init, max_query_len=None)
    assert torch.equal(ya, yb) and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_as_decode_rows_take_one_token_steps_bits(dtype):
    """``as_decode_rows``: rows of 1-4 tokens (an empty one too), each token's output, the final windows and the
    kept windows bitwise those of one-token steps run one after another, and close to the reference."""
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    gen = torch.Generator().manual_seed(21)
    C, K, lens = 72, 4, [3, 1, 4, 0, 2]
    T = sum(lens)
    x = torch.randn(T, C, generator=gen).to(device=DEVICE, dtype=dtype)
    w = torch.randn(C, K, generator=gen).to(device=DEVICE, dtype=dtype)
    bias = torch.randn(C, generator=gen).to(device=DEVICE, dtype=dtype)
    states = torch.randn(32, C, K - 1, generator=gen).to(device=DEVICE, dtype=dtype)
    slots = torch.tensor([3, 1, 7, 2, 5], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, True, True, True, False], device=DEVICE)
    keep = torch.arange(10, 10 + T, dtype=torch.int32, device=DEVICE)
    rows = states.clone()
    y = causal_conv1d_varlen_triton(x, w, bias, rows, slots, qsl, init, max_query_len=max(lens), keep_slots=keep,
                                    as_decode_rows=True)
    steps, y_steps = states.clone(), torch.empty_like(y)
    starts = qsl.tolist()
    for b, n in enumerate(lens):
        for i in range(n):  # one-token steps of this row, in order: a fresh row is fresh only at its first token
            t = starts[b] + i
            out = causal_conv1d_varlen_triton(x[t:t + 1], w, bias, steps, slots[b:b + 1],
                                              torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                                              init[b:b + 1] | (i > 0), max_query_len=1, keep_slots=keep[t:t + 1])
            y_steps[t] = out[0]
    assert torch.equal(y, y_steps) and torch.equal(rows, steps)
    ref_states = states.clone()
    live = [b for b, n in enumerate(lens) if n > 0]
    live_qsl = torch.tensor([0, *itertools.accumulate(lens[b] for b in live)], dtype=torch.int32, device=DEVICE)
    ref = causal_conv1d_varlen_ref(x, w, bias, ref_states, slots[live], live_qsl, init[live], keep_slots=keep)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(y, ref, **tol)


def test_conv_rejects_bad_shapes():
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    x = torch.zeros(2, 8, device=DEVICE)
    slots, qsl, init = (torch.tensor(v, device=DEVICE) for v in ([1, 2], [0, 1, 2], [True, True]))
    with pytest.raises(ValueError):
        causal_conv1d_varlen_triton(x, torch.zeros(8, 4, device=DEVICE), None, torch.zeros(3, 8, 2, device=DEVICE),
                                    slots.int(), qsl.int(), init)
    with pytest.raises(ValueError):
        causal_conv1d_varlen_triton(x, torch.zeros(8, 4, device=DEVICE), None, torch.zeros(3, 8, 3, device=DEVICE),
                                    slots.int(), qsl[:2].int(), init)
    with pytest.raises(ValueError):
        causal_conv1d_varlen_triton(x, torch.zeros(8, 4, device=DEVICE), None, torch.zeros(3, 8, 3, device=DEVICE),
                                    slots.int(), qsl.int(), init, activation="gelu")


@pytest.mark.gpu
def test_gpu_realistic_conv():
    """The Qwen3.5-35B-A3B conv width over a prompt mix (varlen kernel) and a decode batch (update kernel)."""
    C = 2 * 16 * 128 + 32 * 128
    conv_case([1, 600, 37, 1, 3, 257], C, 4, torch.bfloat16, seed=32)
    conv_case([1] * 11, C, 4, torch.bfloat16, seed=33, max_query_len=1)
