"""The model's GPU path (Triton kernels: fused qkv prologue, attention, norms, activation) gives the
same logits and greedy tokens as its torch path. Runs the kernels under the Triton interpreter on
CPU, so a wiring mistake in the GPU branch of a layer fails here, not first on the GPU machine. The weights stay
unpacked, as on the GPU (CPU serving prepacks them for oneDNN); the hybrid's decode steps take the delta-rule
kernel with the gated norm inside it."""
import os

import pytest
import torch

from kernels import dispatch
from kernels import triton_gdn as gdn_triton
from pipeline.models.registry import build_model
from tests.model_utils import arch_of, make_tiny_hf_model, run_paged


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen3_5_moe_text"])
def test_triton_path_equals_torch_path(model_type, monkeypatch):
    if not dispatch.triton_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under the interpreter (the model runs on CPU tensors)")
    layers = {} if model_type == "qwen3_5_moe_text" else {"num_hidden_layers": 1}  # hybrid: 3 GDN + attention
    hf = make_tiny_hf_model(model_type, **layers)
    model = build_model(arch_of(hf), hf.state_dict().items(), dtype=torch.float32, prepack=False)
    prompts = [list(range(100, 109)), list(range(300, 304))]
    torch_run = run_paged(model, prompts, max_new_tokens=3, chunks=2)
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    normed = []
    recurrent = gdn_triton.gated_delta_rule_recurrent_triton
    monkeypatch.setattr(gdn_triton, "gated_delta_rule_recurrent_triton",
                        lambda *a, **kw: normed.append("gated_norm" in kw) or recurrent(*a, **kw))
    triton_run = run_paged(model, prompts, max_new_tokens=3, chunks=2)
    assert triton_run.generated == torch_run.generated
    assert any(normed) == (model_type == "qwen3_5_moe_text")
    for ours, ref in zip(triton_run.prompt_logits, torch_run.prompt_logits):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    for ours_seq, ref_seq in zip(triton_run.decode_logits, torch_run.decode_logits):
        for ours, ref in zip(ours_seq, ref_seq):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen3_5_moe_text"])
def test_one_decode_row_runs_each_norm_inside_the_next_projection(model_type, monkeypatch):
    """bf16, one sequence: every decode step runs each layer's two residual-add norms inside the projection that
    follows them (``gemv_norm_triton``; the MoE router also hands the normed rows to the experts). Against the same
    GPU path with the norm as its own kernel: the same greedy tokens, logits within bf16 rounding. The plain
    projections (the 49k-row lm_head above all) take the torch reference: the interpreter would run one program
    per two of their rows; the kernel itself is tested in tests/kernels/test_triton_gemv.py."""
    if not dispatch.triton_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under the interpreter (the model runs on CPU tensors)")
    from kernels.triton_gemv import NormedProjection, gemv_ref
    from kernels.triton_norm import rms_norm_triton

    hf = make_tiny_hf_model(model_type, **({} if model_type == "qwen3_5_moe_text" else {"num_hidden_layers": 2}))
    model = build_model(arch_of(hf), hf.state_dict().items(), dtype=torch.bfloat16, prepack=False)
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    monkeypatch.setattr(dispatch, "skinny_linear",
                        lambda x, w, b=None, out_dtype=None: gemv_ref(x, w, b).to(out_dtype or x.dtype))
    fused_calls = []
    fused = dispatch.norm_linear
    monkeypatch.setattr(dispatch, "norm_linear", lambda *a, **fp8: fused_calls.append(a[-1]) or fused(*a, **fp8))
    prompt = [list(range(100, 107))]
    fused_run = run_paged(model, prompt, max_new_tokens=3)

    def separate(x, residual, norm_weight, eps, weight, bias, write_normed, scale=None, block=None, tail=None):
        assert scale is None and tail is None  # 16-bit weights here
        normed, new_residual = rms_norm_triton(x, norm_weight, eps, residual) if residual is not None else (
            rms_norm_triton(x, norm_weight, eps), x)
        return NormedProjection(gemv_ref(normed, weight, bias), new_residual, normed if write_normed else None)

    monkeypatch.setattr(dispatch, "norm_linear", separate)
    separate_run = run_paged(model, prompt, max_new_tokens=3)
    layers = len(model.model.layers)
    assert len(fused_calls) == 2 * layers * 2  # two norms a layer, two single-row decode steps (after the prefill)
    assert any(fused_calls) == (model_type != "qwen3")  # the normed rows are kept for the experts only
    assert fused_run.generated == separate_run.generated
    for ours, ref in zip(fused_run.decode_logits[0], separate_run.decode_logits[0]):
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(ours.float(), ref.float(), atol=0.05 * scale, rtol=0.05)


def test_triton_path_reads_an_fp8_cache_as_the_torch_path(monkeypatch):
    """--kv-cache-dtype fp8 with per-layer scales != 1 (Qwen3: q/k norms in the prologue): the GPU path's prologue and
    attention kernels against the torch path's KV write and attention on an e4m3 cache, over chunked prefill, mixed
    and decode steps: the same greedy tokens and logits. (The gated attention of the hybrids reads the cache through
    the same kernels: tests/kernels/test_fp8_kv_kernels.py.)"""
    if not dispatch.triton_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under the interpreter (the model runs on CPU tensors)")
    from pipeline.models.self_attention import PagedAttention

    hf = make_tiny_hf_model("qwen3", num_hidden_layers=1)
    model = build_model(arch_of(hf), hf.state_dict().items(), dtype=torch.float32, prepack=False)
    for module in model.modules():
        if isinstance(module, PagedAttention):  # keys / 0.02: a median of 56, some clamped at 448
            module.k_scale, module.v_scale = 0.02, 0.005
    prompts = [list(range(100, 109)), list(range(300, 304))]
    fp8 = dict(max_new_tokens=3, chunks=2, kv_dtype=torch.float8_e4m3fn)
    torch_run = run_paged(model, prompts, **fp8)
    assert all(c.dtype == torch.float8_e4m3fn for c in torch_run.caches)
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    triton_run = run_paged(model, prompts, **fp8)
    assert triton_run.generated == torch_run.generated
    for ours, ref in zip(triton_run.prompt_logits, torch_run.prompt_logits):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    for ours_seq, ref_seq in zip(triton_run.decode_logits, torch_run.decode_logits):
        for ours, ref in zip(ours_seq, ref_seq):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
