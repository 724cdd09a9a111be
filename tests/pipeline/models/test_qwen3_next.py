"""The hybrid family (Qwen3-Next, Qwen3.5 dense, Qwen3.5-MoE) against transformers' torch path (fp32): logits at
every prompt position and 32 greedy tokens, prompts chunked across several steps (the recurrent state carries
over chunk boundaries), sequences batched with others in mixed prefill + decode steps (each equals its run
alone, at batch sizes 1, 2, 3 and 8), and the weight forms (Qwen3-Next's grouped projections, multimodal
prefixes, dummy weights)."""

import pytest
import torch

from pipeline.models.config import ModelArchConfig
from pipeline.models.families.qwen3_next import Qwen3NextForCausalLM, cache_layout
from pipeline.models.registry import build_model
from tests.model_utils import HYBRID_TYPES, arch_of, conveyor_from_hf, hf_greedy, make_tiny_hf_model, run_paged

pytestmark = pytest.mark.usefixtures("single_torch_thread")

VOCAB = 49152
NEW_TOKENS = 32


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=HYBRID_TYPES)
def pair(request):
    hf = make_tiny_hf_model(request.param, seed=1)
    return hf, conveyor_from_hf(hf)


def test_parity_with_transformers_chunked(pair):
    """A 150-token prompt in chunks of 40/70 (past the reference's 64-token chunk, and not aligned to it).

    Tolerance: random tiny weights leave a few ill-conditioned positions (q/k near zero before their l2 norm,
    close routing) where a different chunking changes fp32 rounding by up to ~1e-3 (1.5e-4 unchunked); the
    greedy tokens must be identical."""
    hf, model = pair
    assert isinstance(model, Qwen3NextForCausalLM)
    ids = prompt(150, seed=2)
    ref_logits, ref_tokens, ref_step_logits = hf_greedy(hf, ids, NEW_TOKENS)
    run = run_paged(model, [ids], NEW_TOKENS, block_size=4, chunks=[40, 70])
    assert run.step_kinds[:3] == ["prefill"] * 3
    torch.testing.assert_close(run.prompt_logits[0], ref_logits, atol=2e-3, rtol=1e-3)
    assert run.generated[0] == ref_tokens
    torch.testing.assert_close(torch.stack(run.decode_logits[0]), torch.stack(ref_step_logits), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_batched_equals_alone(pair, batch):
    """Mixed-length prompts batched in the same steps (prefill chunks beside decode rows) equal each run alone:
    every batched buffer and state slot is per sequence."""
    _, model = pair
    prompts = [prompt(3 + 11 * i, seed=10 + i) for i in range(batch)]
    together = run_paged(model, prompts, 12, chunks=[9, 5], batched=True)
    alone = run_paged(model, prompts, 12, chunks=[9, 5], batched=False)
    if batch > 1:
        assert "mixed" in together.step_kinds
    assert together.generated == alone.generated
    for a, b in zip(together.prompt_logits, alone.prompt_logits):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)  # fp32 GEMMs are blocked by batch size


def test_arch_and_layout():
    hf = make_tiny_hf_model("qwen3_5_moe_text")
    arch = arch_of(hf)
    assert arch.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert arch.is_hybrid and arch.attn_output_gate and arch.zero_centered_norm and arch.qk_norm
    assert arch.rotary_dim == arch.head_dim // 4 and arch.norm_topk_prob and arch.num_experts == 8
    assert cache_layout(arch) == [1, 3, 5, 0]  # attention caches first, then two state tensors per GDN layer
    # a config.json without layer_types: every full_attention_interval-th layer attends
    d = {k: v for k, v in hf.config.to_dict().items() if k != "layer_types"}
    d.update(num_hidden_layers=8, full_attention_interval=4)
    assert ModelArchConfig.from_hf(d).layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    # the multimodal wrapper's config resolves to its text model
    wrapped = ModelArchConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": hf.config.to_dict()})
    assert wrapped.model_type == "qwen3_5_moe_text" and wrapped.layer_types == arch.layer_types
    with pytest.raises(ValueError, match="layer_types"):
        ModelArchConfig.from_hf({**hf.config.to_dict(), "layer_types": ["linear_attention"] * 3})


def test_multimodal_names_and_skipped_heads():
    """A Qwen3.5 checkpoint as the multimodal class saves it: language_model prefix, plus vision and MTP weights."""
    hf = make_tiny_hf_model("qwen3_5_text", seed=3)
    ids = prompt(20, seed=4)
    want = run_paged(conveyor_from_hf(hf), [ids], 4)
    named = [(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n, t)
             for n, t in hf.state_dict().items()]
    named += [("model.visual.blocks.0.attn.qkv.weight", torch.zeros(3, 3)), ("mtp.fc.weight", torch.zeros(2, 2))]
    got = run_paged(build_model(arch_of(hf), named), [ids], 4)
    torch.testing.assert_close(got.prompt_logits[0], want.prompt_logits[0], atol=0, rtol=0)
    assert got.generated == want.generated


def test_dummy_weights_build_and_run():
    arch = arch_of(make_tiny_hf_model("qwen3_next"))
    model = build_model(arch, None)
    run = run_paged(model, [prompt(12), prompt(5, seed=1)], 4, chunks=[7])
    assert all(len(g) == 4 for g in run.generated)
    assert all(torch.isfinite(l).all() for l in run.prompt_logits)
