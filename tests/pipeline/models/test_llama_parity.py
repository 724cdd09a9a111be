"""Parity of the paged dense model family with transformers (fp32, eager attention), and the paged batching
invariants: chunked prefill == unchunked, batched == alone, mixed prefill+decode steps."""

import pytest
import torch

from pipeline.models.config import ModelArchConfig
from pipeline.models.registry import MODEL_REGISTRY, build_model
from tests.model_utils import arch_of, conveyor_from_hf, hf_greedy, make_tiny_hf_model, run_paged


pytestmark = pytest.mark.usefixtures("single_torch_thread")


VOCAB = 49152
NEW_TOKENS = 32

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}

VARIANTS = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama_tied_linear": ("llama", {"tie_word_embeddings": True,
                                    "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
    "llama_llama3": ("llama", {"rope_parameters": LLAMA3, "num_hidden_layers": 3}),
    "llama_tied_llama3": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3}),
    "llama_yarn": ("llama", {"rope_parameters": YARN}),
    "llama_tied_yarn": ("llama", {"tie_word_embeddings": True, "rope_parameters": YARN}),
    "llama_attention_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "qwen3": ("qwen3", {}),
    "qwen3_mqa": ("qwen3", {"num_key_value_heads": 1, "rope_parameters": YARN}),
}


def prompt(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny_llama():
    hf = make_tiny_hf_model("llama", seed=3)
    return hf, conveyor_from_hf(hf)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_transformers(variant):
    model_type, overrides = VARIANTS[variant]
    hf = make_tiny_hf_model(model_type, seed=1, **overrides)
    model = conveyor_from_hf(hf)
    ids = prompt(21, seed=2)
    ref_logits, ref_tokens, ref_step_logits = hf_greedy(hf, ids, NEW_TOKENS)

    run = run_paged(model, [ids], NEW_TOKENS, block_size=4, shuffle_blocks=True)
    table = run.block_tables[0]
    assert len(table) >= 13 and table != sorted(table)  # many blocks, non-contiguous order
    assert run.step_kinds[0] == "prefill" and set(run.step_kinds[1:]) == {"decode"}

    torch.testing.assert_close(run.prompt_logits[0], ref_logits, atol=1e-4, rtol=1e-5)
    assert run.generated[0] == ref_tokens
    torch.testing.assert_close(torch.stack(run.decode_logits[0]), torch.stack(ref_step_logits), atol=1e-4, rtol=1e-5)


def test_arch_flags_per_family():
    qwen2 = arch_of(make_tiny_hf_model("qwen2"))
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = arch_of(make_tiny_hf_model("qwen3"))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 16
    llama = arch_of(make_tiny_hf_model("llama", tie_word_embeddings=True))
    assert llama.tie_word_embeddings and (llama.num_heads, llama.num_kv_heads) == (4, 2)
    assert set(MODEL_REGISTRY) >= {"llama", "mistral", "qwen2", "qwen3"}


@pytest.mark.parametrize("chunks", [[3, 5], 1, [7]])
def test_chunked_prefill_equals_unchunked(tiny_llama, chunks):
    _, model = tiny_llama
    ids = prompt(23, seed=4)
    whole = run_paged(model, [ids], 12)
    chunked = run_paged(model, [ids], 12, chunks=chunks, seed=5)
    assert chunked.step_kinds.count("prefill") > 1
    torch.testing.assert_close(chunked.prompt_logits[0], whole.prompt_logits[0], atol=2e-5, rtol=1e-5)
    assert chunked.generated[0] == whole.generated[0]


def test_batch_of_mixed_lengths_equals_each_alone(tiny_llama):
    hf, model = tiny_llama
    prompts = [prompt(n, seed=10 + n) for n in (5, 17, 2, 11)]
    alone = run_paged(model, prompts, 10, batched=False)
    batched = run_paged(model, prompts, 10, chunks=[4, 3], seed=7)
    # short prompts finish prefill first and decode while the long ones still prefill
    assert "mixed" in batched.step_kinds and "decode" in batched.step_kinds
    for b in range(len(prompts)):
        torch.testing.assert_close(batched.prompt_logits[b], alone.prompt_logits[b], atol=2e-5, rtol=1e-5)
        assert batched.generated[b] == alone.generated[b]
        torch.testing.assert_close(torch.stack(batched.decode_logits[b]), torch.stack(alone.decode_logits[b]),
                                   atol=2e-5, rtol=1e-5)
    # and both agree with transformers
    for b, ids in enumerate(prompts):
        ref_logits, ref_tokens, _ = hf_greedy(hf, ids, 10)
        torch.testing.assert_close(alone.prompt_logits[b], ref_logits, atol=1e-4, rtol=1e-5)
        assert alone.generated[b] == ref_tokens


def test_unchunked_batched_prefill_then_decode_batch(tiny_llama):
    _, model = tiny_llama
    prompts = [prompt(n, seed=30 + n) for n in (9, 3, 14)]
    alone = run_paged(model, prompts, 8, batched=False, block_size=16)
    batched = run_paged(model, prompts, 8, block_size=16)
    assert batched.step_kinds[0] == "prefill" and set(batched.step_kinds[1:]) == {"decode"}
    for b in range(3):
        torch.testing.assert_close(batched.prompt_logits[b], alone.prompt_logits[b], atol=2e-5, rtol=1e-5)
        assert batched.generated[b] == alone.generated[b]


def test_bfloat16_runs_and_tracks_fp32(tiny_llama):
    hf, model = tiny_llama
    model_bf16 = conveyor_from_hf(hf, dtype=torch.bfloat16)
    assert model_bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = prompt(19, seed=8)
    ref = run_paged(model, [ids], 0).prompt_logits[0]
    run = run_paged(model_bf16, [ids], 4)
    out = run.prompt_logits[0]
    assert out.dtype == torch.float32 and run.caches[0].dtype == torch.bfloat16
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert cos.min() > 0.99
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_load_weights_errors(tiny_llama):
    hf, _ = tiny_llama
    arch = arch_of(hf)
    sd = hf.state_dict()
    with pytest.raises(KeyError, match="unknown weight names: model.layers.0.self_attn.bogus.weight"):
        build_model(arch, [*sd.items(), ("model.layers.0.self_attn.bogus.weight", torch.zeros(1))])
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="missing weights: model.layers.1.self_attn.k_proj.weight"):
        build_model(arch, missing.items())
    bad = dict(sd)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="up_proj.weight: checkpoint shape"):
        build_model(arch, bad.items())
    # a stale rotary buffer in old checkpoints is ignored
    build_model(arch, [*sd.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])


