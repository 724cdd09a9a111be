"""Pick the implementation of each per-layer op: Triton on CUDA, the torch reference elsewhere.

``use_triton(device)`` is the single switch: True for a CUDA device when triton imports and
``CONVEYOR_DISABLE_TRITON=1`` (``envs.DISABLE_TRITON``) is not set, read at each call so tests and debugging can
flip it. Both paths have the same semantics, including ``write_kv`` skipping padding slots (< 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

import envs
from kernels import triton_compat
from kernels.triton_activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.triton_embedding import embedding_ref, embedding_triton
from kernels.triton_kv_cache import write_kv_padded_ref, write_kv_triton
from kernels.triton_fp8_gemm import dequant_linear
from kernels.triton_fp8_gemv import fp8_gemv_norm_triton, fp8_gemv_ref, fp8_gemv_triton
from kernels.triton_gemv import SKINNY_MAX_M, NormedProjection, gemv_norm_triton, gemv_triton
from kernels.triton_norm import rms_norm_ref, rms_norm_triton
from kernels.triton_qkv_prologue import qkv_prologue_ref, qkv_prologue_triton
from kernels.triton_rope import apply_rotary_ref_, apply_rotary_triton_


_ROWS_AS_DECODE: ContextVar[bool] = ContextVar("rows_as_decode", default=False)
MAX_DECODE_ROW_TOKENS = SKINNY_MAX_M  # rows_as_decode: rows of up to this many tokens (a verify row, K <= 15)


@contextmanager
def rows_as_decode(enabled: bool = True) -> Iterator[None]:
    """Within it, a GPU step of decode-sized rows (a speculative verify row: up to 16 tokens of one sequence)
    computes every token as a one-token decode row computes it: each projection row alone (the GEMVs' row loop),
    the norm inside the projection as at one row, and each token's attention through the decode kernel with the
    decode partition. The tokens a verify row accepts then carry plain decoding's bits: its greedy output equals
    plain decoding's in bf16 too. Off, such rows take the multi-row kernels (faster, other sums)."""
    token = _ROWS_AS_DECODE.set(enabled)
    try:
        yield
    finally:
        _ROWS_AS_DECODE.reset(token)


def decode_rows_on() -> bool:
    """Whether ``rows_as_decode`` is on here."""
    return _ROWS_AS_DECODE.get()


def triton_available() -> bool:
    """Whether triton imported (CPU-only torch installs may lack it; the kernel modules then import without it)."""
    return triton_compat.triton is not None


def use_triton(device: torch.device | str) -> bool:
    """True when the ops on ``device`` should run the Triton kernels."""
    if torch.device(device).type != "cuda":
        return False
    if envs.DISABLE_TRITON.get():
        return False
    return triton_available()


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``; see ``kernels/triton_embedding.py``."""
    if use_triton(weight.device):
        return embedding_triton(ids, weight)
    return embedding_ref(ids, weight)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)`` or ``(norm(x + residual), x + residual)``; see ``kernels/triton_norm.py``."""
    if use_triton(x.device):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def apply_rotary_(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True
) -> None:
    """Rotate q and k in place; see ``kernels/triton_rope.py``."""
    if use_triton(q.device):
        apply_rotary_triton_(q, k, cos, sin, is_neox_style)
    else:
        apply_rotary_ref_(q, k, cos, sin, is_neox_style)


def skinny_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Decode-sized bf16/fp16 projections on the GPU, where the weight-streaming kernel (kernels/triton_gemv.py) is
    faster than cuBLAS at these sizes (``bench/gemv_tune.py`` times both). An FP8 weight
    (float8_e4m3fn, with its scales) takes the FP8 GEMV (kernels/triton_fp8_gemv.py) for any activation dtype."""
    if not (use_triton(x.device) and x.dim() == 2 and 1 <= x.shape[0] <= SKINNY_MAX_M and weight.is_contiguous()):
        return False
    if weight.dtype == torch.float8_e4m3fn:
        return x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    return x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None, tail: torch.Tensor | None = None) -> torch.Tensor:
    """``scale`` / ``block`` (and 16-bit ``tail`` rows): an FP8 weight's (kernels/fp8.py)."""
    if scale is not None:
        assert block is not None
        return fp8_gemv_triton(x, weight, scale, block, bias, tail=tail, row_loop=decode_rows_on(),
                               out_dtype=out_dtype)
    return gemv_triton(x, weight, bias, row_loop=decode_rows_on(), out_dtype=out_dtype)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None, write_normed: bool,
                scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                tail: torch.Tensor | None = None) -> NormedProjection:
    """The residual-add RMSNorm inside a skinny projection (where ``skinny_linear_applies``); ``scale`` / ``block``
    / ``tail`` as ``skinny_linear``'s."""
    if scale is not None:
        assert block is not None
        return fp8_gemv_norm_triton(x, residual, norm_weight, eps, weight, scale, block, bias, write_normed,
                                    tail=tail, row_loop=decode_rows_on())
    return gemv_norm_triton(x, residual, norm_weight, eps, weight, bias, write_normed, row_loop=decode_rows_on())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, tail: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ [dequantize(W); tail]^T (+ bias)`` for an FP8 weight W [NQ, K] with its scale grid and optional 16-bit
    ``tail`` rows: the FP8 GEMV at decode sizes and dequantize-then-cuBLAS (``dequant_linear``) above on the GPU, the
    torch reference (``fp8_gemv_ref``) elsewhere."""
    if skinny_linear_applies(x, weight):
        return skinny_linear(x, weight, bias, None, scale, block, tail)
    if not use_triton(x.device):
        return fp8_gemv_ref(x, weight, scale, block, bias, tail)
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, k)
    nq = weight.shape[0]
    n = nq + (0 if tail is None else tail.shape[0])
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    dequant_linear(x, weight, scale, block, None if bias is None else bias[:nq], out=y[:, :nq])
    if tail is not None:
        y[:, nq:] = F.linear(x, tail, None if bias is None else bias[nq:])
    return y.reshape(*lead, n)


def qkv_prologue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                 k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool,
                 kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """q/k norm, rope and the KV write in one launch; see ``kernels/triton_qkv_prologue.py``. ``rows``: each
    token's row of cos/sin, tables then (None: cos/sin hold a row a token). ``k_scale`` / ``v_scale``: an fp8
    cache's, the layer's."""
    if use_triton(q.device):
        qkv_prologue_triton(q, k, v, q_norm, k_norm, eps, cos, sin, is_neox_style, kv_cache_layer, slot_mapping,
                            rows, k_scale, v_scale)
    else:
        if rows is not None:
            cos, sin = cos.index_select(0, rows), sin.index_select(0, rows)
        qkv_prologue_ref(q, k, v, q_norm, k_norm, eps, cos, sin, is_neox_style, kv_cache_layer, slot_mapping,
                         k_scale, v_scale)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[..., 2*I]`` projection; see ``kernels/triton_activation.py``."""
    if use_triton(gate_up.device):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write K/V at their slots, skipping slots < 0 (an fp8 cache: quantized with the layer's scales); see
    ``kernels/triton_kv_cache.py``."""
    if use_triton(kv_cache_layer.device):
        write_kv_triton(key, value, kv_cache_layer, slot_mapping, k_scale, v_scale)
    else:
        write_kv_padded_ref(key, value, kv_cache_layer, slot_mapping, k_scale, v_scale)
