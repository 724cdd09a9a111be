"""The Gated DeltaNet layer of Qwen3-Next / Qwen3.5: linear attention with a recurrent state per sequence.

One fused input projection gives ``[qkv | z | b | a]`` (qkv: the conv channels, q and k of the key heads then v
of the value heads; z: the output gate; b, a: the per-value-head beta and decay inputs). The qkv channels run
through a causal depthwise conv (its last K-1 inputs kept per sequence), q and k are l2-normalised in the kernel,
and the delta rule advances an fp32 state [HV, Dk, Dv] per sequence; the output is normed per value head,
gated by silu(z), and projected back. On a decode step the norm runs inside the delta-rule kernel. The conv window
and the state live in two per-layer tensors indexed by each row's state slot (``ctx.state_slots``); the model's
``cache_specs`` declares them.

Under expert parallelism a layer may keep only its rank's share of the heads (``keep_heads``: a contiguous run of
key heads and the value heads that read them): its projection rows, conv channels, gates and states, and the
columns of ``out_proj``, whose partial output is summed over the ranks. Each rank then reads and writes half the
delta-rule states.

Both HF layouts load into the one projection: Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a``, and Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, whose rows are grouped per key head
(``split_qwen3_next_projections`` regroups them at load time).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import gdn
from kernels.fp8 import Fp8Weight
from pipeline.dist.group import ExpertGroup
from pipeline.models.config import ModelArchConfig
from pipeline.models.forward_context import ForwardContext, StateSlotSpec
from pipeline.models.layers import Linear, MergedLinear

# Qwen3.5's four input projections, loaded as the shards of the fused one: HF name piece -> (fused piece, shard)
GATED_DELTA_NET_FUSED_NAMES = {
    "linear_attn.in_proj_qkv": ("linear_attn.in_proj", 0),
    "linear_attn.in_proj_z": ("linear_attn.in_proj", 1),
    "linear_attn.in_proj_b": ("linear_attn.in_proj", 2),
    "linear_attn.in_proj_a": ("linear_attn.in_proj", 3),
}


class _ConvWeight(nn.Module):
    """Holds ``weight`` [C, 1, K] under the HF name ``linear_attn.conv1d.weight``."""

    def __init__(self, channels: int, kernel_size: int, dtype=None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=dtype, device=device))


class GatedRMSNorm(nn.Module):
    """Holds the per-head RMSNorm weight of the delta-rule output (transformers' RMSNormGated; not zero-centred).
    The norm, times silu(z), is applied by ``gdn.gated_delta_rule`` (inside the decode kernel)."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps


def gated_delta_net_layer(arch: ModelArchConfig, state_index: int, dtype=None, device=None) -> GatedDeltaNet:
    """The config's Gated DeltaNet layer over the state tensors from cache index ``state_index``."""
    return GatedDeltaNet(state_index, arch.hidden_size, arch.linear_num_key_heads, arch.linear_num_value_heads,
                         arch.linear_key_head_dim, arch.linear_value_head_dim, arch.linear_conv_kernel_dim,
                         arch.rms_norm_eps, dtype, device)


class GatedDeltaNet(nn.Module):
    """``forward(x [T, hidden], ctx) -> [T, hidden]``; reads and advances the states of ``ctx.state_slots``.

    ``state_index``: the cache index of this layer's conv window tensor; its delta-rule state is the next."""

    def __init__(self, state_index: int, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int, rms_norm_eps: float, dtype=None, device=None) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.state_index = state_index
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.in_proj = MergedLinear(hidden_size, [self.conv_dim, self.value_dim, num_v_heads, num_v_heads], False,
                                    dtype, device)
        self.conv1d = _ConvWeight(self.conv_dim, conv_kernel_size, dtype, device)
        # fp32: the gates are computed in fp32, and checkpoints may store these in fp32
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, dtype=torch.float32, device=device))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads, dtype=torch.float32, device=device))
        self.norm = GatedRMSNorm(head_v_dim, rms_norm_eps, dtype, device)
        self.out_proj = Linear(self.value_dim, hidden_size, False, dtype, device)
        self.head_group: ExpertGroup | None = None  # keep_heads: the ranks holding the other heads

    @torch.no_grad()
    def keep_heads(self, rank: int, size: int) -> None:
        """Keep rank ``rank`` of ``size``'s share of the heads (after loading, before any cache is sized)."""
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if hk % size:
            raise ValueError(f"{hk} key heads cannot be split over {size} ranks")
        k_local, v_local = hk // size, hv // size
        ks = slice(rank * k_local * dk, (rank + 1) * k_local * dk)
        vs = slice(rank * v_local * dv, (rank + 1) * v_local * dv)
        heads = slice(rank * v_local, (rank + 1) * v_local)
        key, conv, value = self.key_dim, self.conv_dim, self.value_dim
        rows = torch.cat([torch.arange(key)[ks], key + torch.arange(key)[ks], 2 * key + torch.arange(value)[vs],
                          conv + torch.arange(value)[vs], conv + value + torch.arange(hv)[heads],
                          conv + value + hv + torch.arange(hv)[heads]]).to(self.in_proj.weight.device)
        self.in_proj.keep_rows(rows)
        channels = rows[:2 * k_local * dk + v_local * dv]
        self.conv1d.weight = nn.Parameter(self.conv1d.weight.index_select(0, channels), requires_grad=False)
        self.dt_bias = nn.Parameter(self.dt_bias[heads].clone(), requires_grad=False)
        self.A_log = nn.Parameter(self.A_log[heads].clone(), requires_grad=False)
        self.out_proj.keep_columns(vs.start, vs.stop)
        self.num_k_heads, self.num_v_heads = k_local, v_local
        self.key_dim, self.value_dim = k_local * dk, v_local * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj.out_sizes = [self.conv_dim, self.value_dim, v_local, v_local]
        self.out_proj.in_features = self.value_dim

    def state_specs(self, dtype: torch.dtype) -> list[StateSlotSpec]:
        """The conv window [C, K-1] in the model dtype, then the delta-rule state [HV, Dk, Dv] in fp32."""
        return [StateSlotSpec((self.conv_dim, self.conv_kernel_size - 1), dtype),
                StateSlotSpec((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)]

    @property
    def input_proj(self) -> MergedLinear:
        return self.in_proj

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.forward_projected(self.in_proj(x), ctx)

    def forward_projected(self, proj: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``forward`` from the fused input projection on."""
        meta = ctx.attention
        T = proj.shape[0]
        C, V, HV = self.conv_dim, self.value_dim, self.num_v_heads
        conv_states, ssm_states = ctx.caches[self.state_index], ctx.caches[self.state_index + 1]
        mixed = gdn.causal_conv1d_varlen(proj[:, :C], self.conv1d.weight.view(C, self.conv_kernel_size), None,
                                         conv_states, ctx.state_slots, meta.query_start_loc, ctx.has_initial_state,
                                         meta.max_query_len, keep_slots=ctx.keep_slots)
        kd = self.key_dim
        q = mixed[:, :kd].view(T, self.num_k_heads, self.head_k_dim)
        k = mixed[:, kd:2 * kd].view(T, self.num_k_heads, self.head_k_dim)
        v = mixed[:, 2 * kd:].view(T, HV, self.head_v_dim)
        z = proj[:, C:C + V].view(T, HV, self.head_v_dim)
        o = gdn.gated_delta_rule(q, k, v, proj[:, C + V + HV:], proj[:, C + V:C + V + HV], self.A_log, self.dt_bias,
                                 ssm_states, ctx.state_slots, meta.query_start_loc, ctx.has_initial_state,
                                 meta.max_query_len, meta.query_start_loc_host,
                                 gated_norm=(z, self.norm.weight, self.norm.eps), keep_slots=ctx.keep_slots)
        out = self.out_proj(o.view(T, V))
        return out if self.head_group is None else self.head_group.all_reduce(out)


def split_qwen3_next_projections(name: str, tensor: torch.Tensor, num_k_heads: int, num_v_heads: int,
                                 head_k_dim: int, head_v_dim: int) -> list[tuple[str, torch.Tensor]]:
    """Qwen3-Next's per-key-head grouped ``in_proj_qkvz`` [HK * (2Dk + 2rDv), H] / ``in_proj_ba`` [HK * 2r, H]
    (r = HV / HK) -> Qwen3.5's ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""
    r = num_v_heads // num_k_heads
    prefix = name[: -len("in_proj_qkvz.weight")] if name.endswith("in_proj_qkvz.weight") else name[
        : -len("in_proj_ba.weight")]
    hidden = tensor.shape[-1]
    if isinstance(tensor, Fp8Weight):  # the same regrouping of the rows, the scales cut with them (exactly)
        rows = torch.arange(tensor.shape[0], device=tensor.q.device)[:, None]
        return [(n, tensor.take_rows(index.reshape(-1))) for n, index in
                split_qwen3_next_projections(name, rows, num_k_heads, num_v_heads, head_k_dim, head_v_dim)]
    if name.endswith("in_proj_qkvz.weight"):
        grouped = tensor.view(num_k_heads, 2 * head_k_dim + 2 * r * head_v_dim, hidden)
        q, k, v, z = grouped.split([head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim], dim=1)
        qkv = torch.cat([t.reshape(-1, hidden) for t in (q, k, v)])
        return [(prefix + "in_proj_qkv.weight", qkv), (prefix + "in_proj_z.weight", z.reshape(-1, hidden))]
    grouped = tensor.view(num_k_heads, 2 * r, hidden)
    b, a = grouped.split([r, r], dim=1)
    return [(prefix + "in_proj_b.weight", b.reshape(-1, hidden)), (prefix + "in_proj_a.weight", a.reshape(-1, hidden))]


def split_grouped_projections(name: str, tensor: torch.Tensor,
                              arch: ModelArchConfig) -> list[tuple[str, torch.Tensor]] | None:
    """A Qwen3-Next ``in_proj_qkvz`` / ``in_proj_ba`` weight as Qwen3.5's four projections; None for any other
    tensor."""
    if not name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
        return None
    return split_qwen3_next_projections(name, tensor, arch.linear_num_key_heads, arch.linear_num_value_heads,
                                        arch.linear_key_head_dim, arch.linear_value_head_dim)
