"""The OpenAI wire protocol in one import: request parsing, response builders, errors, SSE."""
from __future__ import annotations

from web.protocol_errors import GENERIC_SERVER_ERROR, APIError, api_error_from_exception, bad_request
from web.protocol_requests import (COMPLETION_DEFAULT_MAX_TOKENS, MAX_LOGPROBS, ChatRequest, CompletionRequest,
                                   parse_chat_request, parse_completion_request)
from web.protocol_responses import (LOGPROB_FLOOR, SSE_DONE, WIRE_FINISH_REASONS, TextEvent, chat_chunk,
                                    chat_choice, chat_completion, chat_delta_choice, chat_logprobs, chat_usage_chunk,
                                    completion_choice, completion_chunk, completion_logprobs, completion_response,
                                    completion_usage_chunk, models_list, new_chat_id, new_completion_id, sse_event,
                                    usage, wire_finish_reason)

__all__ = [
    "APIError", "COMPLETION_DEFAULT_MAX_TOKENS", "ChatRequest", "CompletionRequest", "GENERIC_SERVER_ERROR",
    "LOGPROB_FLOOR", "MAX_LOGPROBS", "SSE_DONE", "TextEvent", "WIRE_FINISH_REASONS", "api_error_from_exception",
    "bad_request", "chat_chunk", "chat_choice", "chat_completion", "chat_delta_choice", "chat_logprobs",
    "chat_usage_chunk", "completion_choice", "completion_chunk", "completion_logprobs", "completion_response",
    "completion_usage_chunk", "models_list", "new_chat_id", "new_completion_id", "parse_chat_request",
    "parse_completion_request", "sse_event", "usage", "wire_finish_reason",
]
