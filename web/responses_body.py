"""Responses API bodies as plain dicts: the response object, its output items and usage, and SSE framing.

Shapes follow the `openai` package's types (Response, ResponseOutputItem, ResponseStreamEvent), which its typed
stream parser reads. Item ids are made once per item (web/output_items.py), so `response.output_item.done` and the
final response name every item alike.
"""
from __future__ import annotations

import secrets
import time

import orjson

from web.output_items import REASONING, TEXT, OutputItem
from web.responses_input import encrypted_reasoning

ITEM_ID_PREFIXES = {REASONING: "rs", TEXT: "msg", "tool_call": "fc"}


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def new_item_id(kind: str) -> str:
    return f"{ITEM_ID_PREFIXES[kind]}_{secrets.token_hex(24)}"


def responses_event(payload: dict) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def responses_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(response_id: str, created_at: int, model: str, echo: dict, *, status: str,
                    output: list[dict], usage: dict | None = None, error: dict | None = None,
                    incomplete_reason: str | None = None, previous_response_id: str | None = None) -> dict:
    body = {"id": response_id, "object": "response", "created_at": created_at, "status": status, "model": model,
            "output": output, "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "previous_response_id": previous_response_id, "usage": usage, **echo}
    if status == "completed":
        body["completed_at"] = int(time.time())
    return body


def output_item(item: OutputItem, *, status: str = "completed", summary: bool = False,
                encrypted: bool = False) -> dict:
    """An item as the response's `output` lists it (also the `output_item.done` payload)."""
    if item.kind == REASONING:
        body = {"id": item.id, "type": "reasoning", "status": status,
                "summary": [{"type": "summary_text", "text": item.text}] if summary else [],
                "content": [{"type": "reasoning_text", "text": item.text}]}
        if encrypted:
            body["encrypted_content"] = encrypted_reasoning(item.text)
        return body
    if item.kind == TEXT:
        return {"id": item.id, "type": "message", "role": "assistant", "status": status,
                "content": [text_part(item.text)]}
    return {"id": item.id, "type": "function_call", "call_id": item.call_id, "name": item.name,
            "arguments": item.text, "status": status}


def opened_item(item: OutputItem) -> dict:
    """An item as `output_item.added` announces it: in progress, nothing written yet."""
    if item.kind == REASONING:
        return {"id": item.id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
    if item.kind == TEXT:
        return {"id": item.id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    return {"id": item.id, "type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": "",
            "status": "in_progress"}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}
