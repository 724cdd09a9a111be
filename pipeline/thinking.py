"""The thinking budget: a reasoning model may think for at most N tokens, then `</think>` is forced.

Works on token ids, so it needs no detokenization: the opening and closing tags are matched as
id sequences at the end of the output (for Qwen3 each is one special token). A sample starts
inside a thinking block when its prompt opened one (templates that write `<think>` for the model).
While the budget is spent and the block is open, the sampler's forced-token step emits the
closing tag's ids one per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class ThinkingTags:
    start_ids: tuple[int, ...]  # "<think>"
    end_ids: tuple[int, ...]  # "</think>"

    def prompt_opens_block(self, prompt_ids: list[int], window: int = 64) -> bool:
        """Whether the prompt ends inside an open thinking block. Templates open it in the generation
        prompt, so only the last `window` tokens are looked at (cheap for 100k-token prompts)."""
        tail = prompt_ids[-window:]
        start, end = _last_index(tail, self.start_ids), _last_index(tail, self.end_ids)
        return start > end


@dataclass(slots=True)
class ThinkingBudget:
    tags: ThinkingTags
    budget: int
    inside: bool  # a thinking block is open
    used: int = 0  # tokens generated inside thinking blocks
    forcing: int = 0  # how many closing-tag ids were forced so far (while closing)
    recent: list[int] = field(default_factory=list)  # the last few output ids, for matching multi-token tags

    @property
    def forced_token(self) -> int | None:
        """The id the next token must be, or None."""
        if self.inside and self.used >= self.budget:
            return self.tags.end_ids[self.forcing]
        return None

    @property
    def active(self) -> bool:
        """Whether the budget may still force a token (its sequence must wait for each token)."""
        return self.inside or self.used < self.budget

    def forced_after(self, tokens: list[int]) -> int | None:
        """``forced_token`` once ``tokens`` are observed, this budget left as it is (a speculative verify row's, after
        the drafts before it)."""
        copy = ThinkingBudget(self.tags, self.budget, self.inside, self.used, self.forcing, list(self.recent))
        for token in tokens:
            forced = copy.forced_token
            if forced is not None and token != forced:  # a draft the budget would not allow: rejected there, so
                return forced  # the rows after it are never used
            copy.observe(token)
        return copy.forced_token

    def observe(self, token_id: int) -> None:
        recent = self.recent
        recent.append(token_id)
        width = max(len(self.tags.start_ids), len(self.tags.end_ids))
        if len(recent) > width:
            del recent[: len(recent) - width]
        if self.inside:
            if self.used >= self.budget:
                self.forcing += 1
            else:
                self.used += 1
            if _ends_with(recent, self.tags.end_ids):
                self.inside = False
                self.forcing = 0
        elif _ends_with(recent, self.tags.start_ids):
            self.inside = True


def _ends_with(ids: list[int], tail: tuple[int, ...]) -> bool:
    return bool(tail) and len(ids) >= len(tail) and tuple(ids[-len(tail):]) == tail


def _last_index(ids: list[int], pattern: tuple[int, ...]) -> int:
    """Start of the last occurrence of `pattern` in `ids`, or -1."""
    n = len(pattern)
    for start in range(len(ids) - n, -1, -1):
        if tuple(ids[start:start + n]) == pattern:
            return start
    return -1
