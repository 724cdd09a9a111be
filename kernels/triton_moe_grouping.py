"""``group_by_expert`` (kernels/moe.py, the contract and the torch version) in one Triton program, for decode-sized
batches.

Between 17 and a few hundred tokens the grouped MoE path runs every step, and its torch grouping is about a dozen
small kernels a layer (a radix sort with its scans, scatter, cumsum, searchsorted), each a launch on the step's
critical path. Here one program holds all the slots: it sorts ``key * N_PAD + slot`` (a
stable sort by expert, the torch version's order), counts the experts with ``tl.histogram``, scans the padded
counts, gathers each sorted slot's destination, and scatters the slots into the sentinel-filled ``sorted_slots``
and each block's first slot's expert into the ``-1``-filled ``block_expert`` (a CTA barrier between the fills and
the scatters). Same outputs as the torch version bit for bit; no host sync,
output sizes fixed by the input's shape: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton

MAX_SLOTS = 4096  # token slots (T * k) one program sorts in registers; more take the torch version
MAX_EXPERTS = 1022  # keys E (not local) and E + 1 (padding) must fit the histogram too


@_jit(do_not_specialize=["n", "P", "NB", "expert_offset"])
def _group_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n, P, NB, expert_offset,
    E: tl.constexpr, BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    i = tl.arange(0, N_PAD)
    valid = i < n
    local = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32) - expert_offset
    key = tl.where((local >= 0) & (local < E), local, E)  # E: routed to another rank's expert
    key = tl.where(valid, key, E + 1)  # padding lanes sort after everything
    order = tl.sort(key * N_PAD + i)  # by expert, then by slot id: stable
    s_key = order // N_PAD
    s_slot = order % N_PAD
    experts = tl.arange(0, E_PAD)
    counts = tl.where(experts < E, tl.histogram(key, E_PAD), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = tl.cumsum(counts, 0) - counts  # each expert's first position among the sorted slots
    e = tl.minimum(s_key, E - 1)
    dest = tl.gather(padded_start, e, 0) + i - tl.gather(start, e, 0)
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + p, tl.zeros([CHUNK], dtype=tl.int32) + n, mask=p < P)
        tl.store(block_expert_ptr + p, tl.zeros([CHUNK], dtype=tl.int32) - 1, mask=p < NB)
    tl.debug_barrier()  # the fills land before the scatters over them
    local_slot = s_key < E
    tl.store(sorted_ptr + dest, s_slot, mask=local_slot)
    # an expert's run is a whole number of blocks and starts with a real slot, so every used block begins with one:
    # that slot names the block's expert
    tl.store(block_expert_ptr + dest // BLOCK_M, s_key, mask=local_slot & (dest % BLOCK_M == 0))
    tl.store(num_padded_ptr, tl.sum(padded, 0))


def group_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_offset: int = 0
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract and outputs as ``kernels.moe.group_by_expert`` for ``topk_ids.numel() <= MAX_SLOTS`` and
    ``num_experts <= MAX_EXPERTS``."""
    n = topk_ids.numel()
    if not 1 <= num_experts <= MAX_EXPERTS or block_m < 1:
        raise ValueError(f"need 1 <= num_experts <= {MAX_EXPERTS} and block_m >= 1, got {num_experts}, {block_m}")
    if n > MAX_SLOTS:
        raise ValueError(f"{n} token slots exceed MAX_SLOTS = {MAX_SLOTS}")
    p = n + num_experts * (block_m - 1)
    nb = p // block_m
    device = topk_ids.device
    sorted_slots = torch.empty(p, dtype=torch.int32, device=device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=device)
    num_padded = torch.empty((), dtype=torch.int32, device=device)
    if n == 0:
        sorted_slots.fill_(0)
        block_expert.fill_(-1)
        num_padded.fill_(0)
        return sorted_slots, block_expert, num_padded
    n_pad = max(16, triton.next_power_of_2(n))
    _group_kernel[(1,)](
        topk_ids.reshape(-1).contiguous(), sorted_slots, block_expert, num_padded, n, p, nb, expert_offset,
        E=num_experts, BLOCK_M=block_m, N_PAD=n_pad, E_PAD=triton.next_power_of_2(num_experts + 2),
        # the sort dominates: from 2048 slots up, 32 warps take it in about half the time of 8
        CHUNK=min(1024, n_pad), num_warps=32 if n_pad >= 2048 else 8,
    )
    return sorted_slots, block_expert, num_padded
