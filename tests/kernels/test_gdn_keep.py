"""Keep slots of the Gated DeltaNet state kernels (``keep_slots``: the state after each token of a speculative verify
row, left in spare slots for rollback).

The references first: each kept conv window / delta-rule state equals the row's own state after a run of the same
reference on the row cut after that token. Then the Triton kernels (interpreter on CPU, tests/conftest.py) against
the references with keep slots: the conv's varlen and decode kernels, the recurrent delta rule with and without the
gated norm, and the ``kernels.gdn`` entry points.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kernels import dispatch, gdn
from kernels.gdn import causal_conv1d_varlen_ref, gated_delta_rule_varlen_ref, rms_norm_gated_ref
from kernels.triton_compat import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
NUM_SLOTS = 24

needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")
pytestmark = pytest.mark.usefixtures("single_torch_thread")


def varlen(lens: list[int], slots: list[int], init: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.tensor(slots, dtype=torch.int32, device=DEVICE),
            torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE),
            torch.tensor(init, dtype=torch.bool, device=DEVICE))


def conv_inputs(T: int, C: int, K: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """x as a column view of a wider row (as the layer passes it), weight, bias, random windows in every slot."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C + 5, generator=gen).to(device=DEVICE, dtype=dtype)[:, 3:3 + C]
    weight = torch.randn(C, K, generator=gen).to(device=DEVICE, dtype=dtype)
    bias = torch.randn(C, generator=gen).to(device=DEVICE, dtype=dtype)
    states = torch.randn(NUM_SLOTS, C, K - 1, generator=gen).to(device=DEVICE, dtype=dtype)
    return x, weight, bias, states


def gdn_inputs(T: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    return dict(q=rand(T, hk, dk), k=rand(T, hk, dk), v=rand(T, hv, dv), a=rand(T, hv), b=rand(T, hv),
                A_log=torch.linspace(-4, 0.5, hv, device=DEVICE), dt_bias=torch.linspace(-0.3, 0.3, hv, device=DEVICE),
                ssm_states=(torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen) * 0.5).to(DEVICE))


