"""OpenAI response bodies as plain dicts (ready for orjson), plus SSE framing.

Shapes follow the `openai` package's types (ChatCompletion, ChatCompletionChunk, Completion, Model)
so the official client parses them, strict validation included, except where OpenAI's own
streams differ (completion chunks carry finish_reason null until the last one).
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import orjson

from pipeline.request import FinishReason, TokenLogprob

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]

SSE_DONE = b"data: [DONE]\n\n"
# OpenAI reports "very unlikely" as -9999.0; JSON has no -inf (orjson would write null).
LOGPROB_FLOOR = -9999.0
OWNED_BY = "conveyor"

# The openai types accept only stop/length/tool_calls/content_filter/function_call. A sequence the
# server cut short (abort: timeout, shutdown, admin abort) or that failed mid-way is reported as
# "length": the answer is truncated, and agent clients must not read it as a complete "stop"
# (docs/architecture.md, invariant 2). Errors are also sent as an error object; this is only the choice's field.
WIRE_FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "length",
    FinishReason.ERROR: "length",
}


def sse_event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class TextEvent:
    """The SSE event of a stream chunk whose one variable part is a text field, kept as the bytes
    around that field. Made from the chunk's own dict and encoding (with a marker as the text), so
    it is byte-identical to encoding the dict, and a delta then costs one string encoding instead
    of building and encoding the chunk: at batch 256 that is a quarter of a step's host time."""

    _MARK = "\x00conveyor-text\x00"

    def __init__(self, chunk_with_text: Callable[[str], dict]) -> None:
        before, after = sse_event(chunk_with_text(self._MARK)).split(orjson.dumps(self._MARK))
        self._before, self._after = before, after

    def __call__(self, text: str) -> bytes:
        return self._before + orjson.dumps(text) + self._after


def new_chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def wire_finish_reason(reason: FinishReason | str | None) -> str | None:
    """The engine's FinishReason as a wire string; other strings ("tool_calls") pass through."""
    if reason is None:
        return None
    if isinstance(reason, FinishReason):
        return WIRE_FINISH_REASONS[reason]
    try:
        return WIRE_FINISH_REASONS[FinishReason(reason)]
    except ValueError:
        return reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# ---- logprobs -------------------------------------------------------------------------------------

def _wire_logprob(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN (comparison is False)


def _memo(token_text: TokenText) -> TokenText:
    """Per-call cache: top-k alternatives repeat the same tokens across positions."""
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        found = cache.get(token_id)
        if found is None:
            found = cache[token_id] = token_text(token_id)
        return found

    return text


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText,
                  token_bytes: TokenBytes | None = None) -> dict:
    """Chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.

    `bytes` defaults to the UTF-8 of the token's text; a token that is part of a multi-byte
    character decodes to U+FFFD alone, so pass `token_bytes` where the exact bytes matter.
    """
    text = _memo(token_text)

    def as_bytes(token_id: int) -> list[int]:
        return list(token_bytes(token_id) if token_bytes is not None else text(token_id).encode("utf-8"))

    content = [
        {
            "token": text(entry.token_id),
            "logprob": _wire_logprob(entry.logprob),
            "bytes": as_bytes(entry.token_id),
            "top_logprobs": [{"token": text(tid), "logprob": _wire_logprob(lp), "bytes": as_bytes(tid)}
                             for tid, lp in entry.top],
        }
        for entry in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, text_offset: int = 0) -> dict:
    """Completions `logprobs`: parallel lists; text_offset counts characters from `text_offset`.

    Pass the length of the text already returned for this choice (prompt included when echoing)
    so offsets continue across stream chunks. Each top_logprobs dict holds the sampled token
    first, then the k alternatives (OpenAI: "up to logprobs+1 elements").
    """
    text = _memo(token_text)
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for entry in entries:
        token = text(entry.token_id)
        tokens.append(token)
        token_logprobs.append(_wire_logprob(entry.logprob))
        top = {token: _wire_logprob(entry.logprob)}
        for tid, lp in entry.top:
            top.setdefault(text(tid), _wire_logprob(lp))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


# ---- chat -----------------------------------------------------------------------------------------

def chat_choice(index: int, content: str | None, finish_reason: FinishReason | str | None, *,
                logprobs: dict | None = None, reasoning_content: str | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if reasoning_content is not None:
        message["reasoning_content"] = reasoning_content
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": wire_finish_reason(finish_reason)}


def chat_completion(completion_id: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def chat_delta_choice(index: int, *, role: str | None = None, content: str | None = None,
                      reasoning_content: str | None = None, tool_calls: list[dict] | None = None,
                      logprobs: dict | None = None, finish_reason: FinishReason | str | None = None) -> dict:
    """One choice of a stream chunk; the first chunk of a choice carries role "assistant"."""
    delta: dict = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": wire_finish_reason(finish_reason)}


def _chunk(object_type: str, completion_id: str, created: int, model: str, choices: list[dict],
           include_usage: bool, usage: dict | None) -> dict:
    """With include_usage every chunk has a "usage" key (null until the final usage-only chunk)."""
    chunk = {"id": completion_id, "object": object_type, "created": created, "model": model, "choices": choices}
    if include_usage:
        chunk["usage"] = usage
    return chunk


def chat_chunk(completion_id: str, created: int, model: str, choices: list[dict], *,
               include_usage: bool = False, usage: dict | None = None) -> dict:
    return _chunk("chat.completion.chunk", completion_id, created, model, choices, include_usage, usage)


def chat_usage_chunk(completion_id: str, created: int, model: str, usage: dict) -> dict:
    return chat_chunk(completion_id, created, model, [], include_usage=True, usage=usage)


# ---- completions ----------------------------------------------------------------------------------

def completion_choice(index: int, text: str, finish_reason: FinishReason | str | None, *,
                      logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": wire_finish_reason(finish_reason)}


def completion_response(completion_id: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def completion_chunk(completion_id: str, created: int, model: str, choices: list[dict], *,
                     include_usage: bool = False, usage: dict | None = None) -> dict:
    """Streamed completions use the same object type as the full response (unlike chat)."""
    return _chunk("text_completion", completion_id, created, model, choices, include_usage, usage)


def completion_usage_chunk(completion_id: str, created: int, model: str, usage: dict) -> dict:
    return completion_chunk(completion_id, created, model, [], include_usage=True, usage=usage)


# ---- models ---------------------------------------------------------------------------------------

def models_list(names: list[str], created: int, max_model_len: int) -> dict:
    """GET /v1/models; root/parent/max_model_len are vLLM's extra fields, which clients read too."""
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY, "root": name, "parent": None,
         "max_model_len": max_model_len}
        for name in names
    ]}

