"""Messages between stages that are not requests or sequences themselves."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.output_channel import OutputChannel
from pipeline.request import CancelFlag, FinishReason, Request, SamplingParams


@dataclass(slots=True)
class IntakeItem:
    """A client's request before validation and tokenization (exactly one of the prompt forms)."""

    request_id: str
    channel: OutputChannel
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    on_admitted: Any = None  # callable(Request) -> None, used by the engine to index live requests
    cancel: CancelFlag = field(default_factory=CancelFlag)  # becomes the Request's flag once it is admitted


@dataclass(slots=True)
class StepTokens:
    """One step's new tokens for the detokenizer, as arrays over rows (one row per sample).

    token_ids[r] == -1 marks a row that only reports a finish (e.g. a cancelled sequence).
    """

    requests: list[Request]
    indices: list[int]
    token_ids: np.ndarray  # int64 [R]
    finish: list[FinishReason | None]
    output_counts: list[int]  # cumulative generated tokens of each row's sample
    logprobs: np.ndarray | None = None  # float32 [R]
    top_ids: np.ndarray | None = None  # int64 [R, K]
    top_logprobs: np.ndarray | None = None


@dataclass(slots=True)
class StepTokensBuilder:
    """Collects rows during one step's bookkeeping, then becomes a StepTokens message."""

    requests: list[Request] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish: list[FinishReason | None] = field(default_factory=list)
    output_counts: list[int] = field(default_factory=list)
    sampled_rows: list[int] = field(default_factory=list)  # sampler row per entry, -1 when none

    def add(self, request: Request, index: int, token: int, finish: FinishReason | None,
            output_count: int, sampler_row: int = -1) -> None:
        self.requests.append(request)
        self.indices.append(index)
        self.token_ids.append(token)
        self.finish.append(finish)
        self.output_counts.append(output_count)
        self.sampled_rows.append(sampler_row)

    def __len__(self) -> int:
        return len(self.requests)

    def build(self, logprobs: np.ndarray | None, top_ids: np.ndarray | None,
              top_logprobs: np.ndarray | None) -> StepTokens:
        def take(array: np.ndarray | None) -> np.ndarray | None:
            if array is None or not any(r >= 0 for r in self.sampled_rows):
                return None
            rows = np.asarray([max(r, 0) for r in self.sampled_rows])
            return array[rows]

        return StepTokens(
            requests=self.requests,
            indices=self.indices,
            token_ids=np.asarray(self.token_ids, dtype=np.int64),
            finish=self.finish,
            output_counts=self.output_counts,
            logprobs=take(logprobs),
            top_ids=take(top_ids),
            top_logprobs=take(top_logprobs),
        )
