"""The model's GPU path (Triton kernels: fused qkv prologue, attention, norms, activation) gives the
same logits and greedy tokens as its torch path. Runs the kernels under the Triton interpreter on
CPU, so a wiring mistake in the GPU branch of a layer fails here, not first on the GPU machine."""
import os

import pytest
import torch

from kernels import dispatch
from tests.model_utils import conveyor_from_hf, make_tiny_hf_model, run_paged


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen3_5_moe_text"])
def test_triton_path_equals_torch_path(model_type, monkeypatch):
    if not dispatch.triton_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under the interpreter (the model runs on CPU tensors)")
    layers = {} if model_type == "qwen3_5_moe_text" else {"num_hidden_layers": 1}  # hybrid: 3 GDN + attention
    model = conveyor_from_hf(make_tiny_hf_model(model_type, **layers), torch.float32)
    prompts = [list(range(100, 109)), list(range(300, 304))]
    torch_run = run_paged(model, prompts, max_new_tokens=3, chunks=2)
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    triton_run = run_paged(model, prompts, max_new_tokens=3, chunks=2)
    assert triton_run.generated == torch_run.generated
    for ours, ref in zip(triton_run.prompt_logits, torch_run.prompt_logits):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
