"""The grammar bitmask kernel (kernels/triton_bitmask.py) against its torch reference: named rows only, any slot
order, a vocabulary that ends inside a word and one that spans several programs, whole words refused or allowed.
On CPU the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1); the gpu test takes a real
vocabulary and batch."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.triton_bitmask import BLOCK, apply_token_bitmask_ref, apply_token_bitmask_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs triton (GPU or TRITON_INTERPRET=1)")


def case(rows: int, slots: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2**31, 2**31 - 1, (slots, (vocab + 31) // 32), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # allows everything
    if slots > 1:
        bitmask[1, : bitmask.shape[1] // 2] = 0  # the first half refused whole
    return torch.randn(rows, vocab, generator=gen), bitmask


@pytest.mark.parametrize("vocab", [17, BLOCK, BLOCK + 33, 2 * BLOCK + 5])
def test_kernel_equals_reference(vocab):
    logits, bitmask = case(6, 4, vocab, vocab)
    rows = torch.tensor([5, 0, 2, 3], dtype=torch.int32)
    slots = torch.tensor([2, 1, 0, 3], dtype=torch.int32)
    expected = apply_token_bitmask_ref(logits.clone(), bitmask, rows, slots)
    got = apply_token_bitmask_triton(logits.clone().to(DEVICE), bitmask.to(DEVICE), rows.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(got[1].cpu(), logits[1]) and torch.equal(got[4].cpu(), logits[4])  # rows not named
    assert torch.isinf(expected[0]).any() and torch.equal(expected[2], logits[2])  # slot 0 allows everything


def test_no_rows_and_bad_shapes():
    logits, bitmask = case(2, 1, 64, 0)
    empty = torch.empty(0, dtype=torch.int32)
    assert torch.equal(apply_token_bitmask_triton(logits.clone(), bitmask, empty, empty), logits)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError):
        apply_token_bitmask_triton(torch.zeros(2, 100), bitmask, one, one)  # 2 words hold 64 tokens


@pytest.mark.gpu
def test_kernel_on_a_real_vocabulary_and_batch():
    logits, bitmask = case(256, 256, 151936, 7)
    rows = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:200].to(torch.int32)
    slots = torch.arange(200, dtype=torch.int32)
    expected = apply_token_bitmask_ref(logits.clone(), bitmask, rows, slots)
    got = apply_token_bitmask_triton(logits.cuda(), bitmask.cuda(), rows.cuda(), slots.cuda())
    assert torch.equal(got.cpu(), expected)
