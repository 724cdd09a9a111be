"""Fused mixture-of-experts: routing, torch references, slot grouping, and the device-picking entry point.

Weights (per layer): ``w13 [E, 2*I, H]`` (rows ``0..I-1`` the gate projection, ``I..2I-1`` the up projection, as
HF ``gate_proj``/``up_proj`` stacked), ``w2 [E, H, I]`` (down projection). Hidden states ``x [T, H]``. Routing gives
``topk_weights [T, k]`` (float32) and ``topk_ids [T, k]`` (int32/int64, global expert ids). The output is

    y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

in x's dtype, accumulated in fp32. Expert parallelism: the weights may hold only experts
``[expert_offset, expert_offset + num_local_experts)`` of the global ids; token slots routed elsewhere contribute
zero, so each rank returns its experts' partial sums and a later combine adds them.

A sigmoid-gated shared expert (Qwen3-Next / Qwen3.5) of the experts' size can ride along as one more expert:
``route_topk(..., shared_expert_id=s)`` reads its gate logit from the logits' last column and appends slot k to
every token, id ``s`` with weight ``sigmoid(logit)`` (so ``k`` above is then the routed top-k + 1). The weights
hold it as their last local expert: ``num_local_experts`` counts it and ``s = expert_offset + num_local_experts - 1``
on the rank that computes it (``pipeline/models/moe.py`` uses ``s = E``, local only on the rank holding expert
``E - 1``). The expert compute does not tell it from a routed expert, and ``DECODE_SLOTS`` counts its slots too.

Either weight may be an FP8 stack (``kernels.fp8.Fp8Weight``: float8 ``[E, rows, cols]`` with a scale grid per
expert), as the CUDA path keeps FP8 checkpoints' experts; the result is then that of the dequantized weights
(``fused_moe_ref`` dequantizes each expert it runs, in fp32).

``fused_moe`` runs the Triton kernels where ``dispatch.use_triton`` says so, else ``fused_moe_ref``: for a few
token slots (decode) one program per slot reads its expert's rows directly (``kernels/triton_moe_decode.py``), for
more the slots are grouped by expert (``group_by_expert``, host-sync free) and run as grouped GEMMs
(``kernels/triton_moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import Fp8Weight, dequantize_fp8_ref


def route_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   shared_expert_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, then top-k (ties as ``torch.topk`` orders them); if ``renormalize``, the k
    weights are rescaled to sum to 1. Returns ``(topk_weights fp32 [T, k], topk_ids int64 [T, k])``.

    ``shared_expert_id``: the logits' last column is a shared expert's gate logit, not a routed expert: the top-k
    are picked among the other columns as without it and a (k+1)-th slot is appended, id ``shared_expert_id`` with
    weight ``sigmoid(logit)`` in fp32 (Qwen3-Next / Qwen3.5's sigmoid-gated shared expert run as one more expert):
    ``[T, k + 1]`` each."""
    routed = router_logits if shared_expert_id is None else router_logits[:, :-1]
    probs = torch.softmax(routed.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_ids = topk_ids.to(torch.int64)
    if shared_expert_id is not None:
        topk_weights = torch.cat([topk_weights, torch.sigmoid(router_logits[:, -1:].float())], dim=1)
        topk_ids = torch.cat([topk_ids, torch.full_like(topk_ids[:, :1], shared_expert_id)], dim=1)
    return topk_weights, topk_ids


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               shared_expert_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_topk_ref``'s result (ids as int32 on the Triton path): one Triton kernel where
    ``dispatch.use_triton`` says so (``kernels/triton_moe_routing.py``), else the torch reference."""
    from kernels.dispatch import use_triton

    if use_triton(router_logits.device):
        from kernels.triton_moe_routing import route_topk_triton

        return route_topk_triton(router_logits, top_k, renormalize, shared_expert_id)
    return route_topk_ref(router_logits, top_k, renormalize, shared_expert_id)


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def expert_weights(w: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None]:
    """(weights, scale, block) of an expert stack: a plain one has no scale and no block."""
    if isinstance(w, Fp8Weight):
        return w.q, w.scale, w.block
    return w, None, None


def fp8_scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None) -> dict:
    """The expert kernels' FP8 keywords (scale pointer, expert and row strides, block; none for 16-bit weights)."""
    if scale is None or block is None:
        return {}
    return {"s_ptr": scale, "s_e": scale.stride(0), "s_r": scale.stride(1), "scale_rows": block[0],
            "scale_cols": block[1], "scale_ncols": scale.shape[-1], "W_FP8": True}


def _check_fp8_stack(name: str, w: Fp8Weight) -> None:
    e, rows, cols = w.q.shape
    grid = (e, -(-rows // w.block[0]), -(-cols // w.block[1]))
    if w.q.dtype != torch.float8_e4m3fn or w.scale.dtype != torch.float32 or tuple(w.scale.shape) != grid:
        raise ValueError(f"{name}: need float8_e4m3fn weights and float32 scales {list(grid)}, got {w.q.dtype} and "
                         f"{w.scale.dtype} {list(w.scale.shape)}")
    if w.scale.stride(-1) != 1:
        raise ValueError(f"{name}: the scales must be row-major")


def check_kernel_inputs(x: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        num_local_experts: int | None) -> tuple[int, int, int, int, int]:
    """The Triton paths' contract on shapes, dtypes and layout -> (T, H, local experts, I, k). An FP8 stack needs
    its float32 scale grid per expert; a plain one x's dtype."""
    fp8 = {name for name, w in (("w13", w13), ("w2", w2)) if isinstance(w, Fp8Weight)}
    for name, w in (("w13", w13), ("w2", w2)):
        if isinstance(w, Fp8Weight) and w.q.dim() == 3:
            _check_fp8_stack(name, w)
    w13, w2 = expert_weights(w13)[0], expert_weights(w2)[0]
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"need x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    t, h = x.shape
    n_local, two_i, _ = w13.shape
    inter = w2.shape[2]
    if w13.shape[2] != h or two_i != 2 * inter or w2.shape[:2] != (n_local, h):
        raise ValueError(f"inconsistent shapes x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if num_local_experts is not None and num_local_experts != n_local:
        raise ValueError(f"num_local_experts = {num_local_experts} but w13 holds {n_local} experts")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"need topk_weights/topk_ids [T, k], got {tuple(topk_weights.shape)}, "
                         f"{tuple(topk_ids.shape)}")
    if x.dtype not in KERNEL_DTYPES or any(w.dtype != x.dtype for name, w in (("w13", w13), ("w2", w2))
                                           if name not in fp8):
        raise ValueError(f"x, w13 and w2 must share a dtype in {KERNEL_DTYPES} (or the weights be FP8 stacks)")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("w13 and w2 must be contiguous")
    return t, h, n_local, inter, topk_ids.shape[1]


def _expert_matrix(w: torch.Tensor | Fp8Weight, e: int) -> torch.Tensor:
    """Expert ``e``'s weight in fp32 (an FP8 stack's dequantized)."""
    if isinstance(w, Fp8Weight):
        return dequantize_fp8_ref(w.q[e], w.scale[e], w.block)
    return w[e].float()


def _local_experts(w13: torch.Tensor | Fp8Weight, num_local_experts: int | None) -> int:
    n = w13.shape[0] if num_local_experts is None else num_local_experts
    if n != w13.shape[0]:
        raise ValueError(f"num_local_experts = {n} but w13 holds {w13.shape[0]} experts")
    return n


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_offset: int = 0, num_local_experts: int | None = None,
) -> torch.Tensor:
    """The oracle: per expert that received tokens, gather its tokens, run the gated MLP in fp32 (FP8 stacks
    dequantized), scale by the routing weights and add into an fp32 ``[T, H]`` accumulator; cast to x's dtype once
    at the end."""
    t, h = x.shape
    n_local = _local_experts(w13, num_local_experts)
    inter = w2.shape[-1]
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).to(torch.int64) - expert_offset
    flat_w = topk_weights.reshape(-1).float()
    tokens = torch.arange(t, device=x.device).repeat_interleave(k)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for e in flat_ids.unique().tolist():
        if not 0 <= e < n_local:
            continue
        sel = (flat_ids == e).nonzero().squeeze(1)
        tok = tokens.index_select(0, sel)
        xs = x.index_select(0, tok).float()
        gate_up = xs @ _expert_matrix(w13, e).t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (act @ _expert_matrix(w2, e).t()) * flat_w.index_select(0, sel)[:, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def group_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flat ``(token, j)`` slots (slot id ``token * k + j``) by expert, padding each expert's run to a
    multiple of ``block_m`` with the sentinel slot id ``T * k``.

    ``num_experts`` is the number of local experts, covering global ids ``[expert_offset, expert_offset +
    num_experts)``; slots routed to other experts are dropped (they appear in no block). Returns

    - ``sorted_slots int32 [P]``, ``P = T*k + num_experts*(block_m - 1)`` (a fixed upper bound): positions
      ``[0, num_padded)`` hold the padded runs in expert order; the tail is sentinel;
    - ``block_expert int32 [P // block_m]``: the local expert of each block of ``block_m`` positions, ``-1`` for
      blocks past ``num_padded`` (kernels skip them). Experts with no tokens own no block;
    - ``num_padded int32 []``: the padded length.

    Torch ops only, no host synchronisation and output sizes fixed by the inputs' shapes: CUDA-graph capturable.
    """
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"need num_experts >= 1 and block_m >= 1, got {num_experts} and {block_m}")
    device = topk_ids.device
    n_slots = topk_ids.numel()
    p = n_slots + num_experts * (block_m - 1)
    local = topk_ids.reshape(-1).to(torch.int64) - expert_offset
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # num_experts: not local
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts  # each expert's first position among the sorted (unpadded) slots
    sorted_key, order = torch.sort(key, stable=True)
    e = sorted_key.clamp(max=num_experts - 1)
    dest = padded_start[e] + torch.arange(n_slots, device=device) - start[e]
    dest = torch.where(sorted_key < num_experts, dest, p)  # non-local slots go to a dump entry past the end
    sorted_slots = torch.full((p + 1,), n_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(p // block_m, dtype=torch.int64, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # first expert whose run ends later
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots[:p], block_expert, padded_end[-1].to(torch.int32)


DECODE_SLOTS = 128  # fused_moe takes the grouping-free decode kernels up to this many token slots (T * k);
# at 16 tokens x 8 experts they still beat the grouped GEMMs


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_offset: int = 0, num_local_experts: int | None = None,
) -> torch.Tensor:
    """The MoE expert compute: Triton kernels where ``dispatch.use_triton(x.device)`` (the GEMV-like decode kernels
    of ``kernels/triton_moe_decode.py`` when ``T * k <= DECODE_SLOTS``, else the grouped GEMMs of
    ``kernels/triton_moe.py``), else ``fused_moe_ref``. Under ``dispatch.rows_as_decode`` the decode kernels take
    one token's launch configs whatever T is: each token's programs then compute as in a one-token step."""
    from kernels.dispatch import decode_rows_on, use_triton

    if use_triton(x.device):
        if topk_ids.numel() <= DECODE_SLOTS:
            from kernels.triton_moe_decode import fused_moe_decode_triton

            return fused_moe_decode_triton(x, w13, w2, topk_weights, topk_ids, expert_offset, num_local_experts,
                                           table_tokens=1 if decode_rows_on() else None)
        from kernels.triton_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, expert_offset, num_local_experts)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, expert_offset, num_local_experts)
