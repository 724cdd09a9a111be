"""What a request asks its output to match: plain data, hashable, the key of the compile cache.

The web layer turns `response_format`, `structured_outputs` and `tool_choice` into one GrammarSpec;
the engine compiles it (pipeline/grammar/compiler.py) and every sampled token of the request is
then masked to what the grammar allows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf", "structural_tag")


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str = ""  # schema / structural tag as canonical JSON, a regex, an EBNF grammar, or a JSON list of choices

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; known: {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def structural_tag(cls, tag: dict[str, Any]) -> GrammarSpec:
        return cls("structural_tag", canonical_json(tag))


def canonical_json(value: Any) -> str:
    """One text per JSON value (sorted keys, no spaces), so equal schemas share a cache entry."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
