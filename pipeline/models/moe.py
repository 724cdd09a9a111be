"""The sparse mixture-of-experts MLP block, reusable across MoE families (Qwen3-MoE; Qwen3-Next /
Qwen3.5-MoE with a sigmoid-gated shared expert).

Expert weights are stacked: ``w13 [E_local, 2*I, H]`` (gate rows then up rows) and ``w2 [E_local, H, I]``.
The block holds the experts ``[expert_offset, expert_offset + num_local_experts)`` (the expert-parallel
boundary) and its forward runs in three named steps a comm stage can split:

    route(x)                          -> (topk_weights fp32 [T, k'], topk_ids [T, k'])   (global expert ids)
    experts(x, topk_weights, topk_ids) -> partial y [T, H]  (only this block's local experts contribute)
    combine(partial)                   -> y  (identity on one rank; where the all-reduce / all-to-all goes)

``k' = k``, or ``k + 1`` with the shared expert folded in. The shared expert computes
``sigmoid(shared_expert_gate(x)) * shared_expert(x)``, added to the routed output. When its intermediate size equals
the routed experts' (Qwen3-Next, Qwen3.5-MoE) it is folded in as one more expert with the global id ``num_experts``:
its gate is the router's last row (one GEMV gives the routing logits and the gate logit), ``route`` appends a
(k+1)-th slot to every token (that id, weight sigmoid(gate logit)), and the fused MoE kernels run it in the same
launches as the routed experts (at batch-1 decode that saves seven small kernels a layer). Otherwise it stays a
separate GatedMLP that ``forward`` adds after ``combine``.

Expert parallelism: the partials are summed over ranks, so the shared expert must be added by one rank only: the
block holding the last routed expert (``expert_offset + num_local_experts == num_experts``; the only block on one
GPU). Folded, it is that block's local expert ``num_local_experts`` (its id, ``num_experts``, is local to no other
block); separate, that block's forward adds it. The other blocks hold no shared-expert weights (they skip those
names), but their router keeps the gate row, so every rank's ``route`` gives the same slots.

On the GPU an FP8 checkpoint's experts stay FP8 (pipeline/models/fp8_storage.py): ``w13`` / ``w2`` are then
float8_e4m3fn stacks with float32 scale grids ``w13_scale`` / ``w2_scale`` per expert (blocks ``w13_block`` /
``w2_block``), filled expert by expert as the 16-bit stacks are.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kernels.fp8 import Fp8Weight
from kernels.moe import fused_moe, route_topk
from pipeline.models import fp8_storage
from pipeline.models.layers import GatedMLP, Linear, MergedLinear
from pipeline.dist.group import ExpertGroup


_EXPERT_RE = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"^experts\.(gate_up_proj|down_proj)(\.weight)?$")
_SHARED_NAMES = frozenset(f"shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))


class SparseMoeBlock(nn.Module):
    """Top-k routed experts (+ an optional sigmoid-gated shared expert). Parameters (HF names in brackets):
    ``gate.weight`` [E, H] (``mlp.gate.weight``), ``w13`` [E_local, 2I, H], ``w2`` [E_local, H, I]
    (``mlp.experts.{e}.{gate,up,down}_proj.weight`` or the stacked ``mlp.experts.{gate_up,down}_proj``),
    ``shared_expert`` (``mlp.shared_expert.{gate,up,down}_proj.weight``) and ``shared_expert_gate.weight``
    [1, H] (``mlp.shared_expert_gate.weight``). Folded (module docstring), the shared expert's tensors load into
    expert ``E_local`` of ``w13`` / ``w2`` [E_local + 1, ...] and its gate into the last row of ``gate.weight``
    [E + 1, H]; ``fold_shared_expert=False`` keeps it separate whatever the sizes."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert_intermediate_size: int | None = None,
        expert_offset: int = 0,
        num_local_experts: int | None = None,
        hidden_act: str = "silu",
        dtype=None,
        device=None,
        fold_shared_expert: bool = True,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported (only silu)")
        num_local = num_experts - expert_offset if num_local_experts is None else num_local_experts
        if not (0 <= expert_offset and num_local > 0 and expert_offset + num_local <= num_experts):
            raise ValueError(
                f"local experts [{expert_offset}, {expert_offset + num_local}) not within [0, {num_experts})")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} not in [1, {num_experts}]")
        self.hidden_size = hidden_size
        self.intermediate_size = moe_intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.expert_offset = expert_offset
        self.num_local_experts = num_local
        self.expert_group: ExpertGroup | None = None  # expert parallelism: the ranks that sum partial outputs
        self.has_shared_expert = bool(shared_expert_intermediate_size)
        # the shared expert as one more expert (module docstring), routed on every block, computed on one
        self.fold_shared = (self.has_shared_expert and fold_shared_expert
                            and shared_expert_intermediate_size == moe_intermediate_size)
        self.shared_expert_id = num_experts if self.fold_shared else None
        self.holds_shared = self.has_shared_expert and expert_offset + num_local == num_experts
        self.num_stacked = num_local + (self.fold_shared and self.holds_shared)  # experts in w13 / w2
        # the router; folded, padded to a multiple of 8 rows: an odd row count sends prefill-sized router GEMMs to
        # an unaligned cuBLAS kernel (6 of a 164 ms Qwen3.5-35B-A3B prefill step on an H200). Padding rows are unread
        self.router_rows = num_experts + self.fold_shared
        self.gate = Linear(hidden_size, -(-self.router_rows // 8) * 8 if self.fold_shared else num_experts, False,
                           dtype, device)
        self.w13 = nn.Parameter(
            torch.empty(self.num_stacked, 2 * moe_intermediate_size, hidden_size, dtype=dtype, device=device))
        self.w2 = nn.Parameter(
            torch.empty(self.num_stacked, hidden_size, moe_intermediate_size, dtype=dtype, device=device))
        self.register_buffer("w13_scale", None)  # FP8 stacks only (module docstring)
        self.register_buffer("w2_scale", None)
        self.w13_block: tuple[int, int] | None = None
        self.w2_block: tuple[int, int] | None = None
        self.compute_dtype = self.w13.dtype  # the 16-bit stacks' dtype (kept when they are FP8)
        if self.holds_shared and not self.fold_shared:
            self.shared_expert = GatedMLP(
                hidden_size, shared_expert_intermediate_size, False, hidden_act, dtype, device)
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype, device)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self._loaded: set[str] = set()  # HF name suffixes loaded so far (see missing_weights)

    # ---- forward, in steps ----
    reuses_input = True  # the experts read x after the router projection (see forward_projected)

    @property
    def input_proj(self) -> MergedLinear:
        """The router: the projection a fused norm may run in (``pipeline.models.layers.norm_project``)."""
        return self.gate

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights fp32 [T, k], topk_ids [T, k] global expert ids); with the shared expert
        folded in, [T, k + 1], its slot (id ``num_experts``) last. The same on every block."""
        return self.route_logits(self.gate(x))

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` from the router's output."""
        return route_topk(logits[:, :self.router_rows], self.top_k, self.norm_topk_prob, self.shared_expert_id)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This block's share of the routed output [T, H]: only its local experts contribute (tokens routed
        elsewhere get zeros here), so the full output is the sum of every holder's partial. The folded shared
        expert is local expert ``num_local_experts`` of the block that holds it."""
        return fused_moe(x, fp8_storage.expert_stack(self, "w13"), fp8_storage.expert_stack(self, "w2"), topk_weights,
                         topk_ids, self.expert_offset, self.num_stacked)

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the partial outputs over the expert-parallel group (``expert_group``, set by the model on every rank
        of a split): identity on one rank, which calls no collective."""
        return partial if self.expert_group is None else self.expert_group.all_reduce(partial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.forward_projected(self.gate(x), x)

    def forward_projected(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``forward`` given the router's output for x."""
        topk_weights, topk_ids = self.route_logits(logits)
        partial = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:  # (only on the rank holding it: before the sum, so every rank gets it)
            partial = partial + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.combine(partial)

    # ---- loading from HF names (relative to the block: "gate.weight", "experts.3.up_proj.weight", ...) ----
    def expected_weights(self) -> set[str]:
        """Every HF name suffix (per-expert form) that must be loaded to fill this block."""
        names = {"gate.weight"}
        for e in range(self.expert_offset, self.expert_offset + self.num_local_experts):
            names |= {f"experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        if self.fold_shared or self.holds_shared:  # folded, the gate is a router row on every block
            names.add("shared_expert_gate.weight")
        if self.holds_shared:
            names |= _SHARED_NAMES
        return names

    def begin_loading(self) -> None:
        """Forget what an earlier load filled: ``missing_weights`` then counts from nothing."""
        self._loaded.clear()

    def missing_weights(self) -> list[str]:
        return sorted(self.expected_weights() - self._loaded)

    @torch.no_grad()
    def load_expert_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Load one HF tensor given by its name relative to the block. Returns False when the tensor is
        skipped (experts outside this block's local range; the shared expert on a block that does not hold it).
        Raises KeyError on an unknown name and ValueError on a shape mismatch.

        Accepts the per-expert names (``experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H],
        ``down_proj`` [H, I]) and the stacked transformers-5 forms ``experts.gate_up_proj`` ([E, 2I, H], or
        [E, H, 2I] transposed) and ``experts.down_proj`` ([E, H, I], or [E, I, H] transposed)."""
        I, H = self.intermediate_size, self.hidden_size
        lo, hi = self.expert_offset, self.expert_offset + self.num_local_experts
        m = _EXPERT_RE.match(name)
        if m:
            e, part = int(m.group(1)), m.group(2)
            if not 0 <= e < self.num_experts:
                raise KeyError(f"{name}: expert {e} out of range [0, {self.num_experts})")
            if not lo <= e < hi:
                return False
            which, start = {"gate_proj": ("w13", 0), "up_proj": ("w13", I), "down_proj": ("w2", 0)}[part]
            fp8_storage.load_expert_rows(self, which, e - lo, start, name, tensor)
            self._loaded.add(name)
            return True
        m = _STACKED_RE.match(name)
        if m:
            E = self.num_experts
            if m.group(1) == "gate_up_proj":
                which, direct, transposed, parts = "w13", (E, 2 * I, H), (E, H, 2 * I), ("gate_proj", "up_proj")
            else:
                which, direct, transposed, parts = "w2", (E, H, I), (E, I, H), ("down_proj",)
            shape = tuple(tensor.shape)
            if shape == direct and isinstance(tensor, Fp8Weight):  # the FP8 stack's own experts, scales with them
                experts = Fp8Weight(tensor.q[lo:hi], tensor.scale[lo:hi], tensor.block)
                fp8_storage.load_expert_rows(self, which, slice(0, hi - lo), 0, name, experts)
                self._loaded |= {f"experts.{e}.{p}.weight" for e in range(lo, hi) for p in parts}
                return True
            if isinstance(tensor, Fp8Weight):
                tensor = tensor.dequantize(self.compute_dtype)
            if shape == direct:  # preferred when both match (2I == H / I == H): the layout this transformers saves
                src = tensor[lo:hi]
            elif shape == transposed:
                src = tensor[lo:hi].transpose(1, 2)
            else:
                raise ValueError(f"{name}: checkpoint shape {shape} is neither {direct} nor {transposed}")
            # a folded shared expert, after the routed ones, is left alone
            fp8_storage.load_expert_rows(self, which, slice(0, hi - lo), 0, name, src)
            self._loaded |= {f"experts.{e}.{p}.weight" for e in range(lo, hi) for p in parts}
            return True
        if name == "gate.weight":
            dst = self.gate.weight.data[: self.num_experts]
            self.gate.weight.data[self.router_rows:].zero_()  # the router's alignment rows (never read)
        elif self.has_shared_expert and (name == "shared_expert_gate.weight" or name in _SHARED_NAMES):
            if not self._load_shared(name, tensor):
                return False
            self._loaded.add(name)
            return True
        else:
            raise KeyError(f"unknown MoE weight name {name!r}")
        self._copy(name, dst, tensor)
        self._loaded.add(name)
        return True

    def _load_shared(self, name: str, tensor: torch.Tensor | Fp8Weight) -> bool:
        """A shared-expert tensor into its place: folded, the router's last row and expert ``num_local_experts`` of
        ``w13`` / ``w2``; else the separate modules. False where this block does not take it (module docstring)."""
        if name == "shared_expert_gate.weight":
            if self.fold_shared:
                self._copy(name, self.gate.weight.data[self.num_experts:self.router_rows], tensor)
            elif self.holds_shared:
                self.shared_expert_gate.load_weight(None, name, tensor)
            else:
                return False
            return True
        if not self.holds_shared:
            return False
        part = name.split(".")[1]
        if self.fold_shared:
            which, start = {"gate_proj": ("w13", 0), "up_proj": ("w13", self.intermediate_size),
                            "down_proj": ("w2", 0)}[part]
            fp8_storage.load_expert_rows(self, which, self.num_local_experts, start, name, tensor)
        elif part == "down_proj":
            self.shared_expert.down_proj.load_weight(None, name, tensor)
        else:
            self.shared_expert.gate_up_proj.load_weight(0 if part == "gate_proj" else 1, name, tensor)
        return True

    @staticmethod
    def _copy(name: str, dst: torch.Tensor, tensor: torch.Tensor | Fp8Weight) -> None:
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
        dst.copy_(tensor.dequantize(dst.dtype) if isinstance(tensor, Fp8Weight) else tensor)

    def extra_repr(self) -> str:
        shared = ("folded" if self.fold_shared else "separate") if self.has_shared_expert else "none"
        if self.has_shared_expert and not self.holds_shared:
            shared += " (on another rank)"
        return (f"experts={self.num_experts}, local=[{self.expert_offset}, "
                f"{self.expert_offset + self.num_local_experts}), top_k={self.top_k}, "
                f"intermediate={self.intermediate_size}, norm_topk_prob={self.norm_topk_prob}, "
                f"shared_expert={shared}")
