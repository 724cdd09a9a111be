"""One sample of a request as the device stages see it: its tokens, its KV blocks, its progress.

A Sequence is owned by exactly one stage at a time (prefill while its prompt is computed, decode
while it generates) and moves between them inside messages; nobody else mutates it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import ext
from pipeline.memory.state_slots import StateSlot
from pipeline.request import CANCEL_FINISH_REASON, FinishReason, RepetitionDetection, Request
from pipeline.runner.sampling_batch import depends_on_output_tokens
from pipeline.thinking import ThinkingBudget

_seq_ids = itertools.count(1)
RepetitionDetector = ext.load("repetition").RepetitionDetector
_penalties = ext.load("penalties")


def new_grammar_state(request: Request) -> Any:
    """A fresh GrammarState for one sample of a constrained request (None when unconstrained)."""
    if request.grammar is None:
        return None
    from pipeline.grammar.state import GrammarState

    return GrammarState(request.grammar)


def new_token_counts(request: Request) -> Any:
    """Penalty bookkeeping for a sample of a request that uses penalties (None otherwise)."""
    p = request.params
    if p.repetition_penalty in (None, 1.0) and not p.presence_penalty and not p.frequency_penalty:
        return None
    return _penalties.TokenCounts(request.prompt_token_ids)


def new_thinking_budget(request: Request) -> ThinkingBudget | None:
    budget = request.params.thinking_token_budget
    if budget is None or request.thinking is None:
        return None
    return ThinkingBudget(request.thinking, budget, inside=request.prompt_opens_thinking)


def new_loop_guard(request: Request) -> RepetitionDetector | None:
    setting = request.params.repetition_detection
    if not isinstance(setting, RepetitionDetection):
        return None
    return RepetitionDetector(setting.min_pattern_size, setting.max_pattern_size, setting.min_count)
_MASK63 = (1 << 63) - 1


def mix_seed(seed: int, salt: int) -> int:
    """splitmix64-style mix: a child's seed from the request seed and its index."""
    z = (seed + 0x9E3779B97F4A7C15 * (salt + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


@dataclass(slots=True, eq=False)  # an entity: compared by identity (list membership stays O(1) per item)
class Sequence:
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt followed by generated tokens
    seed: int
    num_samples: int = 1  # rows to sample when the prompt completes (n for a fresh parent, else 1)
    num_computed: int = 0  # tokens whose K/V sit in this sequence's blocks
    block_ids: list[int] = field(default_factory=list)
    state_slot: StateSlot | None = None  # hybrid models: this sequence's recurrent state slot (with its epoch)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    loop_guard: RepetitionDetector | None = None  # fed every output token (survives preemption)
    grammar: Any = None  # GrammarState when the request constrains its output; advanced per token
    thinking: ThinkingBudget | None = None  # the thinking budget's state; forces </think> when spent
    token_counts: Any = None  # TokenCounts (ext/penalties) when the request uses penalties
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full blocks
    num_keyed: int = 0  # its first blocks whose keys the cache holds (cached ones taken, or registered)
    missed_at: int = -1  # the pool's keys_added at a prefix lookup that found nothing (none again until it grows)
    snapshot_pos: int = 0  # hybrid models: where its state was last snapshotted (or restored from)
    restore_from: int | None = None  # hybrid models: the pinned snapshot its state slot gets when allocated
    draft_history: Any = None  # the drafter's copy of token_ids (pipeline/spec/ngram.py), grown as they are
    draft_acceptance: float = 1.0  # average share of its drafts accepted (pipeline/spec/budget.py)
    draft_wait: int = 0  # steps before its next chance to draft (pipeline/spec/budget.py)
    draft_backoff: int = 0  # the last wait given: doubled while its chances bring nothing accepted
    # hybrid models with drafts: slots that keep its state after each token of a verify row but the last (the one
    # after the last accepted token goes back into its slot)
    spare_slots: list[StateSlot] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: Request) -> Sequence:
        seed = request.params.seed if request.params.seed is not None else 0
        return cls(
            request=request,
            index=0,
            token_ids=list(request.prompt_token_ids),
            seed=mix_seed(seed, 0),
            num_samples=request.params.n,
            loop_guard=new_loop_guard(request),
            grammar=new_grammar_state(request),
            thinking=new_thinking_budget(request),
            token_counts=new_token_counts(request),
        )

    def fork(self, index: int, shared_blocks: list[int], block_size: int, grammar: Any = None) -> Sequence:
        """A sibling sample that shares the prompt's full blocks and recomputes only the partial tail.

        Sharing only full blocks means no block is ever written by two sequences, so there is no
        copy-on-write: the tail (< block_size tokens) is cheap to recompute in the sibling's first step.
        """
        return Sequence(
            request=self.request,
            index=index,
            token_ids=self.token_ids[: self.num_prompt_tokens],
            seed=mix_seed(self.request.params.seed or 0, index),
            num_computed=len(shared_blocks) * block_size,
            block_ids=shared_blocks,
            loop_guard=new_loop_guard(self.request),
            grammar=grammar,
            thinking=new_thinking_budget(self.request),
            token_counts=new_token_counts(self.request),
        )

    @property
    def arrival(self) -> tuple[int, int]:
        """FCFS key: the request's arrival, then the sample index."""
        return (self.request.arrival_seq, self.index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def reads_own_tokens(self) -> bool:
        """Whether picking the next token needs this sample's previous token recorded first
        (thinking budget, penalties, min_tokens): no running ahead for it. A grammar does not:
        the runner gives its matcher the token still on its way (grammar.state.take_tokens)."""
        if self.thinking is not None and self.thinking.active:
            return True
        return depends_on_output_tokens(self.request.params, self.num_output_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still have to be computed (1 while decoding)."""
        return len(self.token_ids) - self.num_computed

    def cancel_reason(self) -> FinishReason | None:
        """The finish reason if this sample's request (or the sample alone) was cancelled."""
        flag = self.request.cancel
        if flag.reason is not None:
            return CANCEL_FINISH_REASON[flag.reason]
        if self.index in flag.children:
            return FinishReason.STOP  # a stop string matched downstream
        return None

    def append_token(self, token_id: int) -> FinishReason | None:
        """Record a sampled token and say whether it ends the sequence."""
        self.token_ids.append(token_id)
        if self.token_counts is not None:
            self.token_counts.add(token_id)
        params = self.request.params
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in self.request.eos_token_ids:
            return FinishReason.STOP
        if len(self.token_ids) >= self.request.max_total_tokens:
            return FinishReason.LENGTH
        if self.thinking is not None:
            self.thinking.observe(token_id)
        if self.grammar is not None and self.grammar.record(token_id):
            return FinishReason.STOP  # the grammar is complete (or refused a token: the mask prevents it)
        if self.loop_guard is not None and self.loop_guard.feed(token_id):
            return FinishReason.LENGTH  # a degenerate loop: end it and free the sequence now
        return None
