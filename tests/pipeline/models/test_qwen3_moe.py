"""Qwen3-MoE on the shared decoder layers: parity with transformers (fp32), the SparseMoeBlock's expert-parallel
split (local expert subsets sum to the whole), its weight forms (per-expert and stacked HF names), the Qwen3-Next
shared-expert sparse block against transformers' own module, dummy weights, and batch invariance."""

import dataclasses
import math
import os

import pytest
import torch

from pipeline.models.config import ModelArchConfig
from pipeline.models.families.qwen3_moe import Qwen3MoeForCausalLM
from pipeline.models.moe import SparseMoeBlock
from pipeline.models.moe_layout import is_sparse_layer
from pipeline.models.registry import MODEL_REGISTRY, build_model
from tests.model_utils import arch_of, conveyor_from_hf, hf_greedy, make_tiny_hf_model, run_paged

pytestmark = pytest.mark.usefixtures("single_torch_thread")

VOCAB = 49152
NEW_TOKENS = 32

VARIANTS = {
    "default": {},
    "mlp_only_layer0": {"mlp_only_layers": [0]},
    "sparse_step2": {"decoder_sparse_step": 2, "num_hidden_layers": 3},
    "no_renorm": {"norm_topk_prob": False},
}


def prompt(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def per_expert_state_dict(hf_model) -> dict[str, torch.Tensor]:
    """The state dict with stacked experts split into per-expert HF names (the on-disk checkpoint form)."""
    out = {}
    for name, t in hf_model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def tiny_moe():
    hf = make_tiny_hf_model("qwen3_moe", seed=3)
    return hf, conveyor_from_hf(hf)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_transformers(variant):
    overrides = VARIANTS[variant]
    hf = make_tiny_hf_model("qwen3_moe", seed=1, **overrides)
    model = conveyor_from_hf(hf)
    assert isinstance(model, Qwen3MoeForCausalLM)
    arch = model.arch
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    hf_kinds = [type(layer.mlp).__name__ for layer in hf.model.layers]
    assert [k == "SparseMoeBlock" for k in kinds] == ["SparseMoe" in k for k in hf_kinds]
    assert kinds == ["SparseMoeBlock" if is_sparse_layer(arch, i) else "GatedMLP" for i in range(arch.num_layers)]
    if variant in ("mlp_only_layer0", "sparse_step2"):
        assert "GatedMLP" in kinds and "SparseMoeBlock" in kinds

    ids = prompt(21, seed=2)
    ref_logits, ref_tokens, ref_step_logits = hf_greedy(hf, ids, NEW_TOKENS)
    run = run_paged(model, [ids], NEW_TOKENS, block_size=4, shuffle_blocks=True)
    assert run.step_kinds[0] == "prefill" and set(run.step_kinds[1:]) == {"decode"}
    torch.testing.assert_close(run.prompt_logits[0], ref_logits, atol=1e-4, rtol=1e-5)
    assert run.generated[0] == ref_tokens
    torch.testing.assert_close(torch.stack(run.decode_logits[0]), torch.stack(ref_step_logits), atol=1e-4, rtol=1e-5)


def test_arch_fields():
    hf = make_tiny_hf_model("qwen3_moe", mlp_only_layers=[1], decoder_sparse_step=1)
    arch = arch_of(hf)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    assert arch.norm_topk_prob and arch.qk_norm and arch.mlp_only_layers == (1,)
    assert arch.shared_expert_intermediate_size is None
    assert "qwen3_moe" in MODEL_REGISTRY
    # the real checkpoint's config.json spells the expert count num_experts
    d = {**hf.config.to_dict(), "num_experts": 128}
    d.pop("num_local_experts", None)
    assert ModelArchConfig.from_hf(d).num_experts == 128
    dense = arch_of(make_tiny_hf_model("qwen3"))
    assert dense.num_experts == 0 and dense.mlp_only_layers == () and dense.shared_expert_intermediate_size is None


def test_loads_per_expert_and_transposed_stacked_names(tiny_moe):
    hf, model = tiny_moe
    ids = prompt(9, seed=5)
    ref = run_paged(model, [ids], 4).prompt_logits[0]
    # per-expert names (what checkpoints on disk hold)
    per_expert = per_expert_state_dict(hf)
    assert any(".mlp.experts.7.down_proj.weight" in n for n in per_expert)
    m2 = build_model(model.arch, per_expert.items())
    torch.testing.assert_close(run_paged(m2, [ids], 4).prompt_logits[0], ref, atol=0, rtol=0)
    # stacked, transposed ([E, H, 2I] and [E, I, H]); I=16 so that 2I != H and I != H (else ambiguous: the
    # untransposed layout, the one this transformers saves, wins)
    hf16 = make_tiny_hf_model("qwen3_moe", seed=4, moe_intermediate_size=16)
    want = run_paged(conveyor_from_hf(hf16), [ids], 4)
    transposed = {n: (t.transpose(1, 2).contiguous() if ".mlp.experts." in n else t)
                  for n, t in hf16.state_dict().items()}
    assert any(t.shape[1:] == (64, 32) for n, t in transposed.items() if n.endswith("experts.gate_up_proj"))
    got = run_paged(build_model(arch_of(hf16), transposed.items()), [ids], 4)
    torch.testing.assert_close(got.prompt_logits[0], want.prompt_logits[0], atol=0, rtol=0)
    assert got.generated == want.generated
    # missing expert weights are reported
    partial = {n: t for n, t in per_expert.items() if ".experts.3.up_proj" not in n}
    with pytest.raises(ValueError, match=r"missing weights: .*experts\.3\.up_proj"):
        build_model(model.arch, partial.items())
    with pytest.raises(KeyError, match="unknown"):
        build_model(model.arch, [*hf.state_dict().items(), ("model.layers.1.mlp.experts.bogus", torch.zeros(1))])


def _block(seed=0, **kw):
    args = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2, norm_topk_prob=True)
    args.update(kw)
    block = SparseMoeBlock(**args)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return block


