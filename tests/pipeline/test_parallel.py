"""Expert parallelism (pipeline/parallel.py): the experts' split over ranks, and a model whose MoE blocks hold half
the experts each on two gloo processes giving the one-process model's logits and greedy tokens, on a Qwen3-MoE and
a hybrid Qwen3.5-MoE (its shared expert folded in, held by the last rank)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.models.config import ModelArchConfig
from pipeline.models.loader import iter_weights, load_hf_config
from pipeline.models.registry import build_model
from pipeline.parallel import ExpertGroup, ExpertShard
from tests.model_utils import run_paged

PROMPTS = [[11, 900, 4000, 57, 23, 6000, 812], [3, 17, 250, 9999, 42]]
NEW_TOKENS = 12


def test_every_expert_has_one_rank():
    for experts in (8, 10, 128):
        for size in range(1, 6):
            held = [ExpertShard(rank, size).experts(experts) for rank in range(size)]
            assert [first for first, _ in held] == [sum(n for _, n in held[:r]) for r in range(size)]
            assert sum(n for _, n in held) == experts and max(n for _, n in held) - min(n for _, n in held) <= 1
    with pytest.raises(ValueError):
        ExpertShard(2, 2)
    with pytest.raises(ValueError):
        ExpertShard(0, 9).experts(8)


def run_model(model_dir: str, shard: ExpertShard, group: ExpertGroup | None) -> tuple[list, list]:
    arch = dataclasses.replace(ModelArchConfig.from_hf(load_hf_config(model_dir)), expert_shard=shard)
    model = build_model(arch, iter_weights(model_dir), torch.float32, "cpu")
    if group is not None:
        model.join_expert_group(group)
    out = run_paged(model, PROMPTS, NEW_TOKENS, chunks=3)
    return out.generated, [torch.stack(steps) for steps in out.decode_logits] + out.prompt_logits


def _rank(rank: int, model_dir: str, store: str, result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = ExpertGroup(ExpertShard(rank, 2))
        generated, logits = run_model(model_dir, group.shard, group)
        torch.save({"generated": generated, "logits": logits, "calls": group.calls}, f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe_text"])
def test_two_ranks_holding_half_the_experts_each_equal_one(make_model_dir, tmp_path, model_type):
    model_dir = str(make_model_dir(model_type, seed=9, num_experts=8))
    generated, logits = run_model(model_dir, ExpertShard(), None)
    result = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(model_dir, str(tmp_path / "store"), result), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{result}.{rank}") for rank in range(2)]
    for got in ranks:  # every rank computes the whole forward: the same tokens and logits
        assert got["generated"] == generated
        for mine, one in zip(got["logits"], logits):
            torch.testing.assert_close(mine, one, rtol=1e-4, atol=1e-4)
    assert ranks[0]["calls"] == ranks[1]["calls"] > 0


def test_one_rank_calls_no_collective(make_model_dir, monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective on one rank")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    run_model(str(make_model_dir("qwen3_moe", seed=9, num_experts=8)), ExpertShard(), None)
