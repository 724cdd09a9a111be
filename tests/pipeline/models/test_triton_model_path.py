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
