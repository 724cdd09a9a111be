"""Building blocks of the dense decoder: RMSNorm (optionally fused with the residual add), the SiLU-and-mul MLP
with a fused gate/up projection, and paged attention with a fused qkv projection."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch
from kernels.kv_cache import write_kv_ref
from kernels.paged_attention import paged_attention_ref
from kernels.triton_norm import rms_norm_ref
from kernels.triton_paged_attention import paged_attention_triton
from pipeline.models import fp8_storage
from pipeline.models.forward_context import ForwardContext
from pipeline.models.rope import apply_rotary_emb_


def _probe_onednn_linear():
    """oneDNN's linear (the op inductor uses on CPU): about 2x faster than F.linear's MKL path for fp32 on CPU
    (same results up to summation order). None where unavailable."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return None
        x, w, b = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)
        if not torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5):
            return None
        return op
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _probe_onednn_linear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
           tail: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, routed to oneDNN for contiguous 2-D float32 inputs on CPU (inference only: no autograd),
    and to the skinny Triton kernel for decode-sized batches on the GPU. With ``scale`` (and ``block``), ``weight``
    is FP8 (kernels/fp8.py; ``tail``: 16-bit rows after it) and the FP8 kernels run (``dispatch.fp8_linear``)."""
    if scale is not None:
        assert block is not None
        return dispatch.fp8_linear(x, weight, scale, block, bias, tail)
    if dispatch.skinny_linear_applies(x, weight):
        return dispatch.skinny_linear(x, weight, bias)
    if (
        _ONEDNN_LINEAR is not None
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.is_contiguous()
        and not (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def logits_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 logits ``x @ W.T``, each rounded to x's dtype as any projection's output is; the skinny kernel
    stores them as float32 itself, where a cast would be one more kernel a decode step."""
    if dispatch.skinny_linear_applies(x, weight):
        return dispatch.skinny_linear(x, weight, None, out_dtype=torch.float32)
    return linear(x, weight).float()


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN prepacking applies to float32 and (on CPUs with native bf16) bfloat16 CPU weights."""
    if _ONEDNN_LINEAR is None or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN-blocked copy of a [out, in] weight, only usable through `packed_linear`.

    Decode reads every weight once per step, so layout is speed: prepacked weights measured 1.15x
    (fp32) and 1.9x (bf16) faster than the plain path over 30 cold layers on this CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _ONEDNN_LINEAR(x if x.is_contiguous() else x.contiguous(), packed, bias, "none", [], "")


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed x; ``forward(x, residual)`` -> (norm(x + residual), x + residual).

    ``zero_centered`` (Qwen3-Next / Qwen3.5): the checkpoint holds w and the scale is (1 + w), computed in
    fp32 as transformers does. The weight is then an fp32 parameter that holds 1 + w once ``absorb_offset``
    ran after loading (random dummy weights start at 1, i.e. w = 0)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=None, device=None,
                 zero_centered: bool = False) -> None:
        super().__init__()
        self.zero_centered = zero_centered
        weight_dtype = torch.float32 if zero_centered else dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=weight_dtype, device=device))
        self.eps = eps
        self.normalized_shape = (hidden_size,)

    @torch.no_grad()
    def absorb_offset(self) -> None:
        """A loaded zero-centred weight w becomes the scale 1 + w (call once, after loading)."""
        if self.zero_centered:
            self.weight.add_(1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if dispatch.use_triton(x.device):  # one fused kernel (residual add included) on the GPU
            return dispatch.rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}"


class MergedLinear(nn.Module):
    """One ``[sum(out_sizes), in]`` weight that stands for several HF projections (loaded shard by shard).

    On the GPU an FP8 checkpoint's projection stays FP8 (pipeline/models/fp8_storage.py): ``weight`` is then
    float8_e4m3fn ``[NQ, in]`` for the first shards, ``weight_scale`` its float32 scale grid in blocks of
    ``scale_block``, and ``tail`` the rows of the later shards a checkpoint keeps in 16 bits (or None)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype=None, device=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        total = sum(out_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(total, dtype=dtype, device=device)) if bias else None
        self.packed: torch.Tensor | None = None  # set by prepack(); then `weight` is gone
        self.register_buffer("weight_scale", None)  # FP8 storage only (class docstring)
        self.register_buffer("tail", None)
        self.scale_block: tuple[int, int] | None = None
        self.compute_dtype = self.weight.dtype  # the 16-bit weight's dtype (kept when it is FP8)

    def shard_range(self, shard: int) -> tuple[int, int]:
        start = sum(self.out_sizes[:shard])
        return start, start + self.out_sizes[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias, self.weight_scale, self.scale_block, self.tail)

    @torch.no_grad()
    def load_weight(self, shard: int | None, name: str, tensor: torch.Tensor) -> None:
        """Fill shard ``shard`` (None: the whole weight) from the HF tensor ``name``: a 16-bit tensor or an
        ``Fp8Weight`` (kernels/fp8.py), which FP8 storage keeps as it is and a 16-bit weight dequantizes.
        Raises ValueError on a shape mismatch."""
        fp8_storage.load_linear_shard(self, shard, name, tensor)

    @torch.no_grad()
    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the output rows ``rows``, in that order (the caller sets ``out_sizes``)."""
        fp8_storage.keep_rows(self, rows)

    @torch.no_grad()
    def keep_columns(self, start: int, end: int) -> None:
        """Keep the input columns [start, end)."""
        fp8_storage.keep_columns(self, start, end)
        self.in_features = end - start

    def prepack(self) -> None:
        """Swap the weight for its oneDNN-packed copy (after loading; frees the plain weight)."""
        if self.packed is None and can_prepack(self.weight):
            self.packed = prepack_weight(self.weight)
            self._parameters["weight"] = None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_sizes}, bias={self.bias is not None}"


NORM_IN_PROJECTION = os.environ.get("CONVEYOR_NORM_IN_PROJECTION", "1") != "0"


def norm_project(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, proj: MergedLinear,
                 keep_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(proj(norm(x + residual)), x + residual, the normed rows or None)``; without a residual (the first
    layer) x is the residual. One decode row on the GPU runs the norm inside the projection's GEMV
    (``gemv_norm_triton``): a norm kernel fewer a layer, 1-3 us each at batch 1 on an H200
    (bench/results/gemv-norm-tune-h200.json). Above one row the separate norm did as well or better there.
    ``CONVEYOR_NORM_IN_PROJECTION=0`` (read at import) keeps the norm separate, for A/B runs. Under
    ``dispatch.rows_as_decode`` every row of a skinny batch takes the one-row path (each row alone)."""
    if (NORM_IN_PROJECTION and (x.shape[0] == 1 or dispatch.decode_rows_on()) and proj.packed is None
            and dispatch.skinny_linear_applies(x, proj.weight)):
        out = dispatch.norm_linear(x, residual, norm.weight, norm.eps, proj.weight, proj.bias, keep_normed,
                                   scale=proj.weight_scale, block=proj.scale_block, tail=proj.tail)
        return out.y, out.residual, out.normed
    if residual is None:
        residual, normed = x, norm(x)
    else:
        normed, residual = norm(x, residual)
    return proj(normed), residual, normed if keep_normed else None


