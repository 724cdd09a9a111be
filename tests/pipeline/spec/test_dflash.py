"""The DFlash drafter (pipeline/models/dflash.py, pipeline/spec/dflash.py): its drafts against the block model
computed from scratch on transformers' own hidden states of the target, over rounds of partly accepted drafts, on
a dense and a hybrid target; then through the engine, where the output equals plain decoding at batches 1..8."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pipeline.models.attention import build_attention_metadata
from pipeline.models.config import ModelArchConfig
from pipeline.models.dflash import ContextTap, DFlashDraftModel, dflash_arch, dflash_config
from pipeline.models.forward_context import ForwardContext
from pipeline.models.loader import iter_weights, load_hf_config
from pipeline.models.registry import build_model
from pipeline.runner.model_runner import ModelRunner
from pipeline.spec.dflash import DFlashDrafter
from tests.conftest import run_async
from tests.model_utils import write_dflash_drafter
from tests.pipeline.spec.test_model_drafters import EagerReplay, greedy, prompts, run

pytestmark = pytest.mark.usefixtures("single_torch_thread")

HYBRID = "qwen3_5_moe_text"
MASK = 49000


@pytest.fixture(scope="module")
def targets(make_model_dir, tmp_path_factory) -> dict[str, tuple[object, object]]:
    """kind -> (target directory, its DFlash drafter's directory)."""
    made = {}
    for kind, model_type, layers, tapped in (("dense", "llama", 3, [0, 1]), ("hybrid", HYBRID, 4, [0, 2])):
        target = make_model_dir(model_type, seed=7, num_hidden_layers=layers)
        drafter = tmp_path_factory.mktemp(f"dflash-{kind}")
        write_dflash_drafter(drafter, json.loads((target / "config.json").read_text()), tapped, seed=3)
        made[kind] = (target, drafter)
    return made


def reference_drafts(hf_target, weights: dict[str, torch.Tensor], config: dict, tokens: list[int],
                     k: int) -> list[int]:
    """DFlash from its description, on transformers' hidden states of the target over every token but the last:
    the tapped layers' outputs through fc and hidden_norm are extra keys/values of each draft layer (k_proj, k_norm,
    rope; v_proj), the block [last token, mask x k] attends to all of them and to itself, unmasked."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3RotaryEmbedding, rotate_half

    eps = config["rms_norm_eps"]

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weights[name]

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [T, heads, D]
        return x * cos[:, None] + rotate_half(x) * sin[:, None]

    n = len(tokens) - 1
    with torch.no_grad():
        out = hf_target(torch.tensor([tokens[:n]]), output_hidden_states=True)
        layers = config["dflash_config"]["target_layer_ids"]
        context = norm(torch.cat([out.hidden_states[i + 1][0] for i in layers], -1) @ weights["fc.weight"].T,
                       "hidden_norm.weight")
        x = hf_target.get_input_embeddings()(torch.tensor([tokens[-1]] + [MASK] * k))
        rotary = Qwen3RotaryEmbedding(Qwen3Config(**{key: v for key, v in config.items() if key != "dflash_config"}))
        cos, sin = (t[0] for t in rotary(x[None], torch.arange(n + k + 1)[None]))
        heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        for i in range(config["num_hidden_layers"]):
            p = f"layers.{i}."
            h = norm(x, p + "input_layernorm.weight")
            q = rope(norm((h @ weights[p + "self_attn.q_proj.weight"].T).view(k + 1, heads, dim),
                          p + "self_attn.q_norm.weight"), cos[n:], sin[n:])
            both = torch.cat([context, h])
            keys = rope(norm((both @ weights[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim),
                             p + "self_attn.k_norm.weight"), cos, sin).repeat_interleave(heads // kv_heads, 1)
            values = (both @ weights[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
            values = values.repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) * dim ** -0.5
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(k + 1, heads * dim)
            x = x + attended @ weights[p + "self_attn.o_proj.weight"].T
            h = norm(x, p + "post_attention_layernorm.weight")
            gate, up = h @ weights[p + "mlp.gate_proj.weight"].T, h @ weights[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ weights[p + "mlp.down_proj.weight"].T
        logits = hf_target.lm_head(norm(x, "norm.weight")[1:])
    return logits.argmax(-1).tolist()


def load_target_and_drafter(target_dir, drafter_dir) -> tuple[torch.nn.Module, ModelRunner, DFlashDrafter]:
    arch = ModelArchConfig.from_hf(load_hf_config(str(target_dir)))
    model = build_model(arch, iter_weights(str(target_dir)), torch.float32, "cpu")
    hf = load_hf_config(str(drafter_dir))
    draft = DFlashDraftModel(dflash_arch(hf), dflash_config(hf, arch), torch.float32)
    draft.load_weights(iter_weights(str(drafter_dir)))
    first = len(model.cache_specs(torch.float32))
    model.layer_tap = ContextTap(draft, first)
    runner = ModelRunner(model, vocab_size=arch.vocab_size, block_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), max_num_seqs=2, extra_cache_specs=draft.cache_specs(torch.float32))
    runner.allocate_caches(40)
    return model, runner, DFlashDrafter(draft, model, runner, first, 4)


@pytest.mark.parametrize("replayed", [False, True])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_dflash_drafts_equal_the_block_model_from_scratch(targets, kind, replayed):
    """Rounds of drafting on a sequence whose target forwards write the context K/V (the layer tap): each round's
    drafts equal DFlash computed from scratch on transformers' hidden states. A round after drafts were partly
    accepted reads context the target wrote over the last round's block K/V. Replayed: the block forward goes the
    way of the CUDA graphs (one row per block position), run eagerly."""
    from transformers import AutoModelForCausalLM

    target_dir, drafter_dir = targets[kind]
    model, runner, drafter = load_target_and_drafter(target_dir, drafter_dir)
    if replayed:
        drafter.graphs = EagerReplay(drafter.block, runner.caches[drafter.caches], 1)
    hf_target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    weights = dict(iter_weights(str(drafter_dir)))
    config = load_hf_config(str(drafter_dir))
    seq = SimpleNamespace(token_ids=[7, 300, 4000, 51, 9000, 12, 613], block_ids=list(range(1, 10)), preemptions=0,
                          draft_history=None)
    states = torch.ones(1, dtype=torch.int32)

    def target(start: int, end: int) -> None:  # the target feeds positions start .. end - 1
        meta = build_attention_metadata([end - start], [end], [seq.block_ids], 4)
        model(torch.tensor(seq.token_ids[start:end]), torch.arange(start, end),
              ForwardContext(meta, runner.caches, state_slots=states))

    target(0, 6)  # the prompt but its last token (decode feeds that)
    first = drafter.draft(drafter.plan([(seq, 4)]))[0]
    assert len(first) == 4 and first == reference_drafts(hf_target, weights, config, seq.token_ids, 4)
    seq.token_ids += first[:2] + [77]  # two drafts accepted, then another token
    target(6, 9)  # the verify row's positions that were kept
    second = drafter.draft(drafter.plan([(seq, 5)]))[0]  # (at most block_size - 1 = 5 drafts)
    assert second == reference_drafts(hf_target, weights, config, seq.token_ids, 5)
    seq.token_ids += [second[0] + 1]  # none accepted
    target(9, 10)
    third = drafter.draft(drafter.plan([(seq, 9)]))[0]
    assert third == reference_drafts(hf_target, weights, config, seq.token_ids, 5)
    if replayed:
        assert drafter.graphs.replays == 3


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_dflash_speculation_equals_plain_decoding(targets, kind, batch_size):
    target_dir, drafter_dir = targets[kind]
    batch = prompts(batch_size)
    params = [greedy() for _ in batch]
    plain, _ = run_async(run(target_dir, batch, params))
    spec, stats = run_async(run(target_dir, batch, params, speculative_method="dflash",
                                speculative_model=str(drafter_dir), num_speculative_tokens=4))
    counted = stats["speculation"]
    assert spec == plain and counted["method"] == "dflash" and counted["drafted_tokens"] > 0
    assert counted["device_drafts"] > 0  # verify rows fed the drafts on the device


def test_dflash_configs_are_checked(targets, tmp_path):
    target_dir, _ = targets["dense"]
    arch = ModelArchConfig.from_hf(load_hf_config(str(target_dir)))
    base = json.loads((targets["dense"][1] / "config.json").read_text())
    with pytest.raises(ValueError, match="mask_token_id"):
        dflash_config({**base, "dflash_config": {"target_layer_ids": [0]}}, arch)
    with pytest.raises(ValueError, match="target_layer_ids"):
        dflash_config({**base, "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": MASK}}, arch)
    with pytest.raises(ValueError, match="hidden size"):
        dflash_config({**base, "hidden_size": 32}, arch)
    with pytest.raises(ValueError, match="vocabulary"):
        dflash_config({**base, "dflash_config": {"mask_token_id": 10 ** 6}}, arch)
    # without target_layer_ids: the reference's spread over the target's layers
    assert dflash_config({**base, "dflash_config": {"mask_token_id": MASK}, "num_hidden_layers": 1},
                         arch).target_layer_ids == (1,)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_gpu_dflash_through_cuda_graphs(targets, kind):
    """On CUDA (fp32): the target's graphs write the context K/V through the layer tap, the block forward replays
    its own graphs; the tokens are plain decoding's."""
    target_dir, drafter_dir = targets[kind]
    batch = prompts(4)
    params = [greedy(120) for _ in batch]
    plain, _ = run_async(run(target_dir, batch, params, device="cuda"))
    got, stats = run_async(run(target_dir, batch, params, device="cuda", speculative_method="dflash",
                               speculative_model=str(drafter_dir), num_speculative_tokens=4))
    assert got == plain and stats["speculation"]["drafted_tokens"] > 0