def test_local_expert_subsets_sum_to_full():
    full = _block(seed=4)
    halves = [_block(expert_offset=0, num_local_experts=4), _block(expert_offset=4, num_local_experts=4)]
    sd = {"gate.weight": full.gate.weight.detach(), "experts.gate_up_proj": full.w13.detach(),
          "experts.down_proj": full.w2.detach()}
    for half in halves:
        for name, t in sd.items():
            assert half.load_expert_weight(name, t)
        assert half.missing_weights() == []
    # per-expert names outside the local range are skipped
    assert not halves[0].load_expert_weight("experts.5.gate_proj.weight", torch.zeros(32, 64))
    assert halves[1].load_expert_weight("experts.5.gate_proj.weight", full.w13.detach()[5, :32])
    torch.testing.assert_close(halves[1].w13[1], full.w13[5], atol=0, rtol=0)

    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    w, ids = full.route(x)
    assert w.dtype == torch.float32 and ids.shape == (37, 2)
    torch.testing.assert_close(w.sum(-1), torch.ones(37))
    parts = []
    for half in halves:
        hw, hids = half.route(x)
        assert torch.equal(hids, ids)
        parts.append(half.experts(x, hw, hids))
    assert all(p.abs().sum() > 0 for p in parts)
    torch.testing.assert_close(parts[0] + parts[1], full(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.combine(parts[0] + parts[1]), full(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared_size", [48, 32])  # 32 = the routed size: folded in as one more expert
def test_shared_expert_block_matches_qwen3_next(shared_size):
    try:
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    except ImportError as e:
        pytest.skip(f"transformers has no Qwen3-Next sparse MoE block: {e}")
    for norm in (True, False):
        cfg = Qwen3NextConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=shared_size,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm, hidden_act="silu")
        torch.manual_seed(0)
        ref = Qwen3NextSparseMoeBlock(cfg).float().eval()
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        block = SparseMoeBlock(64, 32, 8, 2, norm, shared_expert_intermediate_size=shared_size)
        assert block.fold_shared == (shared_size == 32) and (block.shared_expert is None) == block.fold_shared
        sd = ref.state_dict()
        assert {"shared_expert_gate.weight", "shared_expert.gate_proj.weight", "gate.weight"} <= set(sd)
        # the per-expert names too, for a second copy
        block2 = SparseMoeBlock(64, 32, 8, 2, norm, shared_expert_intermediate_size=shared_size)
        for name, t in sd.items():
            assert block.load_expert_weight(name, t)
        for name, t in per_expert_state_dict_block(sd).items():
            assert block2.load_expert_weight(name, t)
        assert block.missing_weights() == [] and block2.missing_weights() == []
        x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = ref(x).reshape(33, 64)
        torch.testing.assert_close(block(x.reshape(33, 64)), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(block2(x.reshape(33, 64)), want, atol=1e-5, rtol=1e-5)


def _shared_weights(seed: int = 3, experts: int = 8) -> dict[str, torch.Tensor]:
    """HF-named weights of a 64-wide block with 8 routed experts of size 32 and a shared expert of size 32."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate.weight": (experts, 64), "shared_expert_gate.weight": (1, 64),
              "shared_expert.gate_proj.weight": (32, 64), "shared_expert.up_proj.weight": (32, 64),
              "shared_expert.down_proj.weight": (64, 32), "experts.gate_up_proj": (experts, 64, 64),
              "experts.down_proj": (experts, 64, 32)}
    return {n: torch.randn(shape, generator=gen) / 8 for n, shape in shapes.items()}


def _loaded_block(weights, fold=True, **kw) -> SparseMoeBlock:
    block = SparseMoeBlock(64, 32, 8, 2, kw.pop("norm", True), shared_expert_intermediate_size=32,
                           fold_shared_expert=fold, **kw)
    for name, t in weights.items():
        block.load_expert_weight(name, t)
    assert block.missing_weights() == []
    return block


@pytest.mark.parametrize("norm", [True, False])
def test_folded_shared_expert_equals_the_separate_one(norm):
    """Same weights, same output: the shared expert as one more routed slot or as its own MLP after the experts."""
    weights = _shared_weights()
    folded, sep = _loaded_block(weights, norm=norm), _loaded_block(weights, fold=False, norm=norm)
    assert folded.fold_shared and folded.shared_expert is None and folded.w13.shape[0] == 9
    assert not sep.fold_shared and sep.shared_expert is not None and sep.w13.shape[0] == 8
    assert folded.gate.weight.shape == (16, 64) and sep.gate.weight.shape == (8, 64)  # 9 rows padded to 8k
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        w, ids = folded.route(x)
        assert w.shape == ids.shape == (9, 3) and (ids[:, 2] == 8).all()
        torch.testing.assert_close(w[:, 2], torch.sigmoid(sep.shared_expert_gate(x)).squeeze(1))
        sep_w, sep_ids = sep.route(x)
        assert torch.equal(ids[:, :2], sep_ids) and torch.equal(w[:, :2], sep_w)
        want = sep(x)
        torch.testing.assert_close(folded(x), want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(sep.combine(sep.experts(x, sep_w, sep_ids)), want)  # the shared term counts


def test_shared_expert_names_fill_the_folded_tensors():
    """The HF names, per-expert or stacked and in any order, land in expert 8 of w13 / w2 and router row 8."""
    weights = _shared_weights()
    per_expert = per_expert_state_dict_block(weights)
    for order in (list(weights.items()), list(reversed(weights.items())), list(reversed(per_expert.items()))):
        block = SparseMoeBlock(64, 32, 8, 2, True, shared_expert_intermediate_size=32)
        assert "shared_expert.down_proj.weight" in block.missing_weights()
        for name, t in order:
            assert block.load_expert_weight(name, t)
        assert block.missing_weights() == []
        torch.testing.assert_close(block.w13[8, :32], weights["shared_expert.gate_proj.weight"], atol=0, rtol=0)
        torch.testing.assert_close(block.w13[8, 32:], weights["shared_expert.up_proj.weight"], atol=0, rtol=0)
        torch.testing.assert_close(block.w2[8], weights["shared_expert.down_proj.weight"], atol=0, rtol=0)
        torch.testing.assert_close(block.gate.weight[8:9], weights["shared_expert_gate.weight"], atol=0, rtol=0)
        assert not block.gate.weight[9:].any()  # the alignment rows
        torch.testing.assert_close(block.gate.weight[:8], weights["gate.weight"], atol=0, rtol=0)
        torch.testing.assert_close(block.w13[:8], weights["experts.gate_up_proj"], atol=0, rtol=0)
        torch.testing.assert_close(block.w2[:8], weights["experts.down_proj"], atol=0, rtol=0)
    with pytest.raises(ValueError, match="shared_expert.up_proj"):
        block.load_expert_weight("shared_expert.up_proj.weight", torch.zeros(48, 64))
    with pytest.raises(KeyError):
        block.load_expert_weight("shared_expert.bogus.weight", torch.zeros(32, 64))


@pytest.mark.parametrize("fold", [True, False])
def test_expert_parallel_ranks_add_the_shared_expert_once(fold):
    """Experts [0, 4) and [4, 8) on two blocks: only the one holding the last expert holds (and adds) the shared
    expert, the other skips its weights; both route alike; the two forwards sum to the one-block output."""
    weights = _shared_weights(seed=5)
    full = _loaded_block(weights, fold)
    ranks = [_loaded_block(weights, fold, expert_offset=o, num_local_experts=4) for o in (0, 4)]
    assert not ranks[0].holds_shared and ranks[1].holds_shared
    assert ranks[0].w13.shape[0] == 4 and ranks[1].w13.shape[0] == 4 + fold
    assert (ranks[1].shared_expert is None) == fold and ranks[0].shared_expert is None
    assert not ranks[0].load_expert_weight("shared_expert.down_proj.weight", weights["shared_expert.down_proj.weight"])
    assert ranks[0].load_expert_weight("shared_expert_gate.weight", weights["shared_expert_gate.weight"]) == fold
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        w, ids = full.route(x)
        for rank in ranks:
            rank_w, rank_ids = rank.route(x)
            assert torch.equal(rank_ids, ids) and torch.equal(rank_w, w)
        parts = [rank(x) for rank in ranks]
        assert all(p.abs().sum() > 0 for p in parts)
        torch.testing.assert_close(parts[0] + parts[1], full(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 50])  # 3 slots a token: 1 takes the decode kernels, 50 the grouped GEMMs
def test_folded_block_on_the_triton_kernels(monkeypatch, t):
    """The folded block's route and experts on the Triton kernels (the interpreter on CPU) equal the separate
    block on the torch references."""
    from kernels import moe, triton_compat

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if triton_compat.triton is None or not (interpret or torch.cuda.is_available()):
        pytest.skip("needs triton (GPU or TRITON_INTERPRET=1)")
    device = "cpu" if interpret else "cuda"
    weights = _shared_weights(seed=7)
    folded, sep = _loaded_block(weights).to(device), _loaded_block(weights, fold=False)
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = sep(x).to(device)  # on CPU: the torch references
        x = x.to(device)
        monkeypatch.setattr("kernels.dispatch.use_triton", lambda device: True)
        ids = folded.route(x)[1]
        assert ids.dtype == torch.int32 and ids.shape == (t, 3)  # the Triton routing kernel's ids
        assert (ids.numel() <= moe.DECODE_SLOTS) == (t == 1)
        torch.testing.assert_close(folded(x), want, atol=1e-5, rtol=1e-5)


def per_expert_state_dict_block(sd):
    out = {}
    for name, t in sd.items():
        if name == "experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"experts.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("shared_size", [48, 32])  # separate; folded into the experts
def test_dummy_weights_fill_moe_parameters(shared_size):
    # Qwen3-MoE has no shared expert; add one to exercise the block's
    arch = dataclasses.replace(arch_of(make_tiny_hf_model("qwen3_moe")), shared_expert_intermediate_size=shared_size)
    model = build_model(arch, None, prepack=False)
    block = model.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and block.fold_shared == (shared_size == 32)
    names = ("w13", "w2", "gate.weight") + (() if block.fold_shared else (
        "shared_expert_gate.weight", "shared_expert.gate_up_proj.weight"))
    for name in names:
        p = block.get_parameter(name)
        assert torch.isfinite(p).all() and 0.01 < p.std() < 0.03, name
    out = run_paged(build_model(arch, None), [prompt(7)], 3)
    assert torch.isfinite(out.prompt_logits[0]).all() and len(out.generated[0]) == 3


def test_batch_invariance(tiny_moe):
    _, model = tiny_moe
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate([13, 5, 21, 9])]
    alone = run_paged(model, [prompts[2]], 16)
    batch = run_paged(model, prompts, 16, chunks=[4, 7])
    assert "mixed" in batch.step_kinds
    assert batch.generated[2] == alone.generated[0]
    torch.testing.assert_close(batch.prompt_logits[2], alone.prompt_logits[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.stack(batch.decode_logits[2]), torch.stack(alone.decode_logits[0]),
                               atol=1e-4, rtol=1e-5)
