"""The Gated DeltaNet Triton kernels (``kernels/triton_gdn.py``, ``kernels/triton_gdn_chunked.py``) against the torch
references in ``kernels/gdn.py``.

On CPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on small shapes: varlen
batches mixing single tokens with sequences that cross 64-token chunk boundaries, slots out of order with gaps
(slots outside the batch must stay untouched), GQA and HV == HK, fp32 and bf16. The kernels take the raw gate
inputs (a, b as column views of a projection row, A_log, dt_bias) and compute the gates themselves; the references
go through ``gdn_gates``. The interpreter computes in exact fp32 (its bf16 casts truncate: one ulp, beta too). On
a GPU the same tests run for real, plus the ``gpu``-marked ones: realistic Qwen3.5 shapes and CUDA-graph capture
of the decode kernels. There the chunked kernel's dots are tf32 for bf16 inputs, hence the bf16 tolerances on the
fp32 states.
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


PER_TOKEN = ("q", "k", "v", "a", "b")  # the inputs with a token dim (A_log, dt_bias are per head)


def gdn_inputs(T: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int, num_slots: int,
               fused: bool = False) -> dict[str, torch.Tensor]:
    """q, k, v, and the raw gate inputs a, b (when ``fused``, views into one [T, 2*hk*dk + hv*dv] row like the conv
    output, and into a [T, 8 + 2*hv] row like the projection's [.. | b | a] tail), A_log, dt_bias (log decays from
    ~0 to ~-1), random fp32 states."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(T, 2 * hk * dk + hv * dv, generator=gen).to(dtype=dtype, device=DEVICE)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=1)
    q, k, v = q.unflatten(1, (hk, dk)), k.unflatten(1, (hk, dk)), v.unflatten(1, (hv, dv))
    proj = torch.randn(T, 8 + 2 * hv, generator=gen).to(dtype=dtype, device=DEVICE)
    b, a = proj[:, 8:8 + hv], proj[:, 8 + hv:]
    if not fused:
        q, k, v, a, b = (t.contiguous() for t in (q, k, v, a, b))
    A_log = torch.linspace(-4, 0.5, hv, device=DEVICE)
    dt_bias = torch.linspace(-0.3, 0.3, hv, device=DEVICE)
    states = (torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.5).to(DEVICE)
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_states=states)


