"""An expert-parallel worker: a rank holding its share of the experts beside replicated dense layers and caches. It
takes the head's messages (pipeline/runner/step_message.py), checks each against its slot ledger, and runs a step's
device copies and forward as the head does, so every MoE block's all-reduce meets its peers'. It samples nothing.

Messages travel as bytes in torch.distributed broadcasts from rank 0 (gloo on CPUs): a length, then the bytes.
"""
from __future__ import annotations

from typing import Any

import torch

from pipeline.memory.kv_offload import BlockTransfers, run_block_transfers
from pipeline.runner.step_message import MessageKind, SlotLedger, StepMessage


def send_message(message: StepMessage, group: Any = None) -> None:
    """Rank 0: the message to every other rank."""
    import torch.distributed as dist

    data = message.to_bytes()
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)


def receive_message(group: Any = None) -> StepMessage:
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return StepMessage.from_bytes(data.numpy().tobytes())


class Worker:
    def __init__(self, runner, num_state_slots: int) -> None:
        self.runner = runner  # a ModelRunner over this rank's shard (ModelArchConfig.expert_shard), caches allocated
        self.ledger = SlotLedger(num_state_slots)
        self.steps = 0

    def apply(self, message: StepMessage) -> bool:
        """Check and run one message; False once the head stops."""
        self.ledger.accept(message)
        if message.kind is MessageKind.STOP:
            return False
        if message.kind is MessageKind.STEP:
            runner = self.runner
            if len(message.block_copies) or len(message.state_copies):
                copies = BlockTransfers(None, copies=[tuple(p) for p in message.block_copies.tolist()],
                                        state_copies=[tuple(p) for p in message.state_copies.tolist()])
                run_block_transfers(copies, runner.paged_caches, runner.state_caches)
            runner.forward(runner.prepare(message.forward))
            self.steps += 1
        return True

    def run(self, group: Any = None) -> None:
        """Until the head stops: receive, check, run."""
        while self.apply(receive_message(group)):
            pass
