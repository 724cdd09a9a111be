"""Anthropic's error shape, {"type": "error", "error": {"type", "message"}}, with its statuses.

Every error on the Messages routes takes this shape, so the `anthropic` SDK raises its typed exceptions with our
message. A full server (admission refused, 503 elsewhere) is 529 overloaded_error, which Claude Code retries.
"""
from __future__ import annotations

import orjson

from web.protocol_errors import APIError

MESSAGES_PATHS = ("/v1/messages", "/messages")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
OVERLOADED = 529


def is_messages_path(path: str) -> bool:
    return path.startswith(MESSAGES_PATHS)


def anthropic_status(error: APIError) -> int:
    return OVERLOADED if error.status == 503 else error.status


def anthropic_error_body(error: APIError) -> dict:
    status = anthropic_status(error)
    message = error.message
    if error.code == "context_length_exceeded":
        message = "prompt is too long: " + message  # the words Claude Code's auto-compaction looks for
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


def anthropic_error_event(error: APIError) -> bytes:
    return b"event: error\ndata: " + orjson.dumps(anthropic_error_body(error)) + b"\n\n"