def test_tied_model_needs_no_lm_head():
    hf = make_tiny_hf_model("qwen3", tie_word_embeddings=True)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    model = build_model(arch_of(hf), sd.items(), prepack=False)
    assert model.lm_head is None
    assert model.lm_head_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_prepacked_projections_equal_plain_ones(dtype, tied):
    from pipeline.models.layers import can_prepack

    hf = make_tiny_hf_model("qwen2", tie_word_embeddings=tied)
    sd = hf.state_dict().items()
    plain = build_model(arch_of(hf), sd, dtype=dtype, prepack=False)
    packed = build_model(arch_of(hf), sd, dtype=dtype)
    if not can_prepack(plain.model.embed_tokens.weight):
        pytest.skip("oneDNN prepacking is not available for this dtype here")
    assert packed.model.layers[0].self_attn.qkv_proj.packed is not None
    ids = prompt(13, seed=3)
    ref, out = run_paged(plain, [ids], 6), run_paged(packed, [ids], 6)
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(out.prompt_logits[0], ref.prompt_logits[0], **tol)
    if dtype == torch.float32:
        assert out.generated == ref.generated


def test_unsupported_model_type_lists_supported():
    arch = ModelArchConfig.from_hf(dict(model_type="gpt2", vocab_size=10, hidden_size=8, intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        build_model(arch, [])


def test_fused_weights_are_concatenated_projections(tiny_llama):
    hf, _ = tiny_llama
    sd = hf.state_dict()
    model = build_model(arch_of(hf), sd.items(), prepack=False)
    attn = model.model.layers[1].self_attn
    qkv = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, qkv)
    gate_up = torch.cat([sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, gate_up)
