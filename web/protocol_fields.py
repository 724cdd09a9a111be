"""Typed readers for JSON request fields: each raises a 400 naming the field and the bad value.

JSON `null` reads as "not given" everywhere, since clients send nulls for unset options.
Booleans are not numbers here (Python's bool is an int; JSON's true is not).
"""
from __future__ import annotations

import math
import re

import orjson

from pipeline.request import RepetitionDetection
from web.protocol_errors import bad_request

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_TOKEN_ID = re.compile(r"[0-9]+")


def show(value: object, limit: int = 80) -> str:
    """The value as the client wrote it (JSON), shortened for error messages."""
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_int(body: dict, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    """An integer; an integral float (5.0) is accepted, as pydantic's lax mode does."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise bad_request(f"{name} must be an integer, got {show(value)}", name)
    number = int(value)
    if minimum is not None and number < minimum:
        raise bad_request(f"{name} must be at least {minimum}, got {number}", name)
    if maximum is not None and number > maximum:
        raise bad_request(f"{name} must be at most {maximum}, got {number}", name)
    return number


def read_float(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {show(value)}", name)
    return float(value)


def read_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {show(value)}", name)
    return value


def read_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {show(value)}", name)
    return value


def read_object(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be a JSON object, got {show(value)}", name)
    return value


def read_list(body: dict, name: str) -> list | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list, got {show(value)}", name)
    return value


def read_seed(body: dict) -> int | None:
    return read_int(body, "seed", minimum=_SEED_MIN, maximum=_SEED_MAX)


def read_stop(body: dict) -> list[str]:
    """`stop`: a string or a list of strings (any count; OpenAI's limit of 4 is not enforced)."""
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise bad_request(f"stop must be a string or a list of strings, got {show(value)}", "stop")


def read_token_ids(body: dict, name: str) -> list[int]:
    value = read_list(body, name)
    if value is None:
        return []
    if not all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in value):
        raise bad_request(f"{name} must be a list of non-negative integer token ids, got {show(value)}", name)
    return list(value)


def read_logit_bias(body: dict) -> dict[int, float] | None:
    """{"token id as a string": bias in [-100, 100]}; token ids are range-checked by the engine."""
    raw = read_object(body, "logit_bias")
    if raw is None:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        if not _TOKEN_ID.fullmatch(key):
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers as strings), "
                              f"got {show(key)}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {show(value)} "
                              f"for token {key}", "logit_bias")
        bias[int(key)] = float(value)
    return bias


def read_repetition_detection(body: dict) -> RepetitionDetection | bool | None:
    """`repetition_detection`: absent or null = the server's loop guard, false = off, or an object
    {min_pattern_size, max_pattern_size, min_count} (missing keys take the server defaults)."""
    value = body.get("repetition_detection")
    if value is None or value is False:
        return value
    if not isinstance(value, dict):
        raise bad_request("repetition_detection must be an object or false, got " + show(value),
                          "repetition_detection")
    unknown = set(value) - {"min_pattern_size", "max_pattern_size", "min_count"}
    if unknown:
        raise bad_request(f"repetition_detection has unknown keys: {sorted(unknown)}", "repetition_detection")
    defaults = RepetitionDetection()
    settings = {key: read_int(value, key) for key in ("min_pattern_size", "max_pattern_size", "min_count")}
    detection = RepetitionDetection(**{k: getattr(defaults, k) if v is None else v for k, v in settings.items()})
    try:
        detection.validate()
    except ValueError as exc:
        raise bad_request(str(exc), "repetition_detection") from exc
    return detection
