"""An expert-parallel worker: a rank holding its share of the experts beside replicated dense layers and caches. It
takes the head's messages (pipeline/dist/step_message.py, sent by the comm stage, pipeline/dist/comm.py), checks
each against its slot ledger, and runs a step's device copies and forward as the head does, so every MoE block's
all-reduce meets its peers'. It samples nothing and keeps no KV tiers: what the head's tiers restore, and the
tokens a step feeds from the previous one, arrive from the head's device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import envs
from pipeline.config import EngineConfig
from pipeline.cpu_threads import set_cpu_threads
from pipeline.dist.comm import receive_message, share_rows, share_tokens
from pipeline.dist.ranks import Rendezvous, end_with_parent, join_group
from pipeline.dist.step_message import MessageKind, SlotLedger, StepMessage
from pipeline.loading import load_model
from pipeline.memory.block_transfers import BlockTransfers, run_block_transfers

if TYPE_CHECKING:
    from pipeline.runner.model_runner import ModelRunner


def _pairs(array) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in array.tolist()]


class Worker:
    def __init__(self, runner: ModelRunner, messages: Any = None, data: Any = None) -> None:
        self.runner = runner  # a ModelRunner over this rank's shard (ModelArchConfig.expert_shard), caches allocated
        self.ledger = SlotLedger(max(0, runner.num_state_slots - 1))
        self.messages = messages  # the head's message group (None: the default one)
        self.data = data  # the device bytes' group (None: the default one)
        self.steps = 0

    @torch.inference_mode()
    def apply(self, message: StepMessage) -> bool:
        """Check and run one message; False once the head stops."""
        self.ledger.accept(message)
        if message.kind is MessageKind.STOP:
            return False
        if message.kind is not MessageKind.STEP:
            return True
        runner = self.runner
        if len(message.block_copies):
            run_block_transfers(BlockTransfers(None, copies=_pairs(message.block_copies)), runner.paged_caches)
        share_rows(runner.paged_caches, 1, message.loaded_blocks, False, self.data)
        share_rows(runner.snapshots, 0, message.loaded_snapshots, False, self.data)
        if len(message.state_copies) or len(message.state_saves) or len(message.state_loads):
            states = BlockTransfers(None, state_copies=_pairs(message.state_copies),
                                    state_saves=_pairs(message.state_saves), state_loads=_pairs(message.state_loads))
            run_block_transfers(states, (), runner.state_caches, runner.snapshots)
        fed = share_tokens(None, message.fed_tokens, runner.device, self.data) if message.fed_tokens else None
        if message.forward.num_tokens:
            runner.forward(runner.prepare(message.forward), fed)
        self.steps += 1
        return True

    def run(self) -> None:
        """Until the head stops: receive, check, run."""
        while self.apply(receive_message(self.messages)):
            pass


def worker_main(config: EngineConfig) -> int:
    """``conveyor worker`` (and a local worker the head started, pipeline/dist/local_worker.py): join the head's
    group, load this rank's shard as the head does, and run its steps."""
    rendezvous = Rendezvous.from_env()
    if rendezvous is None or rendezvous.rank == 0:
        raise SystemExit("conveyor worker runs as rank 1.. of a torchrun-style environment (RANK, WORLD_SIZE, "
                         "MASTER_ADDR, MASTER_PORT, LOCAL_RANK); rank 0 is `conveyor serve --ep-size N`")
    if envs.LOCAL_WORKER.get():  # a worker the head started ends with it
        end_with_parent()
    config = config.resolved()
    config.validate()
    if config.cpu_threads is not None:  # the CPU's cores shared among the ranks
        set_cpu_threads(max(1, config.cpu_threads // rendezvous.world_size))
    context = join_group(config, rendezvous)
    try:
        loaded = load_model(config, parallel=context)
        Worker(loaded.runner, context.messages).run()
    finally:
        context.close()
    return 0