def run_gdn(fn, inputs: dict[str, torch.Tensor], slots, qsl, init, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, the states after) on a copy of the states."""
    states = inputs["ssm_states"].clone()
    names = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
    return fn(*(inputs[n] for n in names), states, slots, qsl, init, **kwargs), states


def prefixes(lens: list[int], keep: list[int]):
    """(row, tokens of the row up to the kept one, token index, keep slot) for every kept token."""
    qsl = [0, *itertools.accumulate(lens)]
    for row, (lo, hi) in enumerate(zip(qsl, qsl[1:])):
        for t in range(lo, hi):
            if keep[t] >= 0:
                yield row, t + 1 - lo, t, keep[t]


def untouched(after: torch.Tensor, before: torch.Tensor, written: list[int]) -> None:
    others = torch.ones(after.shape[0], dtype=torch.bool, device=after.device)
    others[written] = False
    assert torch.equal(after[others], before[others]), "slots neither owned nor kept changed"


# Rows [1, 4, 3, 5]: a decode row, a fresh row (its early windows reach into zeros), a row with a gap in its keeps,
# and a row without any keep (must stay on the chunked path, bit for bit).
LENS = [1, 4, 3, 5]
SLOTS = [3, 7, 1, 12]
INIT = [True, False, True, True]
KEEP = [15, 16, 17, 18, -1, 20, -1, 22, -1, -1, -1, -1, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 4])
def test_conv_reference_keep_equals_prefix_run(K, dtype):
    T, C = sum(LENS), 6
    x, weight, bias, states = conv_inputs(T, C, K, dtype, seed=K)
    slots, qsl, init = varlen(LENS, SLOTS, INIT)
    keep = torch.tensor(KEEP, dtype=torch.int32, device=DEVICE)
    plain, kept = states.clone(), states.clone()
    y_plain = causal_conv1d_varlen_ref(x, weight, bias, plain, slots, qsl, init)
    y = causal_conv1d_varlen_ref(x, weight, bias, kept, slots, qsl, init, keep_slots=keep)
    assert torch.equal(y, y_plain) and torch.equal(kept[slots.long()], plain[slots.long()])
    untouched(kept, states, SLOTS + [s for s in KEEP if s >= 0])
    starts = qsl.tolist()
    for row, n, t, slot in prefixes(LENS, KEEP):
        prefix = states.clone()
        lo = starts[row]
        causal_conv1d_varlen_ref(x[lo:lo + n], weight, bias, prefix, slots[row:row + 1],
                                 torch.tensor([0, n], dtype=torch.int32, device=DEVICE), init[row:row + 1])
        assert torch.equal(kept[slot], prefix[SLOTS[row]]), f"window kept after token {t} (row {row})"


def test_gdn_reference_keep_equals_prefix_run():
    T = sum(LENS)
    inputs = gdn_inputs(T, 1, 2, 8, 8, torch.float32, seed=1)
    slots, qsl, init = varlen(LENS, SLOTS, INIT)
    keep = torch.tensor(KEEP, dtype=torch.int32, device=DEVICE)
    o_plain, plain = run_gdn(gated_delta_rule_varlen_ref, inputs, slots, qsl, init)
    o, kept = run_gdn(gated_delta_rule_varlen_ref, inputs, slots, qsl, init, keep_slots=keep)
    torch.testing.assert_close(o, o_plain, atol=1e-5, rtol=1e-5)  # token by token against chunked
    torch.testing.assert_close(kept[slots.long()], plain[slots.long()], atol=1e-5, rtol=1e-5)
    last = slice(sum(LENS[:3]), T)  # the row without keeps: as without keep_slots, bit for bit
    assert torch.equal(o[last], o_plain[last]) and torch.equal(kept[SLOTS[3]], plain[SLOTS[3]])
    untouched(kept, inputs["ssm_states"], SLOTS + [s for s in KEEP if s >= 0])
    starts = qsl.tolist()
    for row, n, t, slot in prefixes(LENS, KEEP):
        lo = starts[row]
        cut = {name: (v[lo:lo + n] if name in ("q", "k", "v", "a", "b") else v) for name, v in inputs.items()}
        one = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
        # A keep on the prefix's last token sends the prefix token by token too, the recurrence as in the full row;
        # but the gates and norms are computed over n tokens instead of the whole batch's, and ATen's vectorized loops
        # round a tensor's tail apart from its body at a width the CPU's instruction set decides (AVX2: 8 lanes,
        # AVX-512: 16). So the kept state equals the prefix run to a stated tolerance, a few fp32 ulps, not bitwise.
        scratch = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
        scratch[-1] = NUM_SLOTS - 1
        _, stepped = run_gdn(gated_delta_rule_varlen_ref, cut, slots[row:row + 1], one, init[row:row + 1],
                             keep_slots=scratch)
        torch.testing.assert_close(kept[slot], stepped[SLOTS[row]], atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"state kept after token {t} (row {row}): {m}")
        _, chunked = run_gdn(gated_delta_rule_varlen_ref, cut, slots[row:row + 1], one, init[row:row + 1])
        torch.testing.assert_close(kept[slot], chunked[SLOTS[row]], atol=1e-5, rtol=1e-5)


def test_keep_slots_rejected_where_they_cannot_be_written():
    slots, qsl, init = varlen([17], [1], [True])
    inputs = gdn_inputs(17, 1, 1, 8, 8, torch.float32, seed=2)
    keep = torch.full((17,), -1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="keep_slots"):
        run_gdn(gated_delta_rule_varlen_ref, inputs, slots, qsl, init, keep_slots=keep[:-1])
    x, weight, bias, states = conv_inputs(17, 4, 4, torch.float32, seed=2)
    with pytest.raises(ValueError, match="keep_slots"):
        causal_conv1d_varlen_ref(x, weight, bias, states, slots, qsl, init, keep_slots=keep[:-1])


# ---- the Triton kernels against the references ----

# Rows [1, 3, 6]: keeps on every token of the longer rows but the last (a verify row's rollback points), a -1 on
# the decode row; the 6-token row crosses the conv's 4-token tiles with a kept token in its second tile.
TRITON_LENS = [1, 3, 6]
TRITON_SLOTS = [4, 2, 9]
TRITON_INIT = [True, False, True]
TRITON_KEEP = [-1, 11, 13, -1, 14, 15, 16, 17, 18, -1]


@needs_triton
@pytest.mark.parametrize("keep_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 4])
def test_conv_varlen_kernel_keeps(K, dtype, keep_dtype):
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    T, C = sum(TRITON_LENS), 20
    x, weight, bias, states = conv_inputs(T, C, K, dtype, seed=10 + K)
    slots, qsl, init = varlen(TRITON_LENS, TRITON_SLOTS, TRITON_INIT)
    keep = torch.tensor(TRITON_KEEP, dtype=keep_dtype, device=DEVICE)
    mine, ref = states.clone(), states.clone()
    y = causal_conv1d_varlen_triton(x, weight, bias, mine, slots, qsl, init, max_query_len=max(TRITON_LENS),
                                    keep_slots=keep)
    y_ref = causal_conv1d_varlen_ref(x, weight, bias, ref, slots, qsl, init, keep_slots=keep)
    torch.testing.assert_close(y, y_ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}))
    assert torch.equal(mine, ref), "conv states (own or kept) differ"
    untouched(mine, states, TRITON_SLOTS + [s for s in TRITON_KEEP if s >= 0])
    plain = states.clone()
    y_plain = causal_conv1d_varlen_triton(x, weight, bias, plain, slots, qsl, init, max_query_len=max(TRITON_LENS))
    assert torch.equal(y, y_plain) and torch.equal(mine[slots.long()], plain[slots.long()])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_kernel_keeps(dtype):
    """Single-token rows (the decode kernel): the kept window is the row's new one; an empty row keeps nothing."""
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    lens, C, K = [1, 1, 0, 1, 1], 20, 4
    x, weight, bias, states = conv_inputs(4, C, K, dtype, seed=20)
    slots, qsl, init = varlen(lens, [5, 1, 8, 3, 7], [True, False, True, True, True])
    keep = torch.tensor([10, 11, -1, 13], dtype=torch.int32, device=DEVICE)
    mine, ref = states.clone(), states.clone()
    y = causal_conv1d_varlen_triton(x, weight, bias, mine, slots, qsl, init, max_query_len=1, keep_slots=keep)
    ref_slots, ref_qsl, ref_init = varlen([1] * 4, [5, 1, 3, 7], [True, False, True, True])
    y_ref = causal_conv1d_varlen_ref(x, weight, bias, ref, ref_slots, ref_qsl, ref_init, keep_slots=keep)
    torch.testing.assert_close(y, y_ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}))
    assert torch.equal(mine, ref), "conv states (own or kept) differ"
    assert torch.equal(mine[[10, 11, 13]], mine[[5, 1, 7]])
    untouched(mine, states, [5, 1, 3, 7, 10, 11, 13])


