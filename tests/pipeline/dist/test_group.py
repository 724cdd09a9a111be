"""Expert parallelism (pipeline/dist/group.py): the experts' split over ranks, and a model whose MoE blocks hold half
the experts each on two gloo processes giving the one-process model's logits and greedy tokens, on a Qwen3-MoE and
a hybrid Qwen3.5-MoE (its shared expert folded in, held by the last rank)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from pipeline.models.config import ModelArchConfig
from pipeline.models.loader import iter_weights, load_hf_config
from pipeline.models.registry import build_model
from pipeline.dist.group import ExpertGroup, ExpertShard
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


def run_model(model_dir: str, shard: ExpertShard, group: ExpertGroup | None,
              split: bool = False) -> tuple[list, list, list[int]]:
    """Greedy tokens, logits, and each Gated DeltaNet layer's value heads (``split``: the layers keep the shard's
    heads too)."""
    arch = dataclasses.replace(ModelArchConfig.from_hf(load_hf_config(model_dir)), expert_shard=shard,
                               linear_head_shard=shard if split else ExpertShard())
    model = build_model(arch, iter_weights(model_dir), torch.float32, "cpu")
    if group is not None:
        model.join_expert_group(group)
    out = run_paged(model, PROMPTS, NEW_TOKENS, chunks=3)
    heads = [m.num_v_heads for m in model.modules() if type(m).__name__ == "GatedDeltaNet"]
    return out.generated, [torch.stack(steps) for steps in out.decode_logits] + out.prompt_logits, heads


def _rank(rank: int, model_dir: str, store: str, result: str, split: bool = False) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = ExpertGroup(ExpertShard(rank, 2))
        generated, logits, heads = run_model(model_dir, group.shard, group, split)
        torch.save({"generated": generated, "logits": logits, "calls": group.calls, "value_heads": heads},
                   f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_type,split", [("qwen3_moe", False), ("qwen3_5_moe_text", False),
                                              ("qwen3_5_moe_text", True)])
def test_two_ranks_holding_half_the_experts_each_equal_one(make_model_dir, tmp_path, model_type, split):
    """``split``: each rank also keeps half of every Gated DeltaNet layer's heads (and sums its partial output)."""
    model_dir = str(make_model_dir(model_type, seed=9, num_experts=8))
    generated, logits, heads = run_model(model_dir, ExpertShard(), None)
    result = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(model_dir, str(tmp_path / "store"), result, split), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(f"{result}.{rank}") for rank in range(2)]
    for got in ranks:  # every rank computes the whole forward: the same tokens and logits
        assert got["generated"] == generated
        for mine, one in zip(got["logits"], logits):
            torch.testing.assert_close(mine, one, rtol=1e-4, atol=1e-4)
    assert ranks[0]["calls"] == ranks[1]["calls"] > 0
    if split:  # each rank kept half of every Gated DeltaNet layer's value heads
        assert ranks[0]["value_heads"] == ranks[1]["value_heads"] == [h // 2 for h in heads] and heads


def test_one_rank_calls_no_collective(make_model_dir, monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective on one rank")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    run_model(str(make_model_dir("qwen3_moe", seed=9, num_experts=8)), ExpertShard(), None)


def _head_or_worker(rank: int, model_dir: str, store: str, result: str) -> None:
    """Rank 0 plans steps (a prompt in chunks, then greedy decode, a hybrid state slot a sequence) and sends each to
    rank 1 as a message before running it; rank 1 runs them as a Worker."""
    import torch.distributed as dist

    from pipeline.memory.state_slots import StateSlot
    from pipeline.runner.model_runner import ModelRunner
    from pipeline.dist.step_message import MessageKind, StepMessage
    from pipeline.runner.step_plan import ScheduledChunk, build_step_plan
    from pipeline.dist.comm import send_message
    from pipeline.dist.worker import Worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = ExpertGroup(ExpertShard(rank, 2))
        arch = dataclasses.replace(ModelArchConfig.from_hf(load_hf_config(model_dir)), expert_shard=group.shard)
        model = build_model(arch, iter_weights(model_dir), torch.float32, "cpu")
        model.join_expert_group(group)
        runner = ModelRunner(model, vocab_size=arch.vocab_size, block_size=4, dtype=torch.float32,
                             device=torch.device("cpu"), max_num_seqs=4)
        runner.allocate_caches(48)
        if rank == 1:
            worker = Worker(runner)
            worker.run()
            torch.save({"steps": worker.steps}, f"{result}.1")
            return
        slots = [StateSlot(1, 1), StateSlot(2, 2)]
        number = 0

        def send(message: StepMessage) -> None:
            nonlocal number
            send_message(message)
            number += 1

        send(StepMessage(MessageKind.ALLOCATE, number, np.array([1, 2], dtype=np.int32), np.array([1, 2])))
        tokens = [list(p) for p in PROMPTS]
        computed = [0, 0]
        tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(2)]
        while any(len(t) < len(p) + NEW_TOKENS for t, p in zip(tokens, PROMPTS)):
            chunks = []
            for i, seq in enumerate(tokens):
                end = min(len(seq), computed[i] + 3)
                chunks.append(ScheduledChunk(seq[computed[i]:end], computed[i], tables[i], ["r"],
                                             state_slot=slots[i]))
            plan = build_step_plan(chunks, 4, [s.index for s in slots])
            send(StepMessage(MessageKind.STEP, number, epochs=np.array([s.epoch for s in slots]),
                             forward=plan.forward))
            logits = runner.compute_logits(plan.forward)
            for i, chunk in enumerate(chunks):
                computed[i] += len(chunk.token_ids)
                if computed[i] == len(tokens[i]) and len(tokens[i]) < len(PROMPTS[i]) + NEW_TOKENS:
                    tokens[i].append(int(logits[i].argmax()))
        send(StepMessage(MessageKind.STOP, number))
        torch.save({"generated": [t[len(p):] for t, p in zip(tokens, PROMPTS)], "steps": number - 2}, f"{result}.0")
    finally:
        dist.destroy_process_group()


def test_a_worker_runs_the_heads_steps_from_its_messages(make_model_dir, tmp_path):
    """Two ranks, the second driven only by the head's messages: the head's greedy tokens are the one-rank
    model's, and the worker ran every step."""
    model_dir = str(make_model_dir("qwen3_5_moe_text", seed=9, num_experts=8))
    generated, _, _ = run_model(model_dir, ExpertShard(), None)
    result = str(tmp_path / "rank")
    mp.start_processes(_head_or_worker, args=(model_dir, str(tmp_path / "store"), result), nprocs=2,
                       start_method="spawn")
    head, worker = (torch.load(f"{result}.{rank}") for rank in range(2))
    assert head["generated"] == generated
    assert worker["steps"] == head["steps"] > NEW_TOKENS
