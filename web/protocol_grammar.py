"""`response_format` and `structured_outputs`: what a request's output must match, as a GrammarSpec.

OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
"schema", "strict"}}. The vLLM-style extension `structured_outputs` takes exactly one of "json"
(a schema, or a JSON string of one), "json_object": true, "regex", "choice" (a list of strings),
"grammar" (EBNF) or "structural_tag". Asking for both is an error rather than a silent choice.
Compilation errors (a bad schema or regex) surface from the engine as 400s naming response_format.
"""
from __future__ import annotations

import orjson

from pipeline.grammar.spec import GrammarSpec
from web.protocol_errors import bad_request
from web.protocol_fields import read_object, show

STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def read_grammar(body: dict) -> GrammarSpec | None:
    from_format = _response_format(body)
    from_extension = _structured_outputs(body)
    if from_format is not None and from_extension is not None:
        raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
    return from_format or from_extension


def _response_format(body: dict) -> GrammarSpec | None:
    fmt = read_object(body, "response_format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a schema",
                              "response_format.json_schema")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise bad_request(f"response_format.json_schema.schema must be a JSON schema object, got {show(schema)}",
                              "response_format.json_schema.schema")
        return GrammarSpec.json_schema(schema)
    raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {show(kind)}",
                      "response_format.type")


def _structured_outputs(body: dict) -> GrammarSpec | None:
    options = read_object(body, "structured_outputs")
    if options is None:
        return None
    given = {k: v for k, v in options.items() if k in STRUCTURED_KEYS and v not in (None, False)}
    unknown = set(options) - set(STRUCTURED_KEYS)
    if unknown:
        raise bad_request(f"structured_outputs has unknown keys {sorted(unknown)}; known: {list(STRUCTURED_KEYS)}",
                          "structured_outputs")
    if len(given) != 1:
        raise bad_request(f"structured_outputs needs exactly one of {list(STRUCTURED_KEYS)}, got {sorted(given)}",
                          "structured_outputs")
    (key, value), = given.items()
    where = f"structured_outputs.{key}"
    if key == "json":
        value = _parsed_if_string(value, where)
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{where} must be a JSON schema, got {show(value)}", where)
        return GrammarSpec.json_schema(value)
    if key == "json_object":
        return GrammarSpec("json_object")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{where} must be a non-empty list of non-empty strings, got {show(value)}", where)
        return GrammarSpec.choice(value)
    if key == "structural_tag":
        value = _parsed_if_string(value, where)
        if not isinstance(value, dict):
            raise bad_request(f"{where} must be a structural tag object, got {show(value)}", where)
        return GrammarSpec.structural_tag(value)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a non-empty string, got {show(value)}", where)
    return GrammarSpec("regex" if key == "regex" else "ebnf", value)


def _parsed_if_string(value: object, where: str) -> object:
    """A JSON document sent as a string is parsed; anything else is returned as it is."""
    if not isinstance(value, str):
        return value
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        raise bad_request(f"{where} is not valid JSON", where) from None