@needs_triton
@pytest.mark.parametrize("dv", [16, 40])
@pytest.mark.parametrize("norm", [False, True])
def test_recurrent_kernel_keeps(norm, dv):
    """HK=2, HV=4; Dv 40 spans two V-blocks without the norm. Outputs, own and kept states against the reference
    (which goes token by token on rows with keeps), with the gated norm against the reference then the norm."""
    from kernels.triton_gdn import gated_delta_rule_recurrent_triton

    T, hv = sum(TRITON_LENS), 4
    inputs = gdn_inputs(T, 2, hv, 16, dv, torch.float32, seed=30 + dv)
    slots, qsl, init = varlen(TRITON_LENS, TRITON_SLOTS, TRITON_INIT)
    keep = torch.tensor(TRITON_KEEP, dtype=torch.int32, device=DEVICE)
    kwargs = {}
    if norm:
        gen = torch.Generator().manual_seed(31)
        z = torch.randn(T, hv, dv, generator=gen).to(DEVICE)
        weight = (torch.rand(dv, generator=gen) + 0.5).to(DEVICE)
        kwargs["gated_norm"] = (z, weight, 1e-6)
    o, states = run_gdn(gated_delta_rule_recurrent_triton, inputs, slots, qsl, init, keep_slots=keep, **kwargs)
    ref_o, ref_states = run_gdn(gated_delta_rule_varlen_ref, inputs, slots, qsl, init, keep_slots=keep)
    if norm:
        ref_o = rms_norm_gated_ref(ref_o.reshape(T * hv, dv), z.reshape(T * hv, dv), weight, 1e-6).view(T, hv, dv)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    untouched(states, inputs["ssm_states"], TRITON_SLOTS + [s for s in TRITON_KEEP if s >= 0])
    o_plain, plain = run_gdn(gated_delta_rule_recurrent_triton, inputs, slots, qsl, init, **kwargs)
    assert torch.equal(o, o_plain) and torch.equal(states[slots.long()], plain[slots.long()])