class Embedding(nn.Module):
    """Token embedding with an uninitialized weight (weights are always loaded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dispatch.embedding(ids, self.weight)


def Linear(in_features: int, out_features: int, bias: bool = False, dtype=None, device=None) -> MergedLinear:
    """A plain projection: a MergedLinear of one shard (no init cost; weights are always loaded)."""
    return MergedLinear(in_features, [out_features], bias, dtype, device)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one projection."""

    reuses_input = False  # forward_projected needs only the projection, not x (SparseMoeBlock's does)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu",
                 dtype=None, device=None) -> None:
        super().__init__()
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} is not supported (only silu)")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)

    @property
    def input_proj(self) -> MergedLinear:
        return self.gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_projected(self.gate_up_proj(x), x)

    def forward_projected(self, gate_up: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of ``forward`` after the input projection (``x`` unused: the signature of every block's)."""
        if dispatch.use_triton(gate_up.device):
            return self.down_proj(dispatch.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class PagedAttention(nn.Module):
    """Fused qkv projection (+bias), optional per-head q/k RMSNorm, rope, KV write, paged attention, o_proj.

    ``cache_index`` is this layer's place among the model's attention layers: which of ``ctx.caches`` is
    its paged K/V cache (the model's ``cache_specs()`` declares them in that order)."""

    def __init__(
        self,
        cache_index: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        is_neox_style: bool = True,
        output_gate: bool = False,
        zero_centered_qk_norm: bool = False,
        dtype=None,
        device=None,
    ) -> None:
        super().__init__()
        self.cache_index = cache_index
        self.output_gate = output_gate
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.is_neox_style = is_neox_style
        # with an output gate (Qwen3-Next / Qwen3.5), a fourth shard holds the gate: o_proj(attn * sigmoid(gate))
        shards = [self.q_size, self.kv_size, self.kv_size] + ([self.q_size] if output_gate else [])
        self.qkv_proj = MergedLinear(hidden_size, shards, qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, dtype, device)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, dtype, device, zero_centered_qk_norm)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, dtype, device, zero_centered_qk_norm)
        else:
            self.q_norm = self.k_norm = None
        # an fp8 KV cache holds K / k_scale and V / v_scale (the checkpoint's k_scale / v_scale, else 1)
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def input_proj(self) -> MergedLinear:
        return self.qkv_proj

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Reads the step's rope (cos/sin [T, 1, rotary_dim]) and attention plan
        from ``ctx``, which the model filled once for all layers, and writes this step's K/V into its cache."""
        return self.forward_projected(self.qkv_proj(x), ctx)

    def forward_projected(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``forward`` from the fused qkv projection on."""
        kv_cache = ctx.kv_cache(self.cache_index)  # [2, NB, BS, KVH, D]
        meta, plan = ctx.attention, ctx.attention_plan
        rope = ctx.rope
        T = qkv.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        qk_end = self.q_size + self.kv_size
        v_end = qk_end + self.kv_size
        gpu = dispatch.use_triton(qkv.device)
        if gpu:  # norms, rope and the KV write in one kernel
            q = qkv[:, : self.q_size].view(T, H, D)
            k = qkv[:, self.q_size : qk_end].view(T, KVH, D)
            v = qkv[:, qk_end:v_end].view(T, KVH, D)
            norms = (None, None, 0.0) if self.q_norm is None else (
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            dispatch.qkv_prologue(q, k, v, *norms, rope.cos_table, rope.sin_table, self.is_neox_style, kv_cache,
                                  meta.slot_mapping, rows=rope.positions, k_scale=self.k_scale, v_scale=self.v_scale)
            gate = qkv[:, v_end:].view(T, H, D) if self.output_gate else None
            out = paged_attention_triton(q, kv_cache, meta, self.scale, plan, gate, self.k_scale, self.v_scale)
            return self.o_proj(out.reshape(T, self.q_size))
        rotate = _rotate_ref
        cos, sin = rope.gathered()
        if self.q_norm is None:
            # q and k are adjacent: one in-place rotation covers both.
            qk = qkv[:, :qk_end].view(T, H + KVH, D)
            rotate(qk, None, cos, sin, self.is_neox_style)
            q, k = qk[:, :H], qk[:, H:]
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(T, H, D))
            k = self.k_norm(qkv[:, self.q_size : qk_end].view(T, KVH, D))
            rotate(q, k, cos, sin, self.is_neox_style)
        v = qkv[:, qk_end:v_end].view(T, KVH, D)
        write_kv_ref(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = paged_attention_ref(q, kv_cache, meta, self.scale, plan, self.k_scale, self.v_scale)
        return self.o_proj(self._gated(out.reshape(T, self.q_size), qkv, v_end))

    def _gated(self, out: torch.Tensor, qkv: torch.Tensor, v_end: int) -> torch.Tensor:
        """attn * sigmoid(gate) in the activation dtype (as transformers multiplies), when the layer has a gate."""
        if not self.output_gate:
            return out
        return out * torch.sigmoid(qkv[:, v_end:])


def _rotate_ref(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                is_neox_style: bool) -> None:
    apply_rotary_emb_(q, cos, sin, is_neox_style)
    if k is not None:
        apply_rotary_emb_(k, cos, sin, is_neox_style)
