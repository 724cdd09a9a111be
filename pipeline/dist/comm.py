"""The comm stage: the head's side of expert parallelism, on its device thread, in step order.

Before each step the head runs, it tells the workers what changed and what to run: the state slots released and
allocated since the previous step (RELEASE, ALLOCATE), then the step (STEP: its forward batch, each row's slot
epoch, and the device copies before it). Messages travel over their own gloo group, so they never queue behind the
data. After the head's own copies, the device bytes the workers cannot make themselves follow over the data group
(NCCL on GPUs): blocks and snapshots the head's KV tiers restored (the workers keep no tiers: every rank's caches
hold the same bytes, so the head's copy is theirs), and the previous step's sampled tokens the forward feeds (the
workers sample nothing). Then every rank runs the forward, whose MoE blocks sum their partial outputs in the same
order. ``pipeline/dist/worker.py`` is the other side.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.dist.step_message import MessageKind, StepMessage
from pipeline.memory.block_transfers import BlockTransfers
from pipeline.memory.state_slots import StateSlot
from pipeline.runner.step_plan import StepPlan


def send_message(message: StepMessage, group: Any = None) -> int:
    """Rank 0: the message to every other rank (a length, then the bytes); its size."""
    import torch.distributed as dist

    data = message.to_bytes()
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)
    return len(data)


def receive_message(group: Any = None) -> StepMessage:
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return StepMessage.from_bytes(data.numpy().tobytes())


def share_rows(tensors: Sequence[torch.Tensor], dim: int, indices: np.ndarray, head: bool, group: Any = None) -> None:
    """The head's rows ``indices`` (along ``dim``) of each tensor into the same rows of every rank's tensors."""
    import torch.distributed as dist

    if not len(indices):
        return
    index = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)).to(tensors[0].device)
    for tensor in tensors:
        tensor = tensor.view(torch.uint8)  # the bytes, whatever the dtype (gloo and CPU index_copy_ lack float8)
        rows = tensor.index_select(dim, index).contiguous()
        dist.broadcast(rows, src=0, group=group)
        if not head:
            tensor.index_copy_(dim, index, rows)


def share_tokens(tokens: torch.Tensor | None, count: int, device: torch.device, group: Any = None) -> torch.Tensor:
    """The previous step's sampled ids (int64 [count]) from the head's device to every rank's."""
    import torch.distributed as dist

    if tokens is None:
        tokens = torch.empty(count, dtype=torch.int64, device=device)
    dist.broadcast(tokens, src=0, group=group)
    return tokens


def _pairs(pairs: list[tuple[int, int]] | None) -> np.ndarray:
    return np.array(pairs or [], dtype=np.int64).reshape(-1, 2)


_NO_COPIES = BlockTransfers(None)  # a step without copies (read only)


def _targets(pairs: list[tuple[int, int]]) -> np.ndarray:
    """The destinations of (source, destination) copies: what a restore fills."""
    return np.array([target for _, target in pairs], dtype=np.int64)


def _slots(slots: list[StateSlot]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([s.index for s in slots], dtype=np.int64), np.array([s.epoch for s in slots], dtype=np.int64))


class CommStage:
    """The head's messages, numbered from 0. ``shared_caches`` / ``shared_states``: how many of the head's paged
    caches and recurrent caches the workers hold (the first ones: a drafter's caches come after the target's)."""

    def __init__(self, messages: Any, data: Any, shared_caches: int, shared_states: int) -> None:
        self.messages = messages  # the gloo group the messages travel in
        self.data = data  # the group of the device bytes and the MoE all-reduces (None: the default one)
        self.shared_caches = shared_caches
        self.shared_states = shared_states
        self.number = 0
        self.bytes_sent = 0

    def _send(self, message: StepMessage) -> None:
        self.bytes_sent += send_message(message, self.messages)
        self.number += 1

    def send_step(self, plan: StepPlan, previous_tokens: torch.Tensor | None) -> None:
        """Before the head's copies for ``plan``: the slot changes since the last plan, then the step."""
        changes = plan.slot_changes
        if changes is not None and changes.released:
            self._send(StepMessage(MessageKind.RELEASE, self.number, *_slots(changes.released)))
        if changes is not None and changes.allocated:
            self._send(StepMessage(MessageKind.ALLOCATE, self.number, *_slots(changes.allocated)))
        forward = plan.forward
        copies = plan.transfers or _NO_COPIES
        epochs = plan.state_epochs if plan.state_epochs is not None else np.zeros(forward.num_seqs, dtype=np.int64)
        fed = 0 if not len(forward.feed_targets) or previous_tokens is None else int(previous_tokens.shape[0])
        self._send(StepMessage(
            MessageKind.STEP, self.number, epochs=epochs, block_copies=_pairs(copies.copies),
            loaded_blocks=_targets(copies.loads), loaded_snapshots=_targets(copies.snapshot_loads),
            state_copies=_pairs(copies.state_copies), state_saves=_pairs(copies.state_saves),
            state_loads=_pairs(copies.state_loads), fed_tokens=fed, forward=forward))

    def share(self, plan: StepPlan, previous_tokens: torch.Tensor | None, paged: Sequence[torch.Tensor],
              snapshots: Sequence[torch.Tensor]) -> None:
        """After the head's copies, before its forward: the restored blocks and snapshots, the fed tokens."""
        if plan.transfers is not None:
            share_rows(paged[:self.shared_caches], 1, _targets(plan.transfers.loads), True, self.data)
            share_rows(snapshots[:self.shared_states], 0, _targets(plan.transfers.snapshot_loads), True, self.data)
        if len(plan.forward.feed_targets) and previous_tokens is not None:
            share_tokens(previous_tokens, 0, previous_tokens.device, self.data)

    def stop(self) -> None:
        self._send(StepMessage(MessageKind.STOP, self.number))