@needs_triton
@pytest.mark.parametrize("use_triton", [True, False])
def test_entry_points_pass_keep_slots(monkeypatch, use_triton):
    """``kernels.gdn``'s conv and delta rule (the layer's calls) write the keeps on either branch."""
    if INTERPRET:
        monkeypatch.setattr(dispatch, "use_triton", lambda device: use_triton)
    elif not use_triton:
        pytest.skip("the reference branch runs on CPU")
    T = sum(TRITON_LENS)
    slots, qsl, init = varlen(TRITON_LENS, TRITON_SLOTS, TRITON_INIT)
    keep = torch.tensor(TRITON_KEEP, dtype=torch.int32, device=DEVICE)
    inputs = gdn_inputs(T, 1, 2, 16, 16, torch.float32, seed=40)
    o, states = run_gdn(lambda *args, **kw: gdn.gated_delta_rule(*args, max(TRITON_LENS), qsl.tolist(), **kw),
                        inputs, slots, qsl, init, keep_slots=keep)
    ref_o, ref_states = run_gdn(gated_delta_rule_varlen_ref, inputs, slots, qsl, init, keep_slots=keep)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    x, weight, bias, conv = conv_inputs(T, 12, 4, torch.float32, seed=41)
    mine, ref = conv.clone(), conv.clone()
    y = gdn.causal_conv1d_varlen(x, weight, bias, mine, slots, qsl, init, max(TRITON_LENS), keep_slots=keep)
    torch.testing.assert_close(y, causal_conv1d_varlen_ref(x, weight, bias, ref, slots, qsl, init, keep_slots=keep),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(mine, ref)


@needs_triton
def test_a_step_mixing_kept_rows_with_a_prompt_chunk(monkeypatch):
    """Verify rows that keep states beside a prompt chunk longer than the token-by-token kernel takes (an eager
    mixed step): the short rows go through it with their keeps, the long one chunked; all equal the reference."""
    if INTERPRET:
        monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    lens = [3, 20, 4]
    slots, qsl, init = varlen(lens, [1, 2, 3], [True, False, True])
    keep = torch.tensor([4, 5, -1] + [-1] * 20 + [6, 7, 8, -1], dtype=torch.int32, device=DEVICE)
    inputs = gdn_inputs(sum(lens), 1, 2, 16, 16, torch.float32, seed=44)
    o, states = run_gdn(lambda *args, **kw: gdn.gated_delta_rule(*args, max(lens), qsl.tolist(), **kw),
                        inputs, slots, qsl, init, keep_slots=keep)
    ref_o, ref_states = run_gdn(gated_delta_rule_varlen_ref, inputs, slots, qsl, init, keep_slots=keep)
    torch.testing.assert_close(o, ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states, ref_states, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_verify_step_with_keeps_cuda_graph():
    """A verify step (rows of 4 tokens, keeps on the first three) captured in a CUDA graph: conv (varlen kernel) and
    delta rule replay equal eager and the references, kept slots included."""
    from kernels.triton_gdn import gated_delta_rule_recurrent_triton
    from kernels.triton_gdn_conv import causal_conv1d_varlen_triton

    n, C, K = 4, 2 * 16 * 128 + 32 * 128, 4
    lens = [4] * n
    slots, qsl, init = varlen(lens, [1, 2, 3, 4], [True] * n)
    keep = torch.tensor([s for b in range(n) for s in (5 + 3 * b, 6 + 3 * b, 7 + 3 * b, -1)], dtype=torch.int32,
                        device=DEVICE)
    x, weight, bias, conv0 = conv_inputs(4 * n, C, K, torch.bfloat16, seed=50)
    inputs = gdn_inputs(4 * n, 16, 32, 128, 128, torch.bfloat16, seed=51)
    conv_states, ssm_states = conv0.clone(), inputs["ssm_states"].clone()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        y = causal_conv1d_varlen_triton(x, weight, bias, conv_states, slots, qsl, init, max_query_len=4,
                                        keep_slots=keep)
        o = gated_delta_rule_recurrent_triton(*(inputs[k] for k in ("q", "k", "v", "a", "b", "A_log", "dt_bias")),
                                              ssm_states, slots, qsl, init, keep_slots=keep)
        return y, o

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph, o_graph = step()
    conv_states.copy_(conv0)
    ssm_states.copy_(inputs["ssm_states"])
    graph.replay()
    torch.cuda.synchronize()
    y_replay, o_replay = y_graph.clone(), o_graph.clone()
    conv_replay, ssm_replay = conv_states.clone(), ssm_states.clone()
    conv_states.copy_(conv0)
    ssm_states.copy_(inputs["ssm_states"])
    y_eager, o_eager = step()
    assert torch.equal(y_replay, y_eager) and torch.equal(o_replay, o_eager)
    assert torch.equal(conv_replay, conv_states) and torch.equal(ssm_replay, ssm_states)
    ref_conv = conv0.clone()
    causal_conv1d_varlen_ref(x, weight, bias, ref_conv, slots, qsl, init, keep_slots=keep)
    assert torch.equal(conv_replay, ref_conv)
    _, ref_states = run_gdn(gated_delta_rule_varlen_ref, inputs, slots, qsl, init, keep_slots=keep)
    torch.testing.assert_close(ssm_replay, ref_states, atol=1e-2, rtol=1e-2)
