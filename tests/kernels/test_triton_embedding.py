"""The embedding kernel against ``F.embedding``: the same rows, bitwise (a copy), in any dtype and id shape.

On CPU under the Triton interpreter (conftest); on a CUDA machine (``pytest --noconftest``) on the GPU, plus the
``gpu``-marked test, which runs it under dependent launch inside a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import dispatch
from kernels.triton_compat import triton
from kernels.triton_embedding import embedding_ref, embedding_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")


def table(v: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(v, d, generator=gen).to(dtype=dtype, device=DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 5000])  # one block; a width short of its block; two blocks
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_embedding_rows_are_torch_rows(dtype, d, id_dtype):
    weight = table(37, d, dtype)
    ids = torch.tensor([3, 0, 36, 3, 17], dtype=id_dtype, device=DEVICE)
    out = embedding_triton(ids, weight)
    assert out.dtype == dtype and out.shape == (5, d)
    assert torch.equal(out, embedding_ref(ids.long(), weight))


@needs_triton
def test_embedding_keeps_the_ids_shape_and_takes_strided_ids():
    weight = table(11, 32, torch.float32)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]], device=DEVICE)
    assert torch.equal(embedding_triton(ids, weight), embedding_ref(ids, weight))
    assert torch.equal(embedding_triton(ids.t(), weight), embedding_ref(ids.t(), weight))
    assert embedding_triton(ids[:0], weight).shape == (0, 3, 32)


@needs_triton
def test_embedding_gives_zero_rows_for_ids_outside_the_table():
    weight = table(11, 32, torch.float32)
    out = embedding_triton(torch.tensor([-1, 11, 2, 1 << 40], device=DEVICE), weight)
    assert torch.equal(out[2], weight[2])
    assert torch.count_nonzero(out[[0, 1, 3]]) == 0


def test_embedding_rejects_float_ids_and_strided_tables():
    weight = table(11, 32, torch.float32)
    with pytest.raises(ValueError, match="integer ids"):
        embedding_triton(torch.zeros(2, device=DEVICE), weight)
    with pytest.raises(ValueError, match="contiguous rows"):
        embedding_triton(torch.zeros(2, dtype=torch.long, device=DEVICE), weight.t())


def test_dispatch_embedding_on_cpu_is_torch():
    weight = torch.randn(9, 8)
    ids = torch.tensor([8, 0, 4])
    assert torch.equal(dispatch.embedding(ids, weight), embedding_ref(ids, weight))


@pytest.mark.gpu
def test_gpu_embedding_in_a_graph_after_a_kernel_writing_the_ids():
    """Under dependent launch the kernel waits for the one before it: ids written by a dependent-launch kernel
    just before it in the same CUDA graph (the MoE routing's argmax here, as a sampled token feeds the next step)
    are the ones read."""
    from kernels.triton_moe_routing import route_topk_triton

    weight = table(1024, 2048, torch.bfloat16).cuda()
    logits = torch.zeros(4, 1024, device="cuda")
    out = torch.empty(4, 2048, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        _, ids = route_topk_triton(logits, 1, False)  # ids [4, 1] int32: each row's largest logit
        out.copy_(embedding_triton(ids.reshape(-1), weight))

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        tokens = torch.randint(0, 1024, (4,), generator=torch.Generator().manual_seed(seed)).cuda()
        logits.zero_()
        logits[torch.arange(4, device="cuda"), tokens] = 1.0
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, weight[tokens])