def run(fn, inputs: dict[str, torch.Tensor], slots, qsl, init, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, states after) on a copy of the states."""
    states = inputs["ssm_states"].clone()
    o = fn(*(inputs[name] for name in (*PER_TOKEN, "A_log", "dt_bias")), states, slots, qsl, init, **kwargs)
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
    """Mixed lengths, GQA and HV == HK, q/k/v and a/b as strided views of fused rows."""
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


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("dv", [32, 40])
def test_recurrent_with_gated_norm_equals_kernel_then_norm(dtype, w_dtype, dv):
    """The gated RMSNorm applied in the recurrent kernel (decode rows, a 3-token row, a fresh row, an empty row;
    z a strided view of a projection row) equals the delta rule then ``rms_norm_gated_ref``; states as without it."""
    from kernels.triton_gdn import gated_delta_rule_recurrent_triton

    lens = [1, 3, 1, 0, 1]
    slots, qsl, init = batch(lens, 8, seed=7)
    T, hv = sum(lens), 4
    inputs = gdn_inputs(T, 2, hv, 32, dv, dtype, seed=8, num_slots=8, fused=True)
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(T, hv * dv + 6, generator=gen).to(device=DEVICE, dtype=dtype)[:, 6:].unflatten(1, (hv, dv))
    weight = (torch.rand(dv, generator=gen) + 0.5).to(device=DEVICE, dtype=w_dtype)
    o, states = run(gated_delta_rule_recurrent_triton, inputs, slots, qsl, init, gated_norm=(z, weight, 1e-6))
    plain, plain_states = run(gated_delta_rule_recurrent_triton, inputs, slots, qsl, init)
    ref_o, _ = run(gated_delta_rule_varlen_ref, inputs, slots[[0, 1, 2, 4]],
                   torch.tensor([0, 1, 4, 5, 6], dtype=torch.int32, device=DEVICE), init[[0, 1, 2, 4]])
    torch.testing.assert_close(states, plain_states, atol=1e-6, rtol=1e-6)
    expected = rms_norm_gated_ref(ref_o.reshape(T * hv, dv), z.reshape(T * hv, dv), weight, 1e-6).view(T, hv, dv)
    torch.testing.assert_close(o, expected, **tol(dtype))
    normed_plain = rms_norm_gated_ref(plain.reshape(T * hv, dv), z.reshape(T * hv, dv), weight, 1e-6)
    torch.testing.assert_close(o, normed_plain.view(T, hv, dv), **tol(dtype))
    with pytest.raises(ValueError, match="gated norm"):
        run(gated_delta_rule_recurrent_triton, inputs, slots, qsl, init, gated_norm=(z, weight[:-1], 1e-6))


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
        alone = {name: (t[b:b + 1] if name in PER_TOKEN else t) for name, t in inputs.items()}
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


def extreme_gate_inputs(T: int, hv: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """a, b as column views of a wider projection row (as the layer passes them), with softplus inputs
    a + dt_bias past its threshold of 20, just around it, and far below 0; b saturating sigmoid both ways."""
    gen = torch.Generator().manual_seed(seed)
    proj = (torch.randn(T, 5 + 2 * hv, generator=gen) * 8).to(dtype)
    proj[:8, 5 + hv] = torch.tensor([25.0, -30.0, 19.9, 20.1, 100.0, -100.0, 20.0, -8.0])  # head 0: dt_bias 0
    proj[-4:, 6] = torch.tensor([30.0, -30.0, 0.0, -3.0])  # b of head 1
    proj = proj.to(DEVICE)
    return dict(b=proj[:, 5:5 + hv], a=proj[:, 5 + hv:], A_log=torch.linspace(-2, 1, hv, device=DEVICE),
                dt_bias=torch.linspace(0, 1, hv, device=DEVICE))


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_in_kernel_gates_equal_gdn_gates(kernel, dtype):
    """Probes that expose the gates each kernel computes from a, b in ``dtype``, on single tokens (the chunked
    entry point without the host copy runs its chunk kernels on them), q/k/v in fp32 so that nothing else rounds:

    * q = k = 0: the state becomes exp(g) * S0, so an all-ones state reads out exp(g) (compared as logs: exp
      multiplies an ulp of g by |g|, and near 1 it cannot resolve g below an ulp of 1);
    * from a zero state, q = k = e_0 (no l2norm), v = Dk^0.5: the output is beta, which must be rounded to b's
      dtype. Both equal ``gdn_gates``' to an ulp or two, bf16 beta to one bf16 ulp (the interpreter truncates)."""
    T, hv, dk, dv = 8, 4, 16, 16
    slots = torch.arange(1, T + 1, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(T + 1, dtype=torch.int32, device=DEVICE)
    gates = extreme_gate_inputs(T, hv, dtype, seed=50)
    g, beta = gdn_gates(gates["a"], gates["b"], gates["A_log"], gates["dt_bias"])
    assert (gates["a"][:, 0] > 20).any() and (gates["a"][:, 0] < -20).any()
    zeros = torch.zeros(T, 1, dk, device=DEVICE)
    unit = zeros.clone()
    unit[..., 0] = 1
    fn = gdn_fns()[kernel]

    decay_in = dict(q=zeros, k=zeros, v=torch.zeros(T, hv, dv, device=DEVICE), **gates,
                    ssm_states=torch.ones(T + 1, hv, dk, dv, device=DEVICE))
    _, states = run(fn, decay_in, slots, qsl, torch.ones(T, dtype=torch.bool, device=DEVICE), use_qk_l2norm=False)
    torch.testing.assert_close(states[1:].log(), g[:, :, None, None].expand(T, hv, dk, dv), atol=1e-6, rtol=1e-6)

    beta_in = dict(q=unit, k=unit, v=torch.full((T, hv, dv), dk**0.5, device=DEVICE), **gates,
                   ssm_states=torch.zeros(T + 1, hv, dk, dv, device=DEVICE))
    o, _ = run(fn, beta_in, slots, qsl, torch.zeros(T, dtype=torch.bool, device=DEVICE), use_qk_l2norm=False)
    assert torch.equal(o, o.to(dtype).float()), "beta is not rounded to b's dtype"
    want = beta.float()[:, :, None].expand(T, hv, dv)
    torch.testing.assert_close(o, want, atol=0, rtol=2**-7 if dtype == torch.bfloat16 else 2e-6)


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_gates_match_reference(kernel, dtype):
    """The whole rule on extreme raw gates (strided a/b views, softplus past its threshold and far below 0):
    each kernel equals the reference fed the same a and b, decode rows beside sequences over a chunk boundary."""
    lens = [1, 70, 3, 1]
    slots, qsl, init = batch(lens, 8, seed=51)
    inputs = gdn_inputs(sum(lens), 1, 4, 16, 16, dtype, seed=52, num_slots=8, fused=True)
    inputs.update(extreme_gate_inputs(sum(lens), 4, dtype, seed=53))
    kwargs = {"query_start_loc_host": qsl.tolist()} if kernel == "chunked" else {}
    o, states = run(gdn_fns()[kernel], inputs, slots, qsl, init, **kwargs)
    ref_o, ref_states = run(gated_delta_rule_varlen_ref, inputs, slots, qsl, init)
    exact = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o, ref_o, **(exact if dtype == torch.float32 else tol(dtype)))
    torch.testing.assert_close(states, ref_states, **(exact if dtype == torch.float32 else state_tol(dtype)))
    untouched(states, inputs["ssm_states"], slots)


def test_dispatch_takes_raw_gates(monkeypatch):
    """``kernels.gdn.gated_delta_rule`` (the layer's entry point) routes decode rows to the recurrent kernel and
    prompt chunks to the chunked kernels (forced onto the Triton branch under the interpreter); both equal the
    reference."""
    from kernels import dispatch, gdn

    if INTERPRET:
        monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    for lens in ([1, 1, 1], [5, 70, 1]):
        slots, qsl, init = batch(lens, 8, seed=60)
        inputs = gdn_inputs(sum(lens), 1, 2, 16, 16, torch.float32, seed=61, num_slots=8, fused=True)
        want = run(gated_delta_rule_varlen_ref, inputs, slots, qsl, init)
        got = run(lambda *args: gdn.gated_delta_rule(*args, max(lens), qsl.tolist()), inputs, slots, qsl, init)
        torch.testing.assert_close(got[0], want[0], **tol(torch.float32))
        torch.testing.assert_close(got[1], want[1], **state_tol(torch.float32))


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
    for name in ("a", "A_log", "dt_bias"):  # gate inputs of the wrong width
        with pytest.raises(ValueError):
            run(gated_delta_rule_recurrent_triton, {**inputs, name: torch.cat([inputs[name]] * 2, dim=-1)}, slots,
                qsl, init)


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
        o = gated_delta_rule_recurrent_triton(*(inputs[name] for name in (*PER_TOKEN, "A_log", "dt_bias")),
                                              ssm_states, slots, qsl, init)
        return y, o

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph, o_graph = step()
    new_x, new_inputs = fresh(43)
    x.copy_(new_x)
    for name in PER_TOKEN:
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
