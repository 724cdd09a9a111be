"""Requests and what flows out of them: sampling parameters, cancel flags, output deltas.

These are the messages every stage understands. They carry no torch state, so any stage (and the
web layer) can build or read them without touching the device.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from pipeline.grammar.spec import GrammarSpec


class FinishReason(str, enum.Enum):
    """Why a sequence ended; values are the OpenAI wire strings (plus "abort" and "error")."""

    STOP = "stop"  # eos / stop token / stop string
    LENGTH = "length"  # max_tokens, max_model_len, or a forced truncation (loop guard)
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"


class CancelReason(str, enum.Enum):
    CLIENT_DISCONNECTED = "client_disconnected"
    STOP = "stop"  # a stop string matched downstream of decode
    TIMEOUT = "timeout"
    LOOP_GUARD = "loop_guard"
    ERROR = "error"
    SHUTDOWN = "shutdown"
    ABORTED = "aborted"  # Engine.abort()


# What finish_reason a sequence reports when its request was cancelled for a given reason.
CANCEL_FINISH_REASON: dict[CancelReason, FinishReason] = {
    CancelReason.CLIENT_DISCONNECTED: FinishReason.ABORT,
    CancelReason.STOP: FinishReason.STOP,
    CancelReason.TIMEOUT: FinishReason.ABORT,
    CancelReason.LOOP_GUARD: FinishReason.LENGTH,
    CancelReason.ERROR: FinishReason.ERROR,
    CancelReason.SHUTDOWN: FinishReason.ABORT,
    CancelReason.ABORTED: FinishReason.ABORT,
}


@dataclass(slots=True)
class CancelFlag:
    """Set by any stage, checked by every stage at its boundary.

    Cancelling is never just hiding output: the stage that owns the sequence sees the flag at its
    next step, finishes the sequence and frees its KV blocks. Per-child flags let a stop string end
    one of n>1 samples without ending its siblings.
    """

    reason: CancelReason | None = None
    message: str = ""
    children: set[int] = field(default_factory=set)  # child indices cancelled individually
    on_cancel: Callable[[], None] | None = None  # who waits on the flag rather than checks it (intake, compiling)

    def cancel(self, reason: CancelReason, message: str = "") -> None:
        if self.reason is None:
            self.reason = reason
            self.message = message
            if self.on_cancel is not None:
                self.on_cancel()

    def cancel_child(self, index: int) -> None:
        self.children.add(index)

    @property
    def is_set(self) -> bool:
        return self.reason is not None

    def child_is_set(self, index: int) -> bool:
        return self.reason is not None or index in self.children


@dataclass(slots=True, frozen=True)
class RepetitionDetection:
    """The loop guard: end a response (finish_reason "length") whose output ends in a pattern of
    min_pattern_size..max_pattern_size tokens repeated min_count times back to back."""

    min_pattern_size: int = 1
    max_pattern_size: int = 64
    min_count: int = 32

    def validate(self) -> None:
        if not 1 <= self.min_pattern_size <= self.max_pattern_size <= 1024:
            raise ValueError("repetition_detection needs 1 <= min_pattern_size <= max_pattern_size <= 1024, got "
                             f"{self.min_pattern_size} and {self.max_pattern_size}")
        if not 2 <= self.min_count <= 100_000:
            raise ValueError(f"repetition_detection.min_count must be in [2, 100000], got {self.min_count}")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping controls (OpenAI / vLLM semantics).

    Defaults are neutral; the engine fills unset fields from the model's generation_config.json,
    never with hidden penalties. `None` means "not set by the request".
    """

    n: int = 1
    max_tokens: int | None = None  # None: up to max_model_len
    # max_tokens past the context left: False refuses the request, True ends the output at the context's end
    max_tokens_clamped: bool = False
    min_tokens: int = 0
    temperature: float | None = None
    top_k: int | None = None  # 0 or -1: disabled
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + k top alternatives
    skip_special_tokens: bool = True
    # None: the server's default loop guard; False: off for this request
    repetition_detection: RepetitionDetection | bool | None = None
    grammar: GrammarSpec | None = None  # structured output / tool-call constraint
    thinking_token_budget: int | None = None  # at most this many tokens inside <think>...</think>
    cache_salt: str | None = None  # prefix-cache tenant: prompts with different salts share no cached block

    def validate(self) -> None:
        """Raise ValueError with a client-facing message for out-of-range values."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must not be empty")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise ValueError(f"thinking_token_budget must be non-negative, got {self.thinking_token_budget}")
        if isinstance(self.repetition_detection, RepetitionDetection):
            self.repetition_detection.validate()
        elif self.repetition_detection is True:
            raise ValueError("repetition_detection must be an object with min_pattern_size, max_pattern_size and "
                             "min_count, or false")


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass(slots=True)
class OutputDelta:
    """New output of one sample (child `index`) of a request since the previous delta.

    Deltas of the same child can be merged (see `merge`), which is how a slow reader gets coalesced
    output instead of blocking the batch.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_token_count: int = 0
    output_token_count: int = 0  # cumulative for this child
    prompt_opens_thinking: bool = False  # the prompt ends inside <think>: output starts as reasoning
    cached_prompt_tokens: int = 0  # of the prompt, tokens taken from the prefix cache
    stop_string: str | None = None  # on a final delta: the stop string that ended the output

    def merge(self, later: OutputDelta) -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason = later.finish_reason
        self.error = later.error or self.error
        self.stop_string = later.stop_string or self.stop_string
        self.output_token_count = later.output_token_count


class OutputSink(Protocol):
    """Where the stream stage delivers a request's output: its ``OutputChannel`` (pipeline/output_channel.py). That
    module carries this one's deltas, so a request names what the stream stage uses of it instead of importing it."""

    cap_bytes: int

    def push(self, delta: OutputDelta) -> bool:
        """Queue a delta without waiting; False when the unread output passed ``cap_bytes``."""


_request_counter = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_request_counter)}"


@dataclass(slots=True)
class Request:
    """A request after intake: tokenized, validated, with resolved sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output may not exceed this (min of max_model_len, prompt+max_tokens)
    cancel: CancelFlag = field(default_factory=CancelFlag)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0  # FCFS order, assigned by intake
    prompt_text: str | None = None
    channel: OutputSink | None = None  # where the stream stage delivers this request's output
    grammar: Any = None  # the compiled grammar of params.grammar (intake compiles it)
    thinking: Any = None  # ThinkingTags when a thinking budget applies
    prompt_opens_thinking: bool = False  # the prompt ends inside an open <think> block
    extra: dict[str, Any] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held when it started (prefill sets it)
    scheduled_time: float | None = None  # time.monotonic() when its first prompt chunk went into a step
    drafted_tokens: int = 0  # drafter tokens its verify rows scored (speculation), over all its samples
    accepted_tokens: int = 0  # of those, accepted

    @property
    def max_output_tokens(self) -> int:
        return self.max_total_tokens - len(self.prompt_token_ids)

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """A verify row of one of its samples scored ``drafted`` drafter tokens and accepted ``accepted``."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
