"""OpenAI-style API errors, and the mapping from engine exceptions to them.

Every error a client sees has the OpenAI shape {"error": {message, type, param, code}}, so the
official clients raise their typed exceptions with our message. Internal failures never expose a
traceback or an exception repr: only the log gets those.
"""
from __future__ import annotations

from pipeline.errors import AdmissionRefused, ContextLengthExceeded, EngineDead, InvalidRequest, RequestFailed

GENERIC_SERVER_ERROR = "internal server error"


class APIError(Exception):
    """An error answer: HTTP status plus the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def api_error_from_exception(exc: BaseException) -> APIError:
    """The client-facing error for anything raised while serving a request.

    InvalidRequest -> 400 (with its param), AdmissionRefused / EngineDead -> 503 (the server sets
    Retry-After), RequestFailed -> 500 with its message (it is written for clients), anything
    else -> 500 with a generic message.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthExceeded):
        return APIError(400, str(exc), "invalid_request_error", exc.param, "context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc) or "invalid request", "invalid_request_error", exc.param)
    if isinstance(exc, AdmissionRefused):
        return APIError(503, str(exc) or "the server is overloaded; retry later", "service_unavailable")
    if isinstance(exc, EngineDead):
        # str(EngineDead) carries the failure's repr, which is for operators, not clients.
        return APIError(503, "the inference engine is not running", "service_unavailable")
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc) or "the request failed", "server_error")
    return APIError(500, GENERIC_SERVER_ERROR, "server_error")
