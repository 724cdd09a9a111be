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


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe_text"])
def test_decode_step_with_dependent_launch_is_deterministic_and_matches_plain_launches(model_type, monkeypatch):
    from pipeline.runner.model_runner import ModelRunner
    from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
    from tests.model_utils import SMOLLM2_VOCAB, conveyor_from_hf, make_tiny_hf_model

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("dependent launch needs Hopper or later")
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
