"""Errors a client can cause or observe; the web layer maps each to an OpenAI error and status."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """The request cannot be served as given (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(InvalidRequest):
    """The prompt leaves no room to generate within the model's context (HTTP 400, each API's own code)."""

    def __init__(self, message: str, prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(message, "prompt")
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


class AdmissionRefused(RuntimeError):
    """The engine is at its waiting limits or draining (HTTP 503 with Retry-After)."""


class EngineDead(RuntimeError):
    """A stage failed; the engine no longer serves (HTTP 500/503)."""


class RequestFailed(RuntimeError):
    """A request ended with an error after it was admitted (timeout, output overflow, ...)."""


class CheckpointError(ValueError):
    """A model's files cannot be served as they are (an unknown quantization method, a missing or mis-shaped scale);
    the message names the field or tensor and is the server's one line at startup."""
