"""The Gated DeltaNet Triton kernels (``kernels/triton_gdn.py``, ``kernels/triton_gdn_chunked.py``) against the torch
references in ``kernels/gdn.py``.

On CPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on small shapes: varlen
batches mixing single tokens with sequences that cross 64-token chunk boundaries, slots out of order with gaps
(slots outside the batch must stay untouched), GQA and HV == HK, fp32 and bf16. The interpreter computes in exact
fp32 (its bf16 casts truncate: one ulp). On a GPU the same tests run for real, plus the ``gpu``-marked ones:
realistic Qwen3.5 shapes and CUDA-graph capture of the decode kernels. There the chunked kernel's dots are tf32
for bf16 inputs, hence the bf16 tolerances on the fp32 states.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kernels.gdn import (causal_conv1d_varlen_ref, gated_delta_rule_varlen_ref, gdn_gates,
                         rms_norm_gated_ref)
from kernels.triton_compat import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")
pytestmark = [needs_triton, pytest.mark.usefixtures("single_torch_thread")]

MIXED = [1, 3, 17, 70, 130]  # a decode row, short, inside one chunk, two chunks, three (partial last chunk)


def tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def state_tol(dtype: torch.dtype) -> dict[str, float]:
    """fp32 states; from bf16 inputs the GPU chunked kernel multiplies in tf32."""
    return dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


def batch(lens: list[int], num_slots: int, seed: int, init: list[bool] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(state_slots: distinct, shuffled, never the null slot 0; query_start_loc int32; has_initial_state)."""
    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(num_slots - 1, generator=gen)[:len(lens)] + 1).to(torch.int32)
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    if init is None:
        init = [i % 3 != 1 for i in range(len(lens))]
    return slots.to(DEVICE), qsl.to(DEVICE), torch.tensor(init, dtype=torch.bool, device=DEVICE)


def gdn_inputs(T: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int, num_slots: int,
               fused: bool = False) -> dict[str, torch.Tensor]:
    """q, k, v (views into one [T, 2*hk*dk + hv*dv] row like the conv output when ``fused``), gates from
    ``gdn_gates`` (log decays from ~0 to ~-1), random fp32 states."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(T, 2 * hk * dk + hv * dv, generator=gen).to(dtype=dtype, device=DEVICE)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=1)
    q, k, v = q.unflatten(1, (hk, dk)), k.unflatten(1, (hk, dk)), v.unflatten(1, (hv, dv))
    if not fused:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    a, b = (torch.randn(T, hv, generator=gen).to(dtype=dtype, device=DEVICE) for _ in range(2))
    A_log = torch.linspace(-4, 0.5, hv, device=DEVICE)
    g, beta = gdn_gates(a, b, A_log, torch.zeros(hv, device=DEVICE))
    states = (torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.5).to(DEVICE)
    return dict(q=q, k=k, v=v, g=g, beta=beta, ssm_states=states)


def run(fn, inputs: dict[str, torch.Tensor], slots, qsl, init, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, states after) on a copy of the states."""
    states = inputs["ssm_states"].clone()
    o = fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], states, slots, qsl, init, **kwargs)
    return o, states


def untouched(states: torch.Tensor, before: torch.Tensor, slots: torch.Tensor) -> None:
    others = torch.ones(states.shape[0], dtype=torch.bool, device=states.device)
    others[slots.long()] = False
    assert torch.equal(states[others], before[others]), "slots outside the batch changed"


