"""Programmatic dependent launch (``kernels/triton_compat.py``): off where it cannot run, and on the GPU a decode
step whose kernels start early gives the same logits on every replay (a kernel that read another's output before
its wait would make them vary) and the logits of ordinary launches."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_compat


def test_pdl_is_off_on_the_cpu_and_under_the_interpreter():
    assert triton_compat.pdl_launch(torch.zeros(1)) == {}
    if triton_compat.INTERPRET and torch.cuda.is_available():
        assert triton_compat.pdl_launch(torch.zeros(1, device="cuda")) == {}


def test_l2_hints_are_off_on_the_cpu_and_span_at_most_the_cap():
    weight = torch.zeros(64, 8, dtype=torch.bfloat16)
    assert not triton_compat.l2_hints(weight)
    assert triton_compat.hint_span(None, weight) == (weight, 0)
    assert triton_compat.hint_span(weight, None) == (weight, 64 * 8 * 2)
    big = torch.empty(triton_compat.L2_HINT_MAX_BYTES + 64, dtype=torch.uint8)
    assert triton_compat.hint_span(big, None)[1] == triton_compat.L2_HINT_MAX_BYTES
    assert triton_compat.hint_span(torch.empty(23, dtype=torch.uint8), None)[1] == 16  # whole 16-byte units
    with pytest.raises(ValueError, match="contiguous"):
        triton_compat.hint_span(weight.t(), None)


def test_a_sparse_block_hints_the_next_layers_input_projection():
    from pipeline.models.registry import build_model
    from tests.model_utils import arch_of, make_tiny_hf_model

    for model_type in ("qwen3_moe", "qwen3_5_moe_text"):
        hf = make_tiny_hf_model(model_type)
        layers = build_model(arch_of(hf), hf.state_dict().items(), dtype=torch.float32, prepack=False).model.layers
        for layer, following in zip(layers, list(layers)[1:]):
            mixer = getattr(following, "linear_attn", None) or following.self_attn
            assert layer.mlp.next_weight() is mixer.input_proj.weight
        assert layers[-1].mlp.next_weight is None


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe_text"])
@pytest.mark.parametrize("early", ["none", "conv", "l2"])
def test_decode_step_with_dependent_launch_is_deterministic_and_matches_plain_launches(model_type, early, monkeypatch):
    """``early``: also the GDN conv inside the delta-rule kernel (``gated_delta_net.CONV_IN_DELTA_RULE``), or the L2
    weight hints (``triton_compat.l2_hints``)."""
    from pipeline.models import gated_delta_net
    from pipeline.runner.model_runner import ModelRunner
    from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
    from tests.model_utils import SMOLLM2_VOCAB, conveyor_from_hf, make_tiny_hf_model

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("dependent launch needs Hopper or later")
    monkeypatch.setattr(gated_delta_net, "CONV_IN_DELTA_RULE", early == "conv")
    monkeypatch.setattr(triton_compat, "_L2_HINTS", early == "l2")
    device = torch.device("cuda")

    def decode_logits(pdl: bool, replays: int) -> list[torch.Tensor]:
        monkeypatch.setattr(triton_compat, "_pdl_supported", lambda index: pdl)
        model = conveyor_from_hf(make_tiny_hf_model(model_type, seed=4), dtype=torch.bfloat16, device=device)
        runner = ModelRunner(model, vocab_size=SMOLLM2_VOCAB, block_size=16, dtype=torch.bfloat16, device=device,
                             max_num_seqs=4)
        runner.allocate_caches(64)
        prompts = [[300 + 11 * b + i for i in range(17 + 5 * b)] for b in range(2)]
        tables = [list(range(1 + 4 * b, 5 + 4 * b)) for b in range(2)]
        slots = [1, 2]
        runner.execute(build_step_plan([ScheduledChunk(p, 0, t, []) for p, t in zip(prompts, tables)], 16, slots))
        runner.capture_decode_graphs(max_batch=4, max_model_len=64)
        results = []
        for batch in (1, 2):  # one row: the single-row GEMVs and MoE decode kernels; two: the rest
            chunks = [ScheduledChunk([9 + b], len(p), t, [None]) for b, (p, t) in
                      enumerate(zip(prompts[:batch], tables[:batch]))]
            forward = build_step_plan(chunks, 16, slots[:batch]).forward
            before = [c.clone() for c in runner.caches]
            assert runner.prepare(forward).graph
            for _ in range(replays):
                for cache, saved in zip(runner.caches, before):
                    cache.copy_(saved)
                results.append(runner.compute_logits(forward).clone())
            for cache, saved in zip(runner.caches, before):
                cache.copy_(saved)
        return results

    early = decode_logits(True, replays=8)
    for logits in early[1:8]:
        assert torch.equal(logits, early[0])
    for logits in early[9:]:
        assert torch.equal(logits, early[8])
    plain = decode_logits(False, replays=1)
    for ours, ref in zip((early[0], early[8]), plain):
        torch.testing.assert_close(ours.float(), ref.float(), atol=0.05 * ref.float().abs().max().item(), rtol=0.05)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
