"""Building blocks every layer is made of: the projections (oneDNN on CPU, the skinny kernels on the GPU, FP8
storage), RMSNorm (optionally fused with the residual add), the token embedding, and the SiLU-and-mul MLP with a
fused gate/up projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch
from kernels.triton_norm import rms_norm_ref
from pipeline.models import fp8_storage

if TYPE_CHECKING:
    from pipeline.models.config import ModelArchConfig


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


def norm_project(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, proj: MergedLinear,
                 keep_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(proj(norm(x + residual)), x + residual, the normed rows or None)``; without a residual (the first
    layer) x is the residual. One decode row on the GPU runs the norm inside the projection's GEMV
    (``gemv_norm_triton``): a norm kernel fewer a layer, where a batch-1 step is a chain of small kernels. Above
    one row the norm stays a kernel of its own, which does as well (``bench/gemv_norm_tune.py`` times both). Under
    ``dispatch.rows_as_decode`` every row of a skinny batch takes the one-row path (each row alone)."""
    if ((x.shape[0] == 1 or dispatch.decode_rows_on()) and proj.packed is None
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


# the HF projections GatedMLP loads as shards of its fused one: HF name piece -> (fused piece, shard index)
GATED_MLP_FUSED_NAMES = {
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


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

    @classmethod
    def from_arch(cls, arch: ModelArchConfig, dtype=None, device=None) -> GatedMLP:
        """A layer's dense MLP of ``intermediate_size``."""
        return cls(arch.hidden_size, arch.intermediate_size, arch.mlp_bias, arch.hidden_act, dtype, device)

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