def gdn_fns():
    from kernels.triton_gdn import gated_delta_rule_chunked_triton, gated_delta_rule_recurrent_triton

    return {"recurrent": gated_delta_rule_recurrent_triton, "chunked": gated_delta_rule_chunked_triton}


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
@pytest.mark.parametrize("hk,hv", [(1, 2), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_varlen_matches_reference(kernel, dtype, hk, hv):
    """Mixed lengths, GQA and HV == HK, q/k/v as strided views of one fused row."""
    slots, qsl, init = batch(MIXED, 9, seed=1)
    inputs = gdn_inputs(sum(MIXED), hk, hv, 32, 32, dtype, seed=2, num_slots=9, fused=True)
    kwargs = {"query_start_loc_host": qsl.tolist()} if kernel == "chunked" else {}
    o, states = run(gdn_fns()[kernel], inputs, slots, qsl, init, **kwargs)
    ref_o, ref_states = run(gated_delta_rule_varlen_ref, inputs, slots, qsl, init)
    assert o.dtype == dtype and o.shape == ref_o.shape
    torch.testing.assert_close(o, ref_o, **tol(dtype))
    torch.testing.assert_close(states, ref_states, **state_tol(dtype))
    untouched(states, inputs["ssm_states"], slots)


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_gdn_odd_dims_empty_sequence_no_l2norm(kernel):
    """Dk, Dv not powers of two (masked), Dv over two V-blocks, an empty sequence (its slot untouched, as the
    reference), a chunk of exactly 64, and use_qk_l2norm=False on small keys."""
    lens = [64, 0, 2, 66]
    slots, qsl, init = batch(lens, 6, seed=3, init=[True, True, False, True])
    inputs = gdn_inputs(sum(lens), 1, 1, 24, 40, torch.float32, seed=4, num_slots=6)
    inputs["q"], inputs["k"] = inputs["q"] * 0.1, inputs["k"] * 0.1
    for l2 in (True, False):
        o, states = run(gdn_fns()[kernel], inputs, slots, qsl, init, use_qk_l2norm=l2)
        ref_o, ref_states = run(gated_delta_rule_varlen_ref, inputs, slots, qsl, init, use_qk_l2norm=l2)
        torch.testing.assert_close(o, ref_o, **tol(torch.float32))
        torch.testing.assert_close(states, ref_states, **tol(torch.float32))
        assert torch.equal(states[slots[1].long()], inputs["ssm_states"][slots[1].long()])


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_decode_batch_equals_each_sequence_alone(n):
    """Decode (one token a sequence): conv + recurrent on the batch equal, bit for bit, the same kernels on each
    sequence alone, and match the references; the chunked entry point given the host query_start_loc takes the
    recurrent kernel."""
    from kernels.triton_gdn import gated_delta_rule_chunked_triton
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    recurrent = gdn_fns()["recurrent"]
    slots, qsl, init = batch([1] * n, 12, seed=10 + n)
    hk, hv, dk, dv, C, K = 1, 2, 32, 32, 24, 4
    inputs = gdn_inputs(n, hk, hv, dk, dv, torch.bfloat16, seed=20 + n, num_slots=12)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, C, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(C, K, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    conv_states = torch.randn(12, C, K - 1, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)

    conv_after = conv_states.clone()
    y = causal_conv1d_varlen_triton(x, weight, None, conv_after, slots, qsl, init, max_query_len=1)
    o, states = run(recurrent, inputs, slots, qsl, init)
    ref_conv = conv_states.clone()
    torch.testing.assert_close(y, causal_conv1d_varlen_ref(x, weight, None, ref_conv, slots, qsl, init), **tol(y.dtype))
    assert torch.equal(conv_after, ref_conv)
    ref_o, ref_states = run(gated_delta_rule_varlen_ref, inputs, slots, qsl, init)
    torch.testing.assert_close(o, ref_o, **tol(o.dtype))
    torch.testing.assert_close(states, ref_states, **state_tol(o.dtype))
    o_host, states_host = run(gated_delta_rule_chunked_triton, inputs, slots, qsl, init,
                              query_start_loc_host=list(range(n + 1)))
    assert torch.equal(o_host, o) and torch.equal(states_host, states)

    one = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    for b in range(n):
        alone = {name: (t if name == "ssm_states" else t[b:b + 1]) for name, t in inputs.items()}
        o_b, states_b = run(recurrent, alone, slots[b:b + 1], one, init[b:b + 1])
        assert torch.equal(o_b, o[b:b + 1])
        assert torch.equal(states_b[slots[b].long()], states[slots[b].long()])
        conv_b = conv_states.clone()
        y_b = causal_conv1d_varlen_triton(x[b:b + 1], weight, None, conv_b, slots[b:b + 1], one, init[b:b + 1],
                                          max_query_len=1)
        assert torch.equal(y_b, y[b:b + 1])
        assert torch.equal(conv_b[slots[b].long()], conv_after[slots[b].long()])
    untouched(states, inputs["ssm_states"], slots)
    untouched(conv_after, conv_states, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_computes_the_gates_from_raw_projections(dtype):
    """``raw_gates``: a and b as column views of a wider projection row (as the layer passes them), including
    softplus inputs past its threshold of 20 and far below 0; equals the kernel fed ``gdn_gates``' g and beta."""
    from kernels.triton_gdn import gated_delta_rule_recurrent_triton

    lens = [1, 3, 1, 2]
    slots, qsl, init = batch(lens, 8, seed=50)
    hk, hv, dk, dv = 1, 4, 16, 16
    inputs = gdn_inputs(sum(lens), hk, hv, dk, dv, dtype, seed=51, num_slots=8)
    gen = torch.Generator().manual_seed(52)
    proj = (torch.randn(sum(lens), 3 + 2 * hv, generator=gen) * 8).to(device=DEVICE, dtype=dtype)
    proj[0, 3 + hv:] = torch.tensor([25.0, -30.0, 19.9, 20.1])
    b_raw, a_raw = proj[:, 3:3 + hv], proj[:, 3 + hv:]
    A_log = torch.linspace(-2, 1, hv, device=DEVICE)
    dt_bias = torch.linspace(-1, 1, hv, device=DEVICE)
    g, beta = gdn_gates(a_raw, b_raw, A_log, dt_bias)
    fed = run(gated_delta_rule_recurrent_triton, {**inputs, "g": g, "beta": beta}, slots, qsl, init)
    raw = run(gated_delta_rule_recurrent_triton, {**inputs, "g": a_raw, "beta": b_raw}, slots, qsl, init,
              raw_gates=(A_log, dt_bias))
    exact = dict(atol=1e-6, rtol=1e-6)  # bf16: beta is rounded to bf16 in the kernel (the interpreter truncates)
    torch.testing.assert_close(raw[0], fed[0], **(exact if dtype == torch.float32 else tol(dtype)))
    torch.testing.assert_close(raw[1], fed[1], **(exact if dtype == torch.float32 else state_tol(dtype)))
    with pytest.raises(ValueError):
        run(gated_delta_rule_recurrent_triton, inputs, slots, qsl, init, raw_gates=(A_log[:2], dt_bias))


def test_dispatch_takes_raw_gates():
    """``kernels.gdn.gated_delta_rule`` (the layer's entry point) on raw a / b equals the reference on
    ``gdn_gates``' output, for decode rows and for prompt chunks."""
    from kernels import gdn

    for lens in ([1, 1, 1], [5, 70, 1]):
        slots, qsl, init = batch(lens, 8, seed=60)
        inputs = gdn_inputs(sum(lens), 1, 2, 16, 16, torch.float32, seed=61, num_slots=8)
        gen = torch.Generator().manual_seed(62)
        a_raw, b_raw = (torch.randn(sum(lens), 2, generator=gen).to(DEVICE) for _ in range(2))
        A_log, dt_bias = torch.tensor([-1.0, 0.5], device=DEVICE), torch.tensor([0.3, -0.2], device=DEVICE)
        g, beta = gdn_gates(a_raw, b_raw, A_log, dt_bias)
        want = run(gated_delta_rule_varlen_ref, {**inputs, "g": g, "beta": beta}, slots, qsl, init)
        states = inputs["ssm_states"].clone()
        o = gdn.gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], a_raw, b_raw, A_log, dt_bias, states, slots,
                                 qsl, init, max(lens), qsl.tolist())
        torch.testing.assert_close(o, want[0], **tol(torch.float32))
        torch.testing.assert_close(states, want[1], **state_tol(torch.float32))


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("D", [128, 48])
def test_rms_norm_gated(D, dtype, w_dtype):
    from kernels.triton_gdn import rms_norm_gated_triton

    gen = torch.Generator().manual_seed(D)
    x, z = (torch.randn(37, D, generator=gen).to(device=DEVICE, dtype=dtype) for _ in range(2))
    weight = (torch.rand(D, generator=gen) + 0.5).to(device=DEVICE, dtype=w_dtype)
    y = rms_norm_gated_triton(x, z, weight, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    ref = rms_norm_gated_ref(x, z, weight, 1e-6)
    torch.testing.assert_close(y, ref, **tol(dtype))
    x3, z3 = x.view(37, 1, D), z.view(37, 1, D)
    torch.testing.assert_close(rms_norm_gated_triton(x3, z3, weight, 1e-5), rms_norm_gated_ref(x3, z3, weight, 1e-5),
                               **tol(dtype))


def test_rejects_bad_inputs():
    from kernels.triton_gdn import gated_delta_rule_recurrent_triton

    slots, qsl, init = batch([2], 3, seed=0)
    inputs = gdn_inputs(2, 2, 3, 16, 16, torch.float32, seed=0, num_slots=3)  # 3 value heads over 2 key heads
    with pytest.raises(ValueError):
        run(gated_delta_rule_recurrent_triton, inputs, slots, qsl, init)
    inputs = gdn_inputs(2, 1, 1, 16, 16, torch.float32, seed=0, num_slots=3)
    with pytest.raises(ValueError):
        run(gated_delta_rule_recurrent_triton, inputs, slots, qsl[:1], init)


# ---- GPU only: realistic shapes and CUDA graphs ----

REAL = dict(hk=16, hv=32, dk=128, dv=128)  # Qwen3.5-35B-A3B


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_gpu_realistic_shapes(kernel):
    lens = [1, 600, 37, 1, 128, 257]
    slots, qsl, init = batch(lens, 16, seed=30, init=[True, False, True, False, True, True])
    inputs = gdn_inputs(sum(lens), **REAL, dtype=torch.bfloat16, seed=31, num_slots=16, fused=True)
    o, states = run(gdn_fns()[kernel], inputs, slots, qsl, init)
    ref_o, ref_states = run(gated_delta_rule_varlen_ref, inputs, slots, qsl, init)
    torch.testing.assert_close(o, ref_o, **tol(torch.bfloat16))
    torch.testing.assert_close(states, ref_states, **state_tol(torch.bfloat16))
    untouched(states, inputs["ssm_states"], slots)


@pytest.mark.gpu
def test_gpu_realistic_gated_norm():
    from kernels.triton_gdn import rms_norm_gated_triton

    gen = torch.Generator().manual_seed(33)
    x, z = (torch.randn(900 * 32, 128, generator=gen).to(device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    weight = (torch.rand(128, generator=gen) + 0.5).to(device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm_gated_triton(x, z, weight, 1e-6), rms_norm_gated_ref(x, z, weight, 1e-6),
                               **tol(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_decode_cuda_graph():
    """Conv + recurrent decode captured in a CUDA graph: replay on new inputs equals eager on the same inputs."""
    from kernels.triton_gdn import gated_delta_rule_recurrent_triton
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    n, C, K = 8, 2 * 16 * 128 + 32 * 128, 4
    slots, qsl, init = batch([1] * n, 16, seed=40)
    gen = torch.Generator().manual_seed(41)

    def fresh(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs = gdn_inputs(n, **REAL, dtype=torch.bfloat16, seed=seed, num_slots=16)
        return torch.randn(n, C, generator=gen).to(device=DEVICE, dtype=torch.bfloat16), inputs

    weight = torch.randn(C, K, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    conv0 = torch.randn(16, C, K - 1, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    x, inputs = fresh(42)
    conv_states, ssm_states = conv0.clone(), inputs["ssm_states"].clone()

    def step():
        y = causal_conv1d_varlen_triton(x, weight, None, conv_states, slots, qsl, init, max_query_len=1)
        o = gated_delta_rule_recurrent_triton(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                              ssm_states, slots, qsl, init)
        return y, o

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph, o_graph = step()
    new_x, new_inputs = fresh(43)
    x.copy_(new_x)
    for name in ("q", "k", "v", "g", "beta"):
        inputs[name].copy_(new_inputs[name])
    conv_states.copy_(conv0)
    ssm_states.copy_(new_inputs["ssm_states"])
    graph.replay()
    torch.cuda.synchronize()
    y_replay, o_replay = y_graph.clone(), o_graph.clone()
    conv_replay, ssm_replay = conv_states.clone(), ssm_states.clone()
    conv_states.copy_(conv0)
    ssm_states.copy_(new_inputs["ssm_states"])
    y_eager, o_eager = step()
    assert torch.equal(y_replay, y_eager) and torch.equal(o_replay, o_eager)
    assert torch.equal(conv_replay, conv_states) and torch.equal(ssm_replay, ssm_states)
    ref_o, _ = run(gated_delta_rule_varlen_ref, {**new_inputs}, slots, qsl, init)
    torch.testing.assert_close(o_replay, ref_o, **tol(torch.bfloat16))
