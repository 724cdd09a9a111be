"""How every bench script hands over its result: pretty JSON on stdout, and the same into --out."""
from __future__ import annotations

import json


def emit_json(report: dict, out: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        with open(out, "w") as handle:
            handle.write(text + "\n")
